#pragma once
/// The plugin interface (API 7): options bound to members, a declared contract, the plan, setup,
/// one hook per event, files, state.
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <vector>

#include "tk/capabilities.h"
#include "tk/context.h"
#include "tk/events.h"
#include "tk/options.h"

// What this header declares is libtrainkit's interface: exported (the library hides the rest).
#pragma GCC visibility push(default)

namespace tk {

/// Ordering and compatibility a plugin declares (names from tk/capabilities.h or its own).
struct Contract {
  std::vector<Capability> provides;   ///< at most one plugin of a run may provide each
  std::vector<Capability> after;      ///< providers of these (if present) run before this plugin (after
                                      ///< it in the events that close a region: tk::closes)
  std::vector<Capability> requires_;  ///< refuse the run unless some plugin provides these
  std::vector<Capability> conflicts;  ///< refuse the run if some plugin provides these
};

#pragma GCC visibility push(hidden)  // the core's own: not exported
namespace detail {
struct PluginState;
struct PluginAccess;
}  // namespace detail
#pragma GCC visibility pop

/// The event hooks, in Event order: X(hook, enumerator of tk::Event, the hook's context type).
#define TK_EVENT_HOOKS(X)                                         \
  X(on_fit_start, FitStart, FitStartContext)                      \
  X(on_epoch_start, EpochStart, EpochStartContext)                \
  X(on_micro_batch, MicroBatch, MicroBatchContext)                \
  X(on_loss, Loss, LossContext)                                   \
  X(on_backward, Backward, BackwardContext)                       \
  X(on_boundary, Boundary, BoundaryContext)                       \
  X(on_step_end, StepEnd, StepEndContext)                         \
  X(on_epoch_end, EpochEnd, EpochEndContext)                      \
  X(on_validation_start, ValidationStart, ValidationStartContext) \
  X(on_validation_end, ValidationEnd, ValidationEndContext)       \
  X(on_fit_end, FitEnd, FitEndContext)

/// Base class of every strategy. The core makes it (through its library's registry, or as given
/// in code), binds its options (bind, then init), lets it shape the run plan (configure) and the
/// model (setup), then calls the hooks of the events it overrides, in the order the contracts
/// give, and at the end of a completed run lets it write its files (write_files).
///
/// Override only the hooks you need, as public members: the core calls a plugin for an event only
/// when its class overrides that event's hook (it reads this from the class when the plugin is
/// made or added). The base hooks do nothing; calling one from an override is harmless. A hook that throws
/// stops the run; the core reports plugin, event and step.
class Plugin {
 public:
  Plugin();
  virtual ~Plugin();
  Plugin(const Plugin&) = delete;
  Plugin& operator=(const Plugin&) = delete;

  /// Declares the options a recipe may set, each bound to the member that holds it (see
  /// OptionBinder); the member's value at that moment is the default.
  virtual void bind(OptionBinder& options) {}
  /// The recipe's values are in the bound members (defaults where the recipe is silent): check
  /// them here, and refuse a bad one with fail_option().
  virtual void init() {}
  /// Declares ordering needs and what this plugin provides.
  virtual Contract contract() const { return {}; }
  /// Shapes the run plan before training: the window (RunPlan::set_window); may refuse the plan
  /// with fail_option(). The world (plan.world()) is there: its collectives may be called, by
  /// every rank alike.
  virtual void configure(RunPlan& plan) {}
  /// Once, after the model is built and before the optimizer exists; may change the model.
  virtual void setup(SetupContext& setup) {}

  // Each hook gets its event's context (tk/context.h): the calls that belong to the event.

  /// Once, before the first epoch (after load_state when resuming).
  virtual void on_fit_start(FitStartContext& ctx) {}
  /// Before an epoch's first micro-batch.
  virtual void on_epoch_start(EpochStartContext& ctx) {}
  /// A micro-batch was fetched; before its forward pass (ctx.window() says where it sits).
  virtual void on_micro_batch(MicroBatchContext& ctx) {}
  /// The loss tensor is ready; ctx.set_loss() may replace it (rescaled) before backward.
  virtual void on_loss(LossContext& ctx) {}
  /// This micro-batch's gradients were added in.
  virtual void on_backward(BackwardContext& ctx) {}
  /// The window is complete, before the optimizer step: sync, normalize, unscale, clip, veto
  /// (ctx.gradients(), ctx.optimizer()).
  virtual void on_boundary(BoundaryContext& ctx) {}
  /// After the optimizer step (or its veto), the schedule step and zero_grad.
  virtual void on_step_end(StepEndContext& ctx) {}
  /// After an epoch's last micro-batch.
  virtual void on_epoch_end(EpochEndContext& ctx) {}
  /// Before a validation pass (model in eval mode, no grad).
  virtual void on_validation_start(ValidationStartContext& ctx) {}
  /// After a validation pass; ctx.validation_loss() is set.
  virtual void on_validation_end(ValidationEndContext& ctx) {}
  /// Once at the end, however the run ended (ctx.status()): also after a failure or a stop.
  virtual void on_fit_end(FitEndContext& ctx) {}

  /// Writes the plugin's own files into the output folder (rank 0, outputs on): after on_fit_end
  /// of a completed run, and on a resume of a finished run that finds one of them missing (after
  /// load_state from its final checkpoint).
  virtual void write_files(OutputFiles& files) {}
  /// The plugin's state, for checkpoints.
  virtual StateDict state() const { return {}; }
  /// Restores what `state()` returned; on a resume, before on_fit_start.
  virtual void load_state(const StateDict& s) {}

  /// The name under which the plugin was loaded.
  const std::string& name() const noexcept;
  /// The validated options of this instance (where each was set; whether it was given).
  const Options& options() const noexcept;
  /// An error located at the recipe position of the option bound to `member` (as given to
  /// bind()); usable in init() and any later hook.
  template <class T>
  [[noreturn]] void fail_option(const T& member, const std::string& what) const {
    static_assert(!std::is_array_v<T> && !std::is_pointer_v<T>,
                  "fail_option takes the member an option is bound to (fail_option(steps_, ...)), not its name");
    fail_bound(&member, what);
  }
  /// Whether the recipe (or a --set) gave the option bound to `member`, rather than its default.
  template <class T>
  bool option_given(const T& member) const {
    static_assert(!std::is_array_v<T> && !std::is_pointer_v<T>, "option_given takes the bound member, not a name");
    return given_bound(&member);
  }
  /// Whether the core calls this plugin for `e`: its class overrides that hook and it has not
  /// declined it.
  bool handles(Event e) const noexcept;

 protected:
  /// Stops the calls of this plugin's hook for `e` for the rest of the run: for a plugin that
  /// finds, at run time, that it has nothing to do there (bf16 needs no loss-scale check).
  void decline(Event e) noexcept;

 private:
  friend struct detail::PluginAccess;
  [[noreturn]] void fail_bound(const void* member, const std::string& what) const;
  bool given_bound(const void* member) const;
  std::unique_ptr<detail::PluginState> state_;
};

/// Every virtual function of Plugin after its destructor, in declaration order:
/// X(return type, name, parameters, qualifier). The loader's layout signature covers this table:
/// a plugin compiled against headers with another hook table is refused. Keep it in step with
/// the class (a core test checks it against the class's virtual table).
#define TK_PLUGIN_VIRTUALS(X)                           \
  X(void, bind, (OptionBinder&), )                      \
  X(void, init, (), )                                   \
  X(Contract, contract, (), const)                      \
  X(void, configure, (RunPlan&), )                      \
  X(void, setup, (SetupContext&), )                     \
  X(void, on_fit_start, (FitStartContext&), )           \
  X(void, on_epoch_start, (EpochStartContext&), )       \
  X(void, on_micro_batch, (MicroBatchContext&), )       \
  X(void, on_loss, (LossContext&), )                    \
  X(void, on_backward, (BackwardContext&), )            \
  X(void, on_boundary, (BoundaryContext&), )            \
  X(void, on_step_end, (StepEndContext&), )             \
  X(void, on_epoch_end, (EpochEndContext&), )           \
  X(void, on_validation_start, (ValidationStartContext&), ) \
  X(void, on_validation_end, (ValidationEndContext&), ) \
  X(void, on_fit_end, (FitEndContext&), )               \
  X(void, write_files, (OutputFiles&), )                \
  X(StateDict, state, (), const)                        \
  X(void, load_state, (const StateDict&), )

/// Where the changes between plugin APIs are written down, for the messages that refuse a source
/// written for an older one.
#define TK_PORTING_NOTES                                                                              \
  "The changes from older plugin APIs are the tables 'Porting a plugin to API 4', '... to API 5', " \
  "'... to API 6' and '... to API 7' in trainkit's plugin guide: <prefix>/share/doc/trainkit/plugins.md where "      \
  "trainkit is installed (tk-plugin --help prints it), docs/plugins.md in its source."
#define TK_API1_PLUGIN_MESSAGE                                                                        \
  "this plugin is written for plugin API 1 (events(), on_event(), option_specs() or "               \
  "init(const tk::Options&)): a plugin now overrides one hook per event (on_boundary(tk::BoundaryContext&), " \
  "...), binds its options to members in bind(tk::OptionBinder&) and checks them in init(). "        \
  TK_PORTING_NOTES

/// Plugin API 1's set of subscribed events. Gone since API 3 (a plugin overrides the hooks of the
/// events it takes); kept so that a source written for API 1 is told where to look.
struct [[deprecated("tk::EventSet is plugin API 1: a plugin now overrides the hook of each event it takes. " TK_PORTING_NOTES)]]
EventSet {
  EventSet(std::initializer_list<Event>) {}
};

#pragma GCC visibility push(hidden)  // the core's own: not exported
namespace detail {
/// Whether `T` declares a member of plugin API 1 (events(), on_event(), option_specs(),
/// init(const Options&)): TK_PLUGIN and Registry::add_plugin refuse such a class, pointing to the
/// porting notes.
template <class T, class = void>
inline constexpr bool has_api1_events_v = false;
template <class T>
inline constexpr bool has_api1_events_v<T, std::void_t<decltype(&T::events)>> = true;
template <class T, class = void>
inline constexpr bool has_api1_on_event_v = false;
template <class T>
inline constexpr bool has_api1_on_event_v<T, std::void_t<decltype(&T::on_event)>> = true;
template <class T, class = void>
inline constexpr bool has_api1_option_specs_v = false;
template <class T>
inline constexpr bool has_api1_option_specs_v<T, std::void_t<decltype(&T::option_specs)>> = true;
template <class T, class = void>
inline constexpr bool has_api1_init_v = false;
template <class T>
inline constexpr bool has_api1_init_v<T, std::void_t<decltype(std::declval<T&>().init(std::declval<const Options&>()))>> =
    true;
template <class T>
inline constexpr bool is_api1_plugin_v =
    has_api1_events_v<T> || has_api1_on_event_v<T> || has_api1_option_specs_v<T> || has_api1_init_v<T>;

#define TK_CHECK_VIRTUAL(R, N, A, Q) \
  static_assert(std::is_same_v<decltype(&Plugin::N), R(Plugin::*) A Q>, "TK_PLUGIN_VIRTUALS: " #N " differs from Plugin");
TK_PLUGIN_VIRTUALS(TK_CHECK_VIRTUAL)
#undef TK_CHECK_VIRTUAL

/// The context type a hook member takes (void when it is not a hook's shape).
template <class M>
struct hook_context {
  using type = void;
};
template <class C, class A>
struct hook_context<void (C::*)(A&)> {
  using type = A;
};

/// The events whose hooks class `T` overrides (bit e set: it overrides the hook of Event e). A
/// hook that takes another context than its event's (tk::Context&, as before plugin API 7) would
/// hide the base's and never be called: refused.
template <class T>
constexpr uint32_t hooks_of() noexcept {
  static_assert(std::is_base_of_v<Plugin, T>, "a plugin derives from tk::Plugin");
  static_assert(!is_api1_plugin_v<T>, TK_API1_PLUGIN_MESSAGE);
  uint32_t hooks = 0;
#define TK_HOOK_BIT(hook, event, context)                                                                        \
  static_assert(std::is_same_v<typename hook_context<decltype(&T::hook)>::type, context>,                        \
                "a plugin's " #hook " takes tk::" #context "& since plugin API 7 (it took tk::Context&): write "  \
                "void " #hook "(tk::" #context "& ctx) override. " TK_PORTING_NOTES);                           \
  if (!std::is_same_v<decltype(&T::hook), void (Plugin::*)(context&)>) hooks |= 1u << static_cast<unsigned>(Event::event);
  TK_EVENT_HOOKS(TK_HOOK_BIT)
#undef TK_HOOK_BIT
  return hooks;
}
/// Whether `T` is a concrete plugin type the core can read hooks from (not tk::Plugin itself).
template <class T>
inline constexpr bool is_plugin_type_v = std::is_base_of_v<Plugin, T> && !std::is_same_v<T, Plugin>;
/// Every event.
inline constexpr uint32_t kAllHooks = (1u << kEventCount) - 1;
/// The hooks the core calls on `plugin`, given as a `T`: those `T` overrides when `plugin` is a `T`
/// itself, every event when it is of a class derived from `T` (which may override more; the base
/// hooks do nothing).
template <class T>
uint32_t hooks_for(const T& plugin) noexcept {
  return typeid(plugin) == typeid(T) ? hooks_of<T>() : kAllHooks;
}
}  // namespace detail
#pragma GCC visibility pop

/// The hooks of a plugin given without its class (a std::shared_ptr<tk::Plugin>).
inline constexpr uint32_t kUnknownHooks = ~0u;
/// Makes a plugin made in code what the core makes of a [[plugins]] entry: named `name`, its
/// options bound from `options` (TOML text; refused as a recipe's would be) and init() run, the
/// core calling it only for the events in `hooks` (detail::hooks_for<YourPlugin>(plugin)). Once per
/// instance; a plugin from a library's registry is ready already. Trainer::add_plugin and
/// tk::testing::prepare call it.
void prepare_plugin(Plugin& plugin, const std::string& name, const std::string& options, uint32_t hooks);
/// Whether `plugin` was made ready (by its registry or prepare_plugin).
bool is_prepared(const Plugin& plugin) noexcept;

}  // namespace tk

#pragma GCC visibility pop
