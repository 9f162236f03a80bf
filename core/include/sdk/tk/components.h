#pragma once
/// The kinds of component a recipe selects by name (model, data, loss, optimizer, schedule) and
/// the interfaces of those that are not models or data sets.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "tk/batch.h"
#include "tk/data.h"
#include "tk/model.h"
#include "tk/options.h"
#include "tk/run_plan.h"

// What this header declares is libtrainkit's interface: exported (the library hides the rest).
#pragma GCC visibility push(default)

namespace torch::optim {
class Optimizer;
}

namespace tk {

/// The targets a loss takes; the core refuses a loss that does not fit the data set's targets.
enum class Targets { Any, Classes, Reals };

/// A loss: reduces over items with `reduction`; returns the loss tensor.
class LossFn {
 public:
  explicit LossFn(Reduction r, Targets t = Targets::Any) : reduction_(r), targets_(t) {}
  virtual ~LossFn() = default;
  virtual at::Tensor operator()(const at::Tensor& output, const Batch& batch) const = 0;
  Reduction reduction() const noexcept { return reduction_; }
  Targets targets() const noexcept { return targets_; }

 private:
  Reduction reduction_;
  Targets targets_;
};

/// Learning rate as a pure function of the optimizer step (so a resumed run gets the same LR).
class LrSchedule {
 public:
  virtual ~LrSchedule() = default;
  /// LR for optimizer step `step` (0-based) of `total` steps.
  virtual double lr(int64_t step, int64_t total) const = 0;
};

/// Makes a model for the data set's shape; the core moves it to the run's device and dtype.
using ModelMaker = std::function<ModelPtr(const Options&, const DataInfo&)>;
/// Makes the data set; `seed` is the run's seed (data sets that generate examples use it).
using DataMaker = std::function<DataSplits(const Options&, uint64_t seed)>;
using LossMaker = std::function<std::unique_ptr<LossFn>(const Options&)>;
/// Makes an optimizer over `params`: the model's trainable parameters, after every plugin's setup.
using OptimizerMaker =
    std::function<std::unique_ptr<torch::optim::Optimizer>(const Options&, std::vector<at::Tensor> params)>;
using ScheduleMaker = std::function<std::unique_ptr<LrSchedule>(const Options&, double base_lr)>;

/// The learning rate of the optimizer's first parameter group, and setting it on all groups.
double get_lr(const torch::optim::Optimizer& opt);
void set_lr(torch::optim::Optimizer& opt, double lr);

/// An optimizer that knows the size of the state it holds (one that wraps another, say) derives
/// from this too; optimizer_state_bytes asks it.
class StateSize {
 public:
  virtual ~StateSize() = default;
  /// Bytes of the tensors this optimizer keeps as state, on this rank.
  virtual int64_t state_bytes() const = 0;
};
/// Bytes of the tensors `opt` keeps as state on this rank (metrics.jsonl: optimizer_state_mib,
/// the memory planner): what it reports as a StateSize (trainkit's sgd, adam and adamw do), else
/// -1 (not known).
int64_t optimizer_state_bytes(const torch::optim::Optimizer& opt);

}  // namespace tk

#pragma GCC visibility pop
