#pragma once
// The API layer: what lies behind the views plugins get (Plugin, Context, SetupContext,
// OutputFiles, RunPlan, OptionBinder), the core's bookkeeping in one place, and what only the
// loader may do to a registry. Not installed: a field added here changes nothing a plugin was
// compiled against.
#include <filesystem>
#include <functional>
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
  std::vector<Deferred> deferred;
  std::vector<std::string> flagged;  // plugins whose veto flag of this step was set
  std::string veto_reason, vetoed_by;
  bool veto_advances_schedule = false;

  void clear();
  /// Adds or replaces a metric.
  void set_metric(const std::string& name, double value);
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

}  // namespace tk::detail
