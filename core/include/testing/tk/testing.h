#pragma once
/// trainkit::testing: what a plugin's tests need. One hook at a time (ManualContext), whole runs in
/// process (run), parameter comparison, capture and veto fixtures, and the plugin contract checks.
#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "tk/context.h"
#include "tk/plugin.h"
#include "tk/trainer.h"

// What this header declares is libtrainkit's interface: exported (the library hides the rest).
#pragma GCC visibility push(default)

namespace tk::testing {

/// The plan a ManualContext shows: what the core would have settled before training.
struct PlanSettings {
  int64_t micro_batch = 1;
  int64_t accumulation = 1;
  LastWindow last_window = LastWindow::Step;
  int world_size = 1;
  int rank = 0;
  Reduction reduction = Reduction::Mean;
  c10::DeviceType device = c10::kCPU;
  std::set<std::string> capabilities;  ///< what the run's plugins provide
};

/// A Context whose every field a test sets by hand; hand it to a plugin's hook (see call()).
class ManualContext final : public Context {
 public:
  ManualContext(Model& model, torch::optim::Optimizer& optimizer, const PlanSettings& plan = {});
  ~ManualContext();

  Counters& mutable_counters() noexcept;
  void set_window(const Window& w) noexcept;
  void set_batch(const Batch* b) noexcept;
  void set_loss_value(double v) noexcept;
  void set_window_loss(double v) noexcept;
  void set_validation_loss(double v) noexcept;
  void set_lr(double v) noexcept;
  void set_status(FitStatus s) noexcept;
  void set_output_dir(std::filesystem::path d);
  /// Where info() and warn() go (level 0 info, 1 warning); nowhere by default.
  void set_log(std::function<void(int, const std::string&)> log);

  /// The metrics plugins added since the last clear_step().
  const std::vector<std::pair<std::string, double>>& metrics() const noexcept;
  /// One metric's value, NaN when absent.
  double metric_value(const std::string& name) const;
  const std::string& veto_reason() const noexcept;
  const std::string& vetoed_by() const noexcept;
  /// Forgets the metrics and the veto: what the core does before each boundary (the same code).
  void clear_step();
  /// Calls the hook of `e` on `p` as the core does (with `p`'s name as the current plugin, the
  /// calls that belong to other events refused). After a boundary hook, what the plugin left on
  /// the device (metrics, veto flags) is read, as the core reads it after the boundary event.
  void call(Plugin& p, Event e);
};

/// A plan as the core makes it before the plugins configure it, for unit tests of a configure
/// hook: configure() calls it as the core does; plan() shows the result.
class ManualPlan {
 public:
  explicit ManualPlan(const PlanSettings& settings = {});
  ~ManualPlan();
  ManualPlan(const ManualPlan&) = delete;
  ManualPlan& operator=(const ManualPlan&) = delete;
  /// Calls `p.configure(plan)` as plugin `p.name()`; its errors propagate as they are.
  void configure(Plugin& p);
  const RunPlan& plan() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Makes `plugin` what the core makes of a [[plugins]] entry: named `name`, its options bound from
/// `options` (the entry's keys as TOML text), refused as a recipe's would be, and init() run.
template <class T>
std::shared_ptr<T> prepare(std::shared_ptr<T> plugin, const std::string& name, const std::string& options = "") {
  static_assert(detail::is_plugin_type_v<T>, "prepare: give a std::shared_ptr of the plugin's own class");
  prepare_plugin(*plugin, name, options, detail::hooks_for<T>(*plugin));
  return plugin;
}
/// The one strategy of library `file`, prepared with `options` as above.
std::shared_ptr<Plugin> load_plugin(const std::filesystem::path& file, const std::string& options = "");

/// A plugin instance a test adds to a run: a prepared or loaded one as it is, or a new one with
/// the name and options (TOML) it gets here.
struct InProcess {
  template <class T>
  InProcess(std::shared_ptr<T> p, std::string name_ = "", std::string options_ = "")
      : name(std::move(name_)), options(std::move(options_)), hooks(kUnknownHooks) {
    if constexpr (detail::is_plugin_type_v<T>)
      if (p) hooks = detail::hooks_for<T>(*p);
    plugin = std::move(p);
  }
  std::shared_ptr<Plugin> plugin;
  std::string name, options;
  uint32_t hooks;
};

/// A small, fast recipe: an MLP on 256 synthetic examples, float64, 6 steps of SGD with momentum
/// in micro-batches of 8. Tests adjust it with overrides.
extern const char* const kTinyRecipe;

/// Named parameters (detached copies) of a model.
using Parameters = std::map<std::string, at::Tensor>;

/// What run() adds to a recipe.
struct RunOptions {
  std::vector<std::string> overrides;  ///< "key=value", as tk-run's --set
  /// Plugin libraries added as [[plugins]] entries: file, and its options as TOML text.
  std::vector<std::pair<std::filesystem::path, std::string>> libraries;
  std::vector<InProcess> plugins;  ///< instances added after the recipe's plugins
  std::vector<std::filesystem::path> plugin_dirs;  ///< searched before trainkit's own plugins folder
  std::filesystem::path output;  ///< write outputs here (empty: outputs off)
  std::optional<std::string> resume;  ///< as tk-run --resume (needs `output`)
  bool overwrite = false;  ///< as tk-run --overwrite: start over in a folder that holds another run
  std::vector<std::string> allow_changes;  ///< as tk-run --allow-change, with `resume`
  /// A stop as SIGINT/SIGTERM makes one: called after each optimizer step but the last. True keeps
  /// the step just taken (recorded, counted, checkpointed when outputs are on) and trains nothing
  /// more: `fit.status` StoppedBySignal, `fit.stopped` "signal", `fit.steps` the steps taken,
  /// `fit.checkpoint` the checkpoint; no validation at the stop and no plugin files (those are a
  /// completed run's). `[&n] { return ++n == 3; }` stops after step 3.
  std::function<bool()> stop_requested;
};

/// What run() hands back.
struct RunResult {
  FitResult fit;
  Parameters parameters;            ///< after training
  std::vector<TraceEntry> trace;    ///< every dispatch (run.trace is on)
  std::vector<std::string> warnings;
  std::vector<std::string> plugin_order;
};

/// Trains `recipe_toml` in process (outputs off unless asked) and returns what happened.
RunResult run(const std::string& recipe_toml, const RunOptions& opts = {});

/// max |a - b| over the parameters of both (infinity when their names or shapes differ).
double max_difference(const Parameters& a, const Parameters& b);
/// Bit-identical parameters.
inline bool identical(const Parameters& a, const Parameters& b) { return max_difference(a, b) == 0.0; }

/// Records, at each boundary after all gradient work, the gradients (flat, float64), the step's
/// lr and window size; at each step end the window loss; at each micro-batch its window position.
/// Trial steps (Context::trial()) are left out. Give it a name when adding it to a run ({capture,
/// "capture"}).
class Capture : public Plugin {
 public:
  Contract contract() const override;
  void on_micro_batch(MicroBatchContext& ctx) override;
  void on_boundary(BoundaryContext& ctx) override;
  void on_step_end(StepEndContext& ctx) override;
  std::vector<at::Tensor> grads;
  std::vector<double> lrs, window_losses;
  std::vector<int64_t> window_sizes;
  std::vector<Window> windows;
};

/// Vetoes the optimizer steps with the given 0-based indices (after every gradient plugin); trial
/// steps it leaves alone.
class VetoAt : public Plugin {
 public:
  explicit VetoAt(std::set<int64_t> steps);
  Contract contract() const override;
  void on_boundary(BoundaryContext& ctx) override;

 private:
  std::set<int64_t> steps_;
};

/// Throws from on_backward at the given 0-based step (not in a trial): a run that fails mid-window.
class ThrowAt : public Plugin {
 public:
  explicit ThrowAt(int64_t step);
  void on_backward(BackwardContext& ctx) override;

 private:
  int64_t step_;
};

/// What the contract checks are run with.
struct ContractOptions {
  std::string options;         ///< the plugin's options for the behavioural checks (TOML)
  std::string neutral;         ///< options with which it must leave a run bit-identical (TOML)
  bool check_neutral = true;   ///< false for plugins that always change the numerics
};

/// One check of the contract.
struct CheckResult {
  std::string name;
  bool passed = false;
  bool skipped = false;  ///< not run (its detail says why); neither passed nor failed
  std::string detail;    ///< why it failed, or why it was skipped
};

/// Runs the plugin contract against the (single-strategy) library `file`: it loads and names
/// itself; its options are well-formed, documented and validated; every hook it keeps runs on a
/// tiny run with validation; its state round-trips; neutral options leave a run bit-identical; a
/// stopped and resumed run equals an uninterrupted one; it survives a vetoed step; after another
/// plugin fails mid-window it gets on_fit_end and the first error stands. Run as one rank of a
/// world (RANK and WORLD_SIZE set, as tk-plugin check --nproc and torchrun do) it checks a plugin
/// that sums the gradients across the world, on every rank, with every run joining the world; the
/// neutral check gives way to one that every rank holds the same parameters after each step.
std::vector<CheckResult> check_contract(const std::filesystem::path& file, const ContractOptions& opts = {});

}  // namespace tk::testing

#pragma GCC visibility pop
