#pragma once
/// The plugin interface: what a strategy sees of the loop, and what it tells the loop about itself.
#include <torch/optim/optimizer.h>

#include <functional>
#include <string>
#include <vector>

#include "tk/capabilities.h"
#include "tk/events.h"
#include "tk/model.h"
#include "tk/options.h"

namespace tk {

/// Where the current micro-batch sits in its optimizer-step window; known before its forward pass.
struct Window {
  int64_t index = 0;       ///< 0-based position in the window
  int64_t size = 1;        ///< micro-batches in this window (short for a last window)
  int64_t configured = 1;  ///< the configured window size k
  bool is_last() const noexcept { return index + 1 == size; }
  bool is_first() const noexcept { return index == 0; }
  bool is_short() const noexcept { return size < configured; }
};

/// Step counters, updated by the core.
struct Counters {
  int64_t step = 0;           ///< optimizer steps taken (vetoed ones included)
  int64_t micro_step = 0;     ///< micro-batches processed in total
  int64_t epoch = 0;          ///< 0-based epoch of the current micro-batch
  int64_t batch_in_epoch = 0; ///< 0-based index of the micro-batch in its epoch
  int64_t samples_seen = 0;   ///< examples that went through forward and backward
  int64_t tokens_seen = 0;    ///< target items that counted toward the loss
  int64_t skipped_steps = 0;  ///< optimizer steps vetoed by a plugin
  int64_t schedule_step = 0;  ///< steps the LR schedule has advanced (a vetoed step may not advance it)
  int64_t total_steps = 0;    ///< optimizer steps the run will take (known before it starts)
};

/// Per-step metrics plugins add; written to metrics.jsonl with the step's record.
class MetricsSink {
 public:
  virtual ~MetricsSink() = default;
  virtual void put(const std::string& name, double value) = 0;
};

/// How the loss reduces over its items; plugins that normalize gradients check it.
enum class Reduction { Mean, Sum };
const char* to_string(Reduction r) noexcept;

/// Running totals of the current window, kept by the core (a sync plugin may replace them with
/// sums over all ranks before normalization).
struct WindowTotals {
  int64_t micro_batches = 0;  ///< micro-batches whose backward is done
  int64_t samples = 0;        ///< their examples
  int64_t tokens = 0;         ///< their counted target items
  double loss_sum = 0.0;      ///< sum of item-weighted losses, for the true window loss
};

/// Everything a plugin may read or change during an event.
struct Context {
  Context(Model& m, torch::optim::Optimizer& o, const RunPlan& p, MetricsSink& s, Reduction r)
      : model(m), optimizer(o), plan(p), metrics(s), reduction(r) {}

  Model& model;
  torch::optim::Optimizer& optimizer;
  const RunPlan& plan;
  MetricsSink& metrics;
  Reduction reduction = Reduction::Mean;  ///< of the recipe's loss

  Counters counters;
  Window window;
  WindowTotals totals;         ///< of the current window, up to the last backward
  Batch* batch = nullptr;      ///< the current micro-batch (micro_batch .. backward events)
  torch::Tensor loss;          ///< the tensor backward runs on; plugins may replace it in on_loss
  double loss_value = 0.0;     ///< this micro-batch's loss as computed, before any rescaling
  double window_loss = 0.0;    ///< the true loss of the window, over all ranks (step_end event)
  double validation_loss = 0.0;///< set for validation_end
  double lr = 0.0;             ///< learning rate of the step being taken

  /// Votes against the optimizer step of this window; the core skips it and counts it. The LR
  /// schedule stays where it is unless `advance_schedule`.
  void veto_step(const std::string& reason, bool advance_schedule = false);
  bool step_vetoed() const noexcept { return !veto_reason.empty(); }

  /// Messages through the run's log, prefixed with the current plugin's name.
  void info(const std::string& msg) const;
  void warn(const std::string& msg) const;

  // Set by the core; plugins read them through the functions above.
  std::string current_plugin;
  std::string veto_reason;
  std::string vetoed_by;
  bool veto_advances_schedule = false;
  std::function<void(int level, const std::string&)> log_sink;
};

/// Ordering and compatibility a plugin declares (names from tk/capabilities.h or its own).
struct Contract {
  std::vector<std::string> provides;  ///< at most one plugin of a run may provide each
  std::vector<std::string> after;     ///< providers of these (if present) run before this plugin
  std::vector<std::string> requires_; ///< refuse the run unless some plugin provides these
  std::vector<std::string> conflicts; ///< refuse the run if some plugin provides these
};

/// Base class of every strategy. The core creates it through the plugin's entry point, hands it
/// its validated options, lets it shape the run plan, then dispatches the events it subscribes to.
class Plugin {
 public:
  virtual ~Plugin() = default;

  /// Options a recipe may set for this plugin; unknown or mistyped ones are refused by the core.
  virtual OptionSpecs option_specs() const { return {}; }
  /// Receives the validated options (defaults filled in). Reject bad values with `opts.fail`.
  virtual void init(const Options& opts) {}
  /// Declares ordering needs and what this plugin provides.
  virtual Contract contract() const { return {}; }
  /// Adjusts the run plan (window, world) before training starts.
  virtual void configure(RunPlan& plan) {}
  /// The events this plugin handles.
  virtual EventSet events() const = 0;
  /// Handles one event. Throwing stops the run; the core reports plugin, event and step.
  virtual void on_event(Event e, Context& ctx) = 0;
  /// The plugin's state, for checkpoints.
  virtual StateDict state() const { return {}; }
  /// Restores what `state()` returned.
  virtual void load_state(const StateDict& s) {}

  /// The name under which the plugin was loaded.
  const std::string& name() const noexcept { return name_; }
  void set_name(std::string n) { name_ = std::move(n); }

 private:
  std::string name_;
};

}  // namespace tk
