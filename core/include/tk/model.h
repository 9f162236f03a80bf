#pragma once
/// Models, micro-batches and the run plan: the vocabulary shared by the loop and its plugins.
#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>

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

/// One micro-batch. `samples` is its number of examples; `tokens` its number of target items that
/// count toward the loss (non-ignored positions; equal to `samples` for per-example targets).
struct Batch {
  torch::Tensor input;
  torch::Tensor target;
  int64_t samples = 0;
  int64_t tokens = 0;
};

/// What to do with the short window at the end of an epoch.
enum class LastWindow { Step, Drop, Carry };
const char* to_string(LastWindow p) noexcept;

/// The shape of a run, settled before training: plugins adjust it in Plugin::configure.
struct RunPlan {
  int64_t micro_batch = 1;      ///< examples per micro-batch (per rank)
  int64_t accumulation = 1;     ///< micro-batches per optimizer step (window size k)
  LastWindow last_window = LastWindow::Step;
  int world_size = 1;           ///< processes that train together
  int rank = 0;
  std::string loss_reduction = "mean";  ///< "mean" or "sum", of the recipe's loss
  at::DeviceType device = at::kCPU;     ///< where the model and the batches live
  std::set<std::string> capabilities;   ///< everything the run's plugins provide (see tk/capabilities.h)
  std::string window_owner;     ///< plugin that set the window, for error messages
  std::string world_owner;      ///< plugin that set the world, for error messages

  /// Sets the accumulation window; a second plugin trying to set it is refused, naming both.
  void set_window(int64_t k, LastWindow policy, const std::string& by);
  /// Sets world size and rank; a second plugin trying to set it is refused, naming both.
  void set_world(int world, int rank_, const std::string& by);
  /// micro_batch x accumulation x world_size.
  int64_t effective_batch() const noexcept { return micro_batch * accumulation * world_size; }
  /// Whether some plugin of the run provides `cap`.
  bool has(const std::string& cap) const { return capabilities.count(cap) != 0; }
};

/// Named tensors: what plugins save and restore (scalars as 0-dim tensors).
using StateDict = std::map<std::string, torch::Tensor>;

}  // namespace tk
