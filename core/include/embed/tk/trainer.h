#pragma once
/// A training run in process: assembled from a recipe, planned, trained, written out.
#include <torch/optim/optimizer.h>

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "tk/components.h"
#include "tk/data.h"
#include "tk/output.h"
#include "tk/plugin.h"
#include "tk/recipe.h"
#include "tk/registry.h"

// What this header declares is libtrainkit's interface: exported (the library hides the rest).
#pragma GCC visibility push(default)

namespace tk {

/// One dispatch: which plugin handled which event, at which step.
struct TraceEntry {
  std::string plugin;
  Event event;
  int64_t step;
  int64_t micro_step;
};

/// How a run is driven, beyond the recipe.
struct TrainerOptions {
  bool write_outputs = true;                    ///< write the output folder (off for in-memory runs)
  ProgressMode progress = ProgressMode::Auto;
  std::optional<std::vector<std::filesystem::path>> plugin_dirs;  ///< replaces the default search path
  /// Called once when the run fails: in training the moment it fails, before plugins clean up;
  /// before training (the Trainer's construction, describe(), plan(), optimizer(),
  /// plugin_order(), fit()'s planning and resume, verify_accumulation()) as the error leaves the
  /// Trainer, with the run and its world still whole. A launcher uses it to tell the first failing
  /// rank from the ones that fail after losing it.
  std::function<void()> on_failure;
  /// Called after each optimizer step but the last: true stops the run there, with that step kept
  /// and checkpointed (SIGINT/SIGTERM); FitResult::stopped is then "signal". Also asked ten times a
  /// second while the run waits for the other ranks of its world to join: true there gives up the
  /// wait, and the run throws RunRefused (nothing trained, nothing written).
  std::function<bool()> stop_requested;
  /// Continue from a checkpoint: its folder, a checkpoints folder, "latest" (of the run's output),
  /// or "auto": the newest complete checkpoint of the run's output when there is one, else a fresh
  /// start (over a run of this same recipe that had written no checkpoint yet): one setting right
  /// for a job's first start and for each of its restarts.
  std::optional<std::string> resume;
  /// Start a new run in an output folder that holds another one, deleting that run's files
  /// (metrics, checkpoints, weights, trace); without it such a run is refused.
  bool overwrite = false;
  /// Recipe keys ("optimizer.lr", or a section such as "optimizer") that may differ from the
  /// checkpoint's when resuming; "all" allows any difference. Other differences are refused.
  std::vector<std::string> allow_changes;
  /// Whether the run joins the other ranks of its world (tk/world.h) when it first needs them;
  /// false for a dry run of one rank of a world, which plans alone.
  bool join_world = true;
};

/// What a finished run reports.
struct FitResult {
  int64_t steps = 0;
  int64_t micro_steps = 0;
  int64_t skipped_steps = 0;
  double seconds = 0.0;
  double peak_rss_mib = 0.0;          ///< peak resident memory of the process at the end
  std::vector<double> window_losses;  ///< the true loss of every optimizer step, in order
  /// The metrics plugins added to every step's record (ctx.metric), in order.
  std::vector<std::map<std::string, double>> step_metrics;
  std::vector<double> validation_losses;
  std::filesystem::path output_dir;   ///< empty when outputs were off
  std::filesystem::path checkpoint;   ///< the last checkpoint written, if any
  /// The files of the output folder the run wrote or rewrote, by name: the core's (recipe.toml,
  /// metrics.jsonl, weights.pt, ...) and then each plugin's (Plugin::write_files).
  std::vector<std::string> files;
  std::string stopped;                ///< "" when the run completed; "max_time" or "signal"
  bool already_complete = false;      ///< resumed from the final checkpoint: nothing was trained or changed
  FitStatus status = FitStatus::Running;  ///< Completed, StoppedByTime or StoppedBySignal
  /// Where a resumed run started (0 for a new one; its last step for one already complete):
  /// `steps`, `micro_steps` and `skipped_steps` count from the start of the run, `seconds`,
  /// `window_losses` and `step_metrics` this process's part of it.
  int64_t resumed_at_step = 0, resumed_at_micro_step = 0, resumed_skipped_steps = 0;
};

/// What Trainer::verify_accumulation found: the first window's gradient computed as its k
/// micro-batches and as one batch of all their examples, in float64, parameter by parameter.
struct AccumulationCheck {
  struct Parameter {
    std::string name;
    double relative_difference = 0.0;  ///< max |accumulated - one batch| / max |one batch|
  };
  int64_t micro_batch = 0, micro_batches = 0;  ///< m and k of the window compared
  double tolerance = 0.0;      ///< the run's dtype's: 1e-5 for float32, 1e-9 for float64
  double max_difference = 0.0; ///< the largest relative difference over all parameters
  std::vector<Parameter> parameters;  ///< every trainable parameter, in the model's order
  /// Modules that make accumulation inexact, each with the reason (BatchNorm in training mode,
  /// dropout), and for a difference no known module explains, the modules whose parameters differ.
  std::vector<std::string> findings;
  bool exact() const noexcept { return max_difference <= tolerance; }
};

/// What the plugins of `recipe` provide (tk/capabilities.h), learnt by loading its libraries and
/// giving its plugins their options, without building the run (no data, model or memory trial):
/// what a launcher needs to know. The recipe's sections and keys are checked on the way; errors
/// name the recipe position or plugin file at fault.
std::set<std::string> plugin_capabilities(const Recipe& recipe, const TrainerOptions& opts = {});

/// The recipe's [world] rendezvous_timeout_s, checked as a run checks it (errors name its line):
/// how long the launchers of a run's nodes wait for one another, as its ranks do.
double rendezvous_timeout_s(const Recipe& recipe);

/// This process's rank in the world a launcher placed it in (RANK under tk-run --nproc and
/// torchrun, SLURM_PROCID in an srun step), 0 outside one: where the run's ranks share a console
/// or an output folder, rank 0 alone prints the plan and writes the report.
int launch_rank();

class Trainer {
 public:
  /// Builds model, data, loss, schedule and plugins from `recipe` (the Trainer keeps its own
  /// copy); every error names the recipe position or plugin file at fault. The optimizer is made
  /// when the run is planned (describe(), plan(), optimizer() or fit()), after the plugins' setup.
  explicit Trainer(Recipe recipe, TrainerOptions opts = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  /// Adds a plugin made in code (not from a library) after the recipe's ones, before the run is
  /// planned: a prepared one (tk::prepare_plugin, or loaded from a library) as it is, else named
  /// `name` with its options from `options` (TOML text, checked as a recipe's entry would be).
  template <class T>
  void add_plugin(std::shared_ptr<T> plugin, const std::string& name = "", const std::string& options = "") {
    uint32_t hooks = kUnknownHooks;
    if constexpr (detail::is_plugin_type_v<T>) hooks = plugin ? detail::hooks_for<T>(*plugin) : kUnknownHooks;
    add_plugin(std::shared_ptr<Plugin>(std::move(plugin)), name, options, hooks);
  }
  /// The same, with the hooks its class overrides given (detail::hooks_for<YourPlugin>(plugin);
  /// used only when the plugin is not prepared yet).
  void add_plugin(std::shared_ptr<Plugin> plugin, const std::string& name, const std::string& options, uint32_t hooks);

  /// The resolved plan as text: what `tk-run --dry-run` prints. With `resume` set and
  /// `join_world` false (a dry run), also the checkpoint the resume would continue, compared with
  /// this run as fit() compares it (a refusal is thrown as fit() would throw it), its tensors unread.
  std::string describe();
  /// Compares, on the run's model and data, the first optimizer step's gradient accumulated over
  /// its micro-batches with the gradient of one batch of the same examples, in float64 on the
  /// model's parameters (restored afterwards, with buffers and random generators). Plans the run.
  AccumulationCheck verify_accumulation();
  /// Trains. Throws PluginRuntimeError / Error; the output folder keeps what was written.
  FitResult fit();

  /// The model (after planning: as the plugins' setup left it).
  Model& model();
  /// The optimizer over the model's trainable parameters (plans the run).
  torch::optim::Optimizer& optimizer();
  const RunPlan& plan();
  const DataSplits& data() const;
  /// The folder the run writes (run.output, else runs/<run.name>); empty when outputs are off.
  std::filesystem::path output_dir() const;
  /// The Trainer's own copy of the recipe.
  const Recipe& recipe() const;
  /// The recipe as this run resolved it: what its output folder's recipe.toml holds (every
  /// section it read, defaults filled in, overrides applied).
  std::string resolved_recipe() const;
  /// Every component and plugin the run's libraries registered.
  const Registry& registry() const;
  /// Plugin names in dispatch order.
  std::vector<std::string> plugin_order();
  /// Every dispatch so far (when `run.trace` is on, or always for in-memory runs).
  const std::vector<TraceEntry>& trace() const;
  /// Warnings the run issued (also logged).
  const std::vector<std::string>& warnings() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tk

#pragma GCC visibility pop
