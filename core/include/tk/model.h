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

/// A model that counts its own arithmetic, so that each step's record has its FLOP rate and, with
/// run.peak_gflops, its model FLOPs utilization (MFU): implement it next to tk::Model. The
/// built-in mlp, cnn and gpt do.
class ModelWithFlops {
 public:
  /// Floating-point operations (a multiply-add counts 2) of forward and backward on one batch
  /// whose input has `input_sizes`: its matrix products and convolutions, backward counted as twice
  /// forward (gradients of the inputs and of the weights), as PaLM's and llm.c's counts do;
  /// elementwise work, norms and softmax are not counted.
  virtual double train_flops(c10::IntArrayRef input_sizes) const = 0;

 protected:
  ModelWithFlops() = default;
  ModelWithFlops(const ModelWithFlops&) = default;
  ModelWithFlops& operator=(const ModelWithFlops&) = default;
  virtual ~ModelWithFlops();
};

/// `model` as a ModelWithFlops, or null when it does not count its FLOPs.
const ModelWithFlops* flops_of(const Model& model);
/// train_flops of `model` on a batch of `input_sizes`, or a negative number when it does not count.
double train_flops_of(const Model& model, c10::IntArrayRef input_sizes);

}  // namespace tk
