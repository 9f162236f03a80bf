#pragma once
// The API layer: what lies behind the views plugins get (Plugin, Context, SetupContext,
// OutputFiles, RunPlan, OptionBinder), the core's bookkeeping in one place, and what only the
// loader may do to a registry. Not installed: a field added here changes nothing a plugin was
// compiled against.
#include <cstdint>
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
#include "tk/registry.h"
#include "tk/world.h"
#include "tk/run_plan.h"

namespace tk::detail {

/// Who the core is calling now, for log prefixes and for refusing calls made in the wrong hook.
struct Dispatch {
  std::string plugin;            ///< the plugin being called ("" between calls)
  const char* hook = nullptr;    ///< "on_boundary", "configure", "setup", "write_files", ... (null between calls)
  std::optional<Event> event;    ///< the event of an event hook
  std::function<void(int level, const std::string&)> log;  ///< the run's log (0 info, 1 warning)

  /// Enters plugin `p`'s hook `h` (for event `e`, if one); leave() ends it.
  void enter(const std::string& p, const char* h, std::optional<Event> e = std::nullopt);
  void leave() noexcept;
  /// Refuses `call` unless the current hook is `hook` (a non-event hook such as "configure").
  void require_hook(const char* call, const char* hook) const;
};

/// The values of the plan (RunPlan shows them to plugins).
struct PlanValues {
  int64_t micro_batch = 1;
  int64_t accumulation = 1;
  int64_t effective_batch_goal = 0;
  bool micro_batch_auto = false;
  double memory_budget = 0;
  std::vector<std::pair<int64_t, double>> measured_peaks;
  int64_t memory_level = -1;       ///< the lever's level the planner picked (-1: no lever)
  std::string memory_lever_what;   ///< what its level counts
  std::string memory_lever_owner;  ///< the plugin that offered it
  BatchRamp ramp;
  LastWindow last_window = LastWindow::Step;
  int world_size = 1;
  int rank = 0;
  Reduction reduction = Reduction::Mean;
  c10::DeviceType device = c10::kCPU;
  std::set<std::string> capabilities;
  std::string window_owner;
  std::vector<std::string> gradients_kept_by;  ///< the plugins that asked to keep the gradients' tensors
  std::optional<WindowRequest> requested;  ///< a plugin's set_window (deprecated: [batch] gives the shape)
  World* world = nullptr;  ///< the run's (set before the plugins configure)

  int64_t effective_batch() const noexcept { return micro_batch * accumulation * world_size; }
  bool has(const std::string& cap) const { return capabilities.count(cap) != 0; }
  bool has(const Capability& cap) const { return has(cap.name()); }
};

/// The plan and its view. Not copyable: the view points at it.
struct PlanState : PlanValues {
  PlanState();
  PlanState(const PlanState&) = delete;
  PlanState& operator=(const PlanState&) = delete;
  /// Back to the values of a plan no plugin has shaped.
  void reset() { static_cast<PlanValues&>(*this) = PlanValues{}; }

  const Dispatch* dispatch = nullptr;  ///< who is configuring (set_window needs it)
  RunPlan view;
};

/// What the core resets before each boundary: the step's metrics and votes.
struct StepVotes {
  struct Deferred {       // a device value read after the boundary: a metric, or a veto flag
    std::string name;     // the metric's; the veto's reason
    at::Tensor value;
    std::string plugin;
    bool veto = false, advance_schedule = false;
  };
  std::vector<std::pair<std::string, double>> metrics;
  std::vector<std::pair<std::string, std::string>> writers;  // each metric's plugin, this step
  std::map<std::string, std::string> owners;  // each metric's plugin, for the run: a column means one thing
  std::vector<Deferred> deferred;
  std::vector<std::string> flagged;  // plugins whose veto flag of this step was set
  std::string veto_reason, vetoed_by;
  bool veto_advances_schedule = false;

  void clear();
  /// Adds or replaces a metric.
  void set_metric(const std::string& name, double value);
  /// Notes that `plugin` writes metric `name` this step; refuses a name another plugin wrote, in
  /// this step (a record holds one value a key: one of them would be lost) or an earlier one (the
  /// records' column would hold two plugins' values under one name).
  void claim_metric(const std::string& name, const std::string& plugin);
  /// The plugin that wrote metric `name` this step, or "".
  std::string writer_of(const std::string& name) const;
  /// Forgets the step's metrics (validation's record holds its own).
  void clear_metrics() {
    metrics.clear();
    writers.clear();
  }
  /// A host veto; the first one wins.
  void veto(const std::string& reason, const std::string& plugin, bool advance_schedule);
};

/// Everything behind a Context.
struct LoopState {
  Dispatch d;
  World* world = nullptr;
  Model* model = nullptr;
  torch::optim::Optimizer* optimizer = nullptr;
  const PlanState* plan = nullptr;
  Counters counters;
  Window window;
  WindowTotals totals;
  const Batch* batch = nullptr;
  at::Tensor loss;
  at::Tensor loss_item;  // this micro-batch's loss, detached, on the device
  mutable double loss_value = 0.0;
  mutable bool loss_read = false;
  mutable int64_t host_reads = 0;
  double window_loss = 0.0, validation_loss = 0.0, lr = 0.0;
  std::filesystem::path output_dir;
  FitStatus status = FitStatus::Running;
  bool trial = false;  ///< a trial step (the memory planner's, the verifier's): nothing of it is kept
  /// What training's first forward computed in: autocast's dtype, or the parameters'.
  at::ScalarType compute_dtype = at::ScalarType::Undefined;
  StepVotes step;

  /// Counts one read from the device.
  std::vector<double> read(const at::Tensor& values) const;
  /// After the boundary event: reads the window's loss (totals.loss) and the deferred metrics and
  /// veto flags to the host, all in one read, and applies them.
  void read_step_values();
};

/// Everything behind a SetupContext.
struct SetupState {
  const Dispatch* d = nullptr;  // the run's
  World* world = nullptr;
  ModelPtr* model = nullptr;
  const PlanState* plan = nullptr;
  const DataInfo* data = nullptr;
  /// The optimizer wraps of the plugins set up so far, each with its plugin's name.
  std::vector<std::pair<std::string, OptimizerWrap>>* wraps = nullptr;
  /// The memory lever offered so far, with its plugin's name (empty name: none).
  std::pair<std::string, MemoryLever>* lever = nullptr;
};

/// Everything behind an OutputFiles: where the files go and what was written.
struct FilesState {
  const Dispatch* d = nullptr;  // the run's
  Model* model = nullptr;
  const PlanState* plan = nullptr;
  std::filesystem::path dir;
  /// Called with a file's name before it is written: the core records it as the plugin's.
  std::function<void(const std::string& plugin, const std::string& file)> record;
};

/// Everything behind a Plugin: what the core knows of an instance.
struct PluginState {
  std::string name;
  Options options;
  bool prepared = false;
  uint32_t hooks = 0;     // bit per Event: the class overrides that hook
  uint32_t declined = 0;  // bit per Event: declined at run time
  std::vector<std::pair<const void*, std::string>> bound;  // member -> option name
};

/// What an OptionBinder collects: each option's spec, the member it is bound to, and how the
/// member gets the recipe's value.
struct BinderState {
  OptionSpecs specs;
  std::vector<const void*> members;
  std::vector<std::function<void(const OptionValue&)>> assign;

  /// Adds one, refusing what no recipe could set: an empty or reserved name, a name or a member
  /// bound twice, an empty doc.
  OptionBinder& declare(OptionBinder& b, OptionSpec spec, const void* member,
                        std::function<void(const OptionValue&)> assign_to);
  static BinderState& of(OptionBinder& b) noexcept { return *b.state_; }
};

/// The core's way into the views: their state, and views made over a state.
struct ContextAccess {
  static LoopState& state(Context& c) noexcept { return *c.s_; }
  static const LoopState& state(const Context& c) noexcept { return *c.s_; }
  /// The context of one event (FitStartContext, ..., BoundaryContext, ...) over `s`.
  template <class EventContext>
  static EventContext view(LoopState& s) noexcept {
    return EventContext(&s);
  }
  static SetupContext setup(SetupState& s) noexcept { return SetupContext(&s); }
  static OutputFiles files(FilesState& s) noexcept { return OutputFiles(&s); }
};
struct PlanAccess {
  static RunPlan view(PlanState* s) noexcept { return RunPlan(s); }
  static PlanState& state(const RunPlan& p) noexcept { return *p.s_; }
};
struct PluginAccess {
  static PluginState& state(Plugin& p) noexcept { return *p.state_; }
  static const PluginState& state(const Plugin& p) noexcept { return *p.state_; }
};
struct RegistryAccess {
  /// Sets the origin recorded for what is registered next (the loader calls it around a library's
  /// registration function); `keep` keeps that library loaded.
  static void set_origin(Registry& r, std::string file, std::shared_ptr<const void> keep);
};
/// Calls the hook of `e` on `p` with its event's context over `state`.
void dispatch(Plugin& p, Event e, LoopState& state);
/// The option specs a plugin declares (Plugin::bind), into `binder` when given.
OptionSpecs declared_options(Plugin& p, OptionBinder* binder = nullptr);
/// Names an instance (a registry does, for the plugins it makes; their factory recorded the hooks).
void name_plugin(Plugin& p, const std::string& name);
/// Gives a named instance its options: `values` checks the recipe's (or a test's) values against
/// the declared specs; they go into the bound members, then init() runs.
void configure_options(Plugin& p, const std::function<Options(const OptionSpecs&)>& values);
/// The same with `toml` (a [[plugins]] entry's text, as a recipe's refused: "plugins.<its name>.KEY").
void configure_options(Plugin& p, const std::string& toml);

/// " (TK_MACHINE_MEMORY)" where that variable sets the machine's memory (machine_memory_bytes), for
/// the refusals that quote it; else "".
std::string machine_memory_note();
/// `text` with its control characters escaped as to_toml writes them in a string (options.cpp). A
/// run.json of earlier versions holds them raw (a newline in a data set's document separator):
/// compared escaped, it is the same run.
std::string escape_controls(const std::string& text);
/// require_memory's refusal: a RecipeError, told apart where the core adds what it knows of the run.
class MemoryRefusal : public RecipeError {
 public:
  MemoryRefusal(const SourceLoc& where, const std::string& what) : RecipeError(where, what), bare_(what) {}
  /// The message without its place.
  const std::string& bare() const noexcept { return bare_; }

 private:
  std::string bare_;
};

}  // namespace tk::detail

// ---- plan.cpp: where each micro-batch sits in its window, and the order plugins run in ----------

namespace tk {
/// Where each micro-batch sits in its optimizer-step window, for a window size (fixed, or ramping
/// with the effective batch) and a last-window policy.
class WindowSchedule {
 public:
  /// `batches_per_epoch` micro-batches per epoch; `epochs` = 0 when the run is bounded by steps.
  WindowSchedule(int64_t batches_per_epoch, int64_t k, LastWindow policy, int64_t epochs);

  /// Makes the window size follow `ramp` up to the run's `effective` batch: at each window's start,
  /// effective batch x / `unit` micro-batches (unit = micro-batch x world size, x rounded down to
  /// a whole unit, at least one). `samples_in(b0, b1)` counts the examples (all ranks) of
  /// micro-batches [b0, b1) of an epoch, for ramps over examples. Refuses a ramp of more than
  /// 10^7 optimizer steps.
  void set_ramp(const BatchRamp& ramp, int64_t effective, int64_t unit,
                std::function<int64_t(int64_t, int64_t)> samples_in);

  /// The window that starts at micro-batch `b` of `epoch`, as optimizer step `step` after
  /// `samples` examples (all ranks); nullopt when the policy drops the rest of the epoch.
  std::optional<Window> start(int64_t epoch, int64_t b, int64_t step, int64_t samples) const;
  /// The position of micro-batch `b` of `epoch` in a fixed-size schedule (no ramp), or nullopt when
  /// the policy drops it.
  std::optional<Window> at(int64_t epoch, int64_t b) const;
  /// Optimizer steps in `epochs` epochs (the whole run for a bounded carry schedule).
  int64_t steps_in(int64_t epochs) const;
  /// Micro-batches of the window that starts as optimizer step `step` after `samples` examples.
  int64_t size_at(int64_t step, int64_t samples) const;
  /// Whether the ramp (if any) is over within a run of `total_steps` optimizer steps: it lasts at
  /// most that many steps, or the run's steps take at least its examples.
  bool ramp_completes(int64_t total_steps) const;

 private:
  int64_t fixed_steps_from(int64_t epoch, int64_t b, int64_t epochs) const;

  int64_t m_, k_, epochs_;
  LastWindow policy_;
  BatchRamp ramp_;
  int64_t effective_ = 0, unit_ = 1;
  std::function<int64_t(int64_t, int64_t)> samples_in_;
};

/// A plugin as the orderer sees it.
struct PluginDecl {
  std::string name;
  Contract contract;
  SourceLoc where;  // its [[plugins]] entry in the recipe ("plugins.<name>" for one added in code; none: unnamed)
};

/// Dispatch order for plugins: the providers of what a plugin lists in `after` come first, recipe
/// order otherwise. Refuses two providers of one capability, an unmet requirement, a conflict or
/// a cycle, naming both plugins involved. A capability in `after` that no plugin provides and that
/// is not a known name (tk/capabilities.h) adds a warning to `warnings`: most likely a typo.
std::vector<size_t> order_plugins(const std::vector<PluginDecl>& plugins,
                                  std::vector<std::string>* warnings = nullptr);

}  // namespace tk
