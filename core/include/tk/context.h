#pragma once
/// What a plugin sees of the run while it trains (Context) and while it is set up (SetupContext).
#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <filesystem>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "tk/batch.h"
#include "tk/data.h"
#include "tk/model.h"
#include "tk/run_plan.h"

namespace tk {

/// How a run ended, as on_fit_end sees it (Running before that).
enum class FitStatus { Running, Completed, StoppedByTime, StoppedBySignal, Failed };
/// "running", "completed", "max_time", "signal", "failed".
const char* to_string(FitStatus s) noexcept;

/// Messages through the run's log, prefixed with the current plugin's name. Base of both contexts.
class PluginLog {
 public:
  void info(const std::string& msg) const;
  void warn(const std::string& msg) const;

 protected:
  PluginLog() = default;
  ~PluginLog() = default;
  std::string current_plugin_;                           ///< set by the core around each call
  std::function<void(int level, const std::string&)> log_;  ///< the run's log (0 info, 1 warning)
};

/// Everything a plugin may read or change during an event. The core owns the bookkeeping behind
/// it; a plugin holds a Context only for the duration of one hook.
class Context : public PluginLog {
 public:
  Model& model() const noexcept { return *model_; }
  torch::optim::Optimizer& optimizer() const noexcept { return *optimizer_; }
  const RunPlan& plan() const noexcept { return *plan_; }
  int rank() const noexcept { return plan_->rank; }
  int world_size() const noexcept { return plan_->world_size; }
  /// How the recipe's loss reduces over its items.
  Reduction reduction() const noexcept { return reduction_; }

  const Counters& counters() const noexcept { return counters_; }
  /// Where the current micro-batch sits in its window (micro_batch .. boundary events).
  const Window& window() const noexcept { return window_; }
  /// Totals of the current window up to the last backward. A sync plugin replaces them with
  /// sums over all ranks at the boundary, before normalization.
  WindowTotals& totals() noexcept { return totals_; }
  const WindowTotals& totals() const noexcept { return totals_; }
  /// The current micro-batch (micro_batch .. backward events), else null.
  const Batch* batch() const noexcept { return batch_; }
  /// The tensor backward runs on (loss event); a plugin may replace it (a loss scale, say).
  at::Tensor& loss() noexcept { return loss_; }
  /// This micro-batch's loss as computed, before any rescaling (loss and backward events). Read
  /// from the device when first asked for: a host synchronisation, counted in host_reads.
  double loss_value() const;
  /// The true loss of the window over all ranks (step_end event).
  double window_loss() const noexcept { return window_loss_; }
  /// The validation loss (validation_end event).
  double validation_loss() const noexcept { return validation_loss_; }
  /// Learning rate of the step being taken (boundary and step_end events).
  double lr() const noexcept { return lr_; }
  /// The run's output folder; empty when outputs are off and on every rank but 0. Plugins write
  /// their own files here (rank 0 only).
  const std::filesystem::path& output_dir() const noexcept { return output_dir_; }
  /// Running until on_fit_end; there, how the run ended.
  FitStatus status() const noexcept { return status_; }

  /// Adds a value to this step's record in metrics.jsonl (boundary and step_end events).
  void metric(const std::string& name, double value);
  /// The same for a value still on the device (a 1-element tensor), given in on_boundary: the core
  /// reads it with the step's other device values in its one read per step.
  void metric(const std::string& name, const at::Tensor& value);

  /// Votes against the optimizer step of this window; the core skips it and counts it. The LR
  /// schedule stays where it is unless `advance_schedule`. The first veto of a window wins.
  void veto_step(const std::string& reason, bool advance_schedule = false);
  /// Votes against the step if `flag` (a 1-element tensor on the device, given in on_boundary) is
  /// nonzero, decided when the core reads it after the boundary, without a read of its own. Host
  /// vetoes, and earlier flags, win.
  void veto_step_if(const at::Tensor& flag, const std::string& reason, bool advance_schedule = false);
  /// Whether the step is vetoed: in on_boundary, by a host veto of a plugin dispatched earlier (a
  /// veto_step_if is not known yet); in on_step_end, by any veto.
  bool step_vetoed() const noexcept { return !veto_reason_.empty(); }
  /// Whether this plugin's veto_step_if flag of this step was set (step_end event), whichever
  /// veto won.
  bool flag_was_set() const;

  /// Reads a tensor's values to the host (as float64, flattened), counted as one of the step's
  /// host_reads (metrics.jsonl): for what a plugin must know on the host now. Prefer the deferred
  /// metric() and veto_step_if().
  std::vector<double> read(const at::Tensor& values) const;
  /// Host reads of the current step so far: the core's one, loss_value() and read() calls.
  int64_t host_reads() const noexcept { return host_reads_; }

 protected:
  Context() = default;
  ~Context() = default;
  /// After the boundary event: reads the window's loss (totals().loss) and the deferred metrics
  /// and veto flags to the host, all in one read, and applies them.
  void read_step_values();

  Model* model_ = nullptr;
  torch::optim::Optimizer* optimizer_ = nullptr;
  const RunPlan* plan_ = nullptr;
  Reduction reduction_ = Reduction::Mean;
  Counters counters_;
  Window window_;
  WindowTotals totals_;
  const Batch* batch_ = nullptr;
  at::Tensor loss_;
  at::Tensor loss_item_;  // this micro-batch's loss, detached, on the device
  mutable double loss_value_ = 0.0;
  mutable bool loss_read_ = false;
  mutable int64_t host_reads_ = 0;
  double window_loss_ = 0.0, validation_loss_ = 0.0, lr_ = 0.0;
  std::filesystem::path output_dir_;
  FitStatus status_ = FitStatus::Running;
  std::vector<std::pair<std::string, double>> metrics_;
  struct Deferred {  // a device value read after the boundary: a metric, or a veto flag
    std::string name;  // the metric's; the veto's reason
    at::Tensor value;
    std::string plugin;
    bool veto = false, advance_schedule = false;
  };
  std::vector<Deferred> deferred_;
  std::vector<std::string> flagged_;  // plugins whose veto flag of this step was set
  std::string veto_reason_, vetoed_by_;
  bool veto_advances_schedule_ = false;
};

/// What a plugin sees in Plugin::setup: the model after it is built and moved to the run's device
/// and dtype, before the optimizer exists. A plugin may change it: freeze parameters
/// (requires_grad = false: the optimizer then never sees them), replace submodules, add
/// parameters, or wrap the whole model.
class SetupContext : public PluginLog {
 public:
  Model& model() const noexcept { return **model_; }
  /// The model as a shared pointer (to hold it inside a wrapper).
  ModelPtr model_ptr() const noexcept { return *model_; }
  /// Replaces the model (a wrapper that holds the old one, say).
  void set_model(ModelPtr m);
  const RunPlan& plan() const noexcept { return *plan_; }
  const DataInfo& data() const noexcept { return *data_; }

 protected:
  SetupContext() = default;
  ~SetupContext() = default;
  ModelPtr* model_ = nullptr;
  const RunPlan* plan_ = nullptr;
  const DataInfo* data_ = nullptr;
};

}  // namespace tk
