#pragma once
/// What a plugin sees of the run: while it trains (Context), while it is set up (SetupContext) and
/// while it writes its files (OutputFiles). Each is a view of state the core owns: adding to that
/// state changes nothing a plugin was compiled against.
#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tk/batch.h"
#include "tk/data.h"
#include "tk/events.h"
#include "tk/model.h"
#include "tk/run_plan.h"
#include "tk/world.h"

// What this header declares is libtrainkit's interface: exported (the library hides the rest).
#pragma GCC visibility push(default)

namespace tk {

/// How a run ended, as on_fit_end sees it (Running before that). Trial: the end of trial steps
/// (Context::trial()), which leave nothing behind.
enum class FitStatus { Running, Completed, StoppedByTime, StoppedBySignal, Failed, Trial };
/// "running", "completed", "max_time", "signal", "failed", "trial".
const char* to_string(FitStatus s) noexcept;

/// Named tensors, as save_tensors writes them (tk/tensor_io.h uses the same type).
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

#pragma GCC visibility push(hidden)  // the core's own: not exported
namespace detail {
struct Dispatch;
struct LoopState;
struct SetupState;
struct FilesState;
struct ContextAccess;
}  // namespace detail
#pragma GCC visibility pop

/// Messages through the run's log, prefixed with the current plugin's name. Base of the contexts.
class PluginLog {
 public:
  void info(const std::string& msg) const;
  void warn(const std::string& msg) const;

 protected:
  explicit PluginLog(const detail::Dispatch* d) noexcept : dispatch_(d) {}
  ~PluginLog() = default;
  const detail::Dispatch* dispatch_;
};

/// What a plugin sees during an event; a plugin holds it only for the duration of one hook. Each
/// hook gets the context of its event (on_boundary a BoundaryContext, on_loss a LossContext, ...):
/// what every event offers is here, and each event's context adds the calls that belong to it, so
/// that a call made in a hook it does not belong to does not compile (ctx.set_loss() in
/// on_boundary: "is protected"). The optimizer is read-only outside on_boundary.
class Context : public PluginLog {
 public:
  Model& model() const;
  /// The run's optimizer, to read (the boundary's context may change it: BoundaryContext).
  const torch::optim::Optimizer& optimizer() const;
  const RunPlan& plan() const noexcept;
  int rank() const noexcept;
  int world_size() const noexcept;
  /// The run's world: its ranks and their collectives (tk/world.h).
  World& world() const noexcept;
  /// How the recipe's loss reduces over its items (the plan's).
  Reduction reduction() const noexcept;
  /// The event being dispatched.
  Event event() const noexcept;
  const Counters& counters() const noexcept;
  /// The run's output folder; empty when outputs are off and on every rank but 0. A plugin writes
  /// its files through Plugin::write_files, which the core keeps track of.
  const std::filesystem::path& output_dir() const noexcept;
  /// Whether these are trial steps, not training: the memory planner's (micro_batch = "auto")
  /// and the accumulation verifier's run the plugins' whole cycle, on_fit_start to on_fit_end
  /// (status Trial), before training, and put back afterwards the parameters, buffers, random
  /// generators, optimizer and every plugin's state() (through load_state). A plugin that records
  /// what happens (a profiler, a log) leaves trials out.
  bool trial() const noexcept;
  /// Reads a tensor's values to the host (as float64, flattened), counted as one of the step's
  /// host_reads (metrics.jsonl): for what a plugin must know on the host now. Prefer the deferred
  /// metric() and veto_step_if() of the boundary.
  std::vector<double> read(const at::Tensor& values) const;
  /// Host reads of the current step so far: the core's one, loss_value() and read() calls.
  int64_t host_reads() const noexcept;

  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

 protected:
  explicit Context(detail::LoopState* state) noexcept;
  ~Context() = default;

  // The calls of particular events: each event's context below makes public those of its own.

  /// Where the current micro-batch sits in its window.
  const Window& window() const noexcept;
  /// Totals of the current window up to the last backward.
  const WindowTotals& totals() const noexcept;
  /// The same, to replace with sums over all ranks before normalization (a sync plugin's).
  WindowTotals& mutable_totals();
  /// The current micro-batch.
  const Batch* batch() const noexcept;
  /// The tensor backward runs on.
  const at::Tensor& loss() const;
  /// Replaces the tensor backward runs on: a loss scale, say.
  void set_loss(at::Tensor loss);
  /// This micro-batch's loss as computed, before any rescaling. Read from the device when first
  /// asked for: a host synchronisation, counted in host_reads.
  double loss_value() const;
  /// The true loss of the window over all ranks.
  double window_loss() const noexcept;
  /// The validation loss.
  double validation_loss() const noexcept;
  /// Learning rate of the step being taken.
  double lr() const noexcept;
  /// How the run ended.
  FitStatus status() const noexcept;
  /// The optimizer, to change.
  torch::optim::Optimizer& mutable_optimizer() const;
  /// The gradients: the defined grad() of every model parameter, in the model's order (a parameter
  /// without a gradient in this window is left out); at the boundary, what the optimizer step will
  /// apply. They are the tensors themselves: change them in place (scale, clip, unscale).
  std::vector<at::Tensor> gradients() const;
  /// Adds a value to this step's record in metrics.jsonl; the core's own keys (step, loss, lr,
  /// ...) are refused.
  void metric(const std::string& name, double value);
  /// The same for a value still on the device (a 1-element tensor): the core reads it with the
  /// step's other device values in its one read per step.
  void metric(const std::string& name, const at::Tensor& value);
  /// Votes against the optimizer step of this window; the core skips it and counts it. The LR
  /// schedule stays where it is unless `advance_schedule`. The first veto wins.
  void veto_step(const std::string& reason, bool advance_schedule = false);
  /// Votes against the step if `flag` (a 1-element tensor on the device) is nonzero, decided when
  /// the core reads it after the boundary, without a read of its own. Host vetoes, and earlier
  /// flags, win.
  void veto_step_if(const at::Tensor& flag, const std::string& reason, bool advance_schedule = false);
  /// Whether the step is vetoed: in on_boundary, by a host veto of a plugin dispatched earlier (a
  /// veto_step_if is not known yet); in on_step_end, by any veto.
  bool step_vetoed() const;
  /// Whether this plugin's veto_step_if flag of this step was set, whichever veto won.
  bool flag_was_set() const;

 private:
  friend struct detail::ContextAccess;
  detail::LoopState* s_;
};

/// on_fit_start: once, before the first epoch (after load_state when resuming).
class FitStartContext final : public Context {
  friend struct detail::ContextAccess;
  explicit FitStartContext(detail::LoopState* s) noexcept : Context(s) {}
};

/// on_epoch_start: before an epoch's first micro-batch.
class EpochStartContext final : public Context {
  friend struct detail::ContextAccess;
  explicit EpochStartContext(detail::LoopState* s) noexcept : Context(s) {}
};

/// on_micro_batch: a micro-batch was fetched; before its forward pass.
class MicroBatchContext final : public Context {
 public:
  using Context::batch;
  using Context::totals;
  using Context::window;

 private:
  friend struct detail::ContextAccess;
  explicit MicroBatchContext(detail::LoopState* s) noexcept : Context(s) {}
};

/// on_loss: the loss tensor is ready; set_loss() may replace it (rescaled) before backward.
class LossContext final : public Context {
 public:
  using Context::batch;
  using Context::loss;
  using Context::loss_value;
  using Context::set_loss;
  using Context::totals;
  using Context::window;

 private:
  friend struct detail::ContextAccess;
  explicit LossContext(detail::LoopState* s) noexcept : Context(s) {}
};

/// on_backward: this micro-batch's gradients were added in.
class BackwardContext final : public Context {
 public:
  using Context::batch;
  using Context::gradients;
  using Context::loss_value;
  using Context::totals;
  using Context::window;

 private:
  friend struct detail::ContextAccess;
  explicit BackwardContext(detail::LoopState* s) noexcept : Context(s) {}
};

/// on_boundary: the window is complete, before the optimizer step: sync, normalize, unscale, clip,
/// veto. The one event whose context changes the optimizer and the gradients.
class BoundaryContext final : public Context {
 public:
  /// The run's optimizer, to change.
  torch::optim::Optimizer& optimizer() const { return mutable_optimizer(); }
  using Context::gradients;
  using Context::lr;
  using Context::metric;
  using Context::mutable_totals;
  using Context::step_vetoed;
  using Context::totals;
  using Context::veto_step;
  using Context::veto_step_if;
  using Context::window;

 private:
  friend struct detail::ContextAccess;
  explicit BoundaryContext(detail::LoopState* s) noexcept : Context(s) {}
};

/// on_step_end: after the optimizer step (or its veto), the schedule step and zero_grad.
class StepEndContext final : public Context {
 public:
  using Context::flag_was_set;
  using Context::lr;
  using Context::step_vetoed;
  using Context::totals;
  using Context::window;
  using Context::window_loss;
  /// Adds a value to this step's record in metrics.jsonl; the core's own keys are refused.
  void metric(const std::string& name, double value) { Context::metric(name, value); }

 private:
  friend struct detail::ContextAccess;
  explicit StepEndContext(detail::LoopState* s) noexcept : Context(s) {}
};

/// on_epoch_end: after an epoch's last micro-batch.
class EpochEndContext final : public Context {
  friend struct detail::ContextAccess;
  explicit EpochEndContext(detail::LoopState* s) noexcept : Context(s) {}
};

/// on_validation_start: before a validation pass (model in eval mode, no grad).
class ValidationStartContext final : public Context {
  friend struct detail::ContextAccess;
  explicit ValidationStartContext(detail::LoopState* s) noexcept : Context(s) {}
};

/// on_validation_end: after a validation pass; validation_loss() is set.
class ValidationEndContext final : public Context {
 public:
  using Context::validation_loss;
  /// Adds a value to this validation's record in metrics.jsonl; the core's own keys are refused.
  void metric(const std::string& name, double value) { Context::metric(name, value); }

 private:
  friend struct detail::ContextAccess;
  explicit ValidationEndContext(detail::LoopState* s) noexcept : Context(s) {}
};

/// on_fit_end: once at the end, however the run ended: status() says how.
class FitEndContext final : public Context {
 public:
  using Context::status;

 private:
  friend struct detail::ContextAccess;
  explicit FitEndContext(detail::LoopState* s) noexcept : Context(s) {}
};

/// Makes an optimizer over `params`, a subset of the model's trainable parameters (in model order):
/// the recipe's, or what the wraps of plugins set up before the caller's give.
using OptimizerFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor> params)>;
/// Makes the run's optimizer from the trainable parameters and `inner`, the factory of the
/// optimizer it builds on (see SetupContext::wrap_optimizer).
using OptimizerWrap = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor> trainable,
                                                                             const OptimizerFactory& inner)>;

/// A trade of time for memory that a plugin offers the memory planner
/// (SetupContext::offer_memory_lever): levels 0 (off) to `levels`, each keeping less memory in a
/// step than the one below it, at more time.
struct MemoryLever {
  std::string what;                         ///< what a level counts, for the log and the plan ("recomputed blocks")
  int64_t levels = 0;                       ///< the highest level (>= 1)
  std::function<void(int64_t level)> set;  ///< puts a level in place (the planner's trials call it too)
};

/// What a plugin sees in Plugin::setup: the model after it is built and moved to the run's device
/// and dtype, before the optimizer exists. A plugin may change it: freeze parameters
/// (requires_grad = false: the optimizer then never sees them), replace submodules, add
/// parameters, or wrap the whole model.
class SetupContext : public PluginLog {
 public:
  Model& model() const;
  /// The model as a shared pointer (to hold it inside a wrapper).
  ModelPtr model_ptr() const;
  /// Replaces the model (a wrapper that holds the old one, say).
  void set_model(ModelPtr m);
  const RunPlan& plan() const noexcept;
  /// The run's world: its ranks and their collectives (tk/world.h).
  World& world() const noexcept;
  const DataInfo& data() const noexcept;
  /// Has the core make the run's optimizer through `wrap`: it gets the trainable parameters and a
  /// factory of the recipe's optimizer, and may build that over the parameters it chooses (a
  /// shard, groups of its own) and return it, or an optimizer that holds it. Wraps compose in
  /// dispatch order: a later plugin's `inner` goes through the earlier plugins' wraps. The core
  /// calls the wraps whenever it makes the optimizer (again after a memory trial), and refuses an
  /// optimizer whose param_groups do not list every trainable parameter exactly once (it sets the
  /// learning rate and zeroes gradients through them). The core calls a wrapped optimizer's save()
  /// on every rank at each checkpoint (rank 0's archive is the one written), so one that holds a
  /// part of the state may gather the rest there; and its load() on every rank on a resume.
  void wrap_optimizer(OptimizerWrap wrap);
  /// Leaves the level of `lever` to the memory planner ([batch] micro_batch = "auto" only): it picks
  /// the largest micro-batch that fits the memory budget at some level, then the lowest level at
  /// which that micro-batch fits, and leaves that level set. RunPlan::memory_level() says which.
  /// One plugin of a run may offer a lever.
  void offer_memory_lever(MemoryLever lever);

  SetupContext(const SetupContext&) = delete;
  SetupContext& operator=(const SetupContext&) = delete;
  ~SetupContext() = default;

 private:
  friend struct detail::ContextAccess;
  explicit SetupContext(detail::SetupState* state) noexcept;
  detail::SetupState* s_;
};

/// What a plugin sees in Plugin::write_files: the trained model and a way to write files into the
/// run's output folder that the core records as the plugin's. Those files are listed when the run
/// ends, deleted with the run by `tk-run --overwrite`, and written again when a resume of the
/// finished run finds one missing.
class OutputFiles : public PluginLog {
 public:
  Model& model() const;
  const RunPlan& plan() const noexcept;
  /// The output folder the files go to.
  const std::filesystem::path& dir() const noexcept;
  /// Writes `tensors` to `<dir>/<file>` as a dict that Python reads with torch.load (as
  /// weights.pt), atomically. `file` is a plain file name of the plugin's own, not one of the
  /// core's (recipe.toml, metrics.jsonl, weights.pt, ...).
  void save_tensors(const std::string& file, const NamedTensors& tensors);
  /// Writes `text` to `<dir>/<file>`, atomically; the same rules for `file`.
  void write_text(const std::string& file, const std::string& text);
  /// Why `file` cannot be a plugin's file (a folder in it, hidden, one of the core's names, a
  /// .tmp), or "" when it can. save_tensors and write_text refuse such a name when they are
  /// called, at the end of the run; a plugin whose file names come from its options checks them
  /// in init(), so that the recipe is refused at its line before any training (and by
  /// `tk-run --dry-run`):
  /// `if (auto why = tk::OutputFiles::name_error(file_); !why.empty()) fail_option(file_, why);`
  /// (Another plugin's file is refused when written: it depends on the run's folder.)
  static std::string name_error(const std::string& file);

  OutputFiles(const OutputFiles&) = delete;
  OutputFiles& operator=(const OutputFiles&) = delete;
  ~OutputFiles() = default;

 private:
  friend struct detail::ContextAccess;
  explicit OutputFiles(detail::FilesState* state) noexcept;
  detail::FilesState* s_;
};

}  // namespace tk

#pragma GCC visibility pop
