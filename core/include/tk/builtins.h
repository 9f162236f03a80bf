#pragma once
/// Built-in models, data sets, losses, optimizers and LR schedules, each selected by name in a
/// recipe and configured through declared options.
#include <torch/optim/optimizer.h>

#include <functional>
#include <optional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tk/model.h"
#include "tk/options.h"
#include "tk/plugin.h"

namespace tk {

/// What a data set tells the model and loss it feeds.
struct DataInfo {
  int64_t input_dim = 0;   ///< features per example (or per position, for sequences)
  int64_t output_dim = 0;  ///< classes, or regression targets
  bool classification = true;
  std::optional<int64_t> ignore_index;  ///< target value of items that do not count, if any
  std::vector<int64_t> input_shape;     ///< shape of one example's input (images: {C, H, W}; text: {T})
  int64_t vocab = 0;        ///< > 0 when inputs are token ids in [0, vocab)
  bool next_token = false;  ///< targets are the inputs shifted by one (language modelling): perplexity applies
  std::string baseline_name;  ///< a reference the validation loss is shown against ("unigram"), if any
  double baseline_loss = 0.0; ///< that reference's validation loss

  /// "image [1, 28, 28]", "tokens [128] of 256", "features [32]": for error messages.
  std::string describe() const;
};

/// An in-memory data set indexed by example.
class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  /// The examples at `indices` (a 1-D int64 tensor) as one batch.
  virtual Batch get(const torch::Tensor& indices) const = 0;
};
using DatasetPtr = std::shared_ptr<Dataset>;

/// A data set made of whole tensors: inputs [N, ...], targets [N, ...]; `ignore_index` marks
/// target items that do not count (for token targets).
class TensorDataset : public Dataset {
 public:
  TensorDataset(torch::Tensor inputs, torch::Tensor targets, int64_t ignore_index = -100);
  int64_t size() const override { return inputs_.size(0); }
  Batch get(const torch::Tensor& indices) const override;
  const torch::Tensor& inputs() const noexcept { return inputs_; }
  const torch::Tensor& targets() const noexcept { return targets_; }

 private:
  torch::Tensor inputs_, targets_;
  int64_t ignore_index_;
};

struct DataSplits {
  DatasetPtr train;
  DatasetPtr validation;  ///< may be null
  DataInfo info;
};

/// The order examples are visited in an epoch: a pure function of (seed, epoch).
torch::Tensor epoch_order(int64_t n, uint64_t seed, int64_t epoch, bool shuffle);

/// A loss: reduces over items with `reduction`; returns the loss tensor.
class LossFn {
 public:
  explicit LossFn(Reduction r) : reduction_(r) {}
  virtual ~LossFn() = default;
  virtual torch::Tensor operator()(const torch::Tensor& output, const Batch& batch) const = 0;
  Reduction reduction() const noexcept { return reduction_; }

 private:
  Reduction reduction_;
};

/// Learning rate as a pure function of the optimizer step (so a resumed run gets the same LR).
class LrSchedule {
 public:
  virtual ~LrSchedule() = default;
  /// LR for optimizer step `step` (0-based) of `total` steps.
  virtual double lr(int64_t step, int64_t total) const = 0;
};

/// A named, documented constructor of one kind of component.
template <class Fn>
struct Component {
  std::string name;
  std::string doc;
  OptionSpecs specs;
  Fn make;
};

using ModelMaker = std::function<ModelPtr(const Options&, const DataInfo&)>;
using DataMaker = std::function<DataSplits(const Options&, uint64_t seed)>;
using LossMaker = std::function<std::unique_ptr<LossFn>(const Options&)>;
using OptimizerMaker = std::function<std::unique_ptr<torch::optim::Optimizer>(
    const Options&, std::vector<torch::Tensor> params)>;
using ScheduleMaker = std::function<std::unique_ptr<LrSchedule>(const Options&, double base_lr)>;

const std::vector<Component<ModelMaker>>& models();
const std::vector<Component<DataMaker>>& datasets();
const std::vector<Component<LossMaker>>& losses();
const std::vector<Component<OptimizerMaker>>& optimizers();
const std::vector<Component<ScheduleMaker>>& schedules();

/// The component called `name`, or nullptr.
template <class Fn>
const Component<Fn>* find_component(const std::vector<Component<Fn>>& list, const std::string& name) {
  for (const auto& c : list)
    if (c.name == name) return &c;
  return nullptr;
}
template <class Fn>
std::vector<std::string> component_names(const std::vector<Component<Fn>>& list) {
  std::vector<std::string> out;
  for (const auto& c : list) out.push_back(c.name);
  return out;
}

/// The learning rate of the optimizer's first parameter group, and setting it on all groups.
double get_lr(const torch::optim::Optimizer& opt);
void set_lr(torch::optim::Optimizer& opt, double lr);

}  // namespace tk
