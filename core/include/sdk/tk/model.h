#pragma once
/// The interface every model implements, built-in or a user's.
#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

// What this header declares is libtrainkit's interface: exported (the library hides the rest).
#pragma GCC visibility push(default)

namespace tk {

/// A trainable model: a torch::nn::Module with a single-tensor forward.
class Model : public torch::nn::Module {
 public:
  using torch::nn::Module::Module;
  /// Maps a batch of inputs to outputs (logits or predictions).
  virtual torch::Tensor forward(const torch::Tensor& input) = 0;
};
using ModelPtr = std::shared_ptr<Model>;

/// `tensors` with each tensor once, in the order of its first place. A module that registers one
/// parameter under two names (a weight tied in a TorchScript module) lists it twice in
/// parameters(); what sums, steps or counts parameters takes each once.
std::vector<at::Tensor> distinct_tensors(const std::vector<at::Tensor>& tensors);
/// `module`'s parameters, each tensor once under its first name (see distinct_tensors).
std::vector<std::pair<std::string, at::Tensor>> distinct_parameters(const torch::nn::Module& module);

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

/// A model that runs as one compiled graph (the torchscript model): its submodules hold its
/// parameters but cannot be run one at a time, which is what recomputation needs. Implement it
/// next to tk::Model; what acts on submodules asks compiled_of.
class CompiledModel {
 public:
  /// What runs it, for messages: "TorchScript module model.pt".
  virtual std::string compiled_as() const = 0;

 protected:
  CompiledModel() = default;
  CompiledModel(const CompiledModel&) = default;
  CompiledModel& operator=(const CompiledModel&) = default;
  virtual ~CompiledModel();
};

/// `model` as a CompiledModel, or null when its submodules run one at a time.
const CompiledModel* compiled_of(const Model& model);

/// `model` as a ModelWithFlops, or null when it does not count its FLOPs.
const ModelWithFlops* flops_of(const Model& model);
/// train_flops of `model` on a batch of `input_sizes`, or a negative number when it does not count.
double train_flops_of(const Model& model, c10::IntArrayRef input_sizes);

}  // namespace tk

#pragma GCC visibility pop
