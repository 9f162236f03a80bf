#pragma once
/// The interface every model implements, built-in or a user's.
#include <torch/nn/module.h>

#include <memory>

namespace tk {

/// A trainable model: a torch::nn::Module with a single-tensor forward.
class Model : public torch::nn::Module {
 public:
  using torch::nn::Module::Module;
  /// Maps a batch of inputs to outputs (logits or predictions).
  virtual torch::Tensor forward(const torch::Tensor& input) = 0;
};
using ModelPtr = std::shared_ptr<Model>;

/// True when any submodule is a BatchNorm layer (whose statistics are per micro-batch).
bool has_batchnorm(torch::nn::Module& m);

}  // namespace tk
