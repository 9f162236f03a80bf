#pragma once
/// The plugin interface (ABI version 3): one hook per event, a setup hook, a declared contract.
#include <string>
#include <vector>

#include "tk/capabilities.h"
#include "tk/context.h"
#include "tk/events.h"
#include "tk/options.h"

namespace tk {

/// Ordering and compatibility a plugin declares (names from tk/capabilities.h or its own).
struct Contract {
  std::vector<std::string> provides;  ///< at most one plugin of a run may provide each
  std::vector<std::string> after;     ///< providers of these (if present) run before this plugin
  std::vector<std::string> requires_; ///< refuse the run unless some plugin provides these
  std::vector<std::string> conflicts; ///< refuse the run if some plugin provides these
};

/// Base class of every strategy. The core makes it through its library's registry, hands it its
/// validated options (init), lets it shape the run plan (configure) and the model (setup), then
/// calls the hooks of the events it overrides, in the order the contracts give.
///
/// Override only the hooks you need. The base hooks do nothing and tell the core that the plugin
/// does not handle that event, so it is not called for it again (an override must not call them).
/// A hook that throws stops the run; the core reports plugin, event and step.
class Plugin {
 public:
  virtual ~Plugin() = default;

  /// Options a recipe may set for this plugin; unknown or mistyped ones are refused by the core.
  virtual OptionSpecs option_specs() const { return {}; }
  /// Receives the validated options (defaults filled in). Reject bad values with fail_option().
  virtual void init(const Options& opts) {}
  /// Declares ordering needs and what this plugin provides.
  virtual Contract contract() const { return {}; }
  /// Adjusts the run plan (window, world) before training starts.
  virtual void configure(RunPlan& plan) {}
  /// Once, after the model is built and before the optimizer exists; may change the model.
  virtual void setup(SetupContext& setup) {}

  /// Once, before the first epoch (after load_state when resuming).
  virtual void on_fit_start(Context& ctx) { decline(Event::FitStart); }
  /// Before an epoch's first micro-batch.
  virtual void on_epoch_start(Context& ctx) { decline(Event::EpochStart); }
  /// A micro-batch was fetched; before its forward pass (ctx.window() says where it sits).
  virtual void on_micro_batch(Context& ctx) { decline(Event::MicroBatch); }
  /// The loss tensor is ready; ctx.loss() may be replaced (rescaled) before backward.
  virtual void on_loss(Context& ctx) { decline(Event::Loss); }
  /// This micro-batch's gradients were added in.
  virtual void on_backward(Context& ctx) { decline(Event::Backward); }
  /// The window is complete, before the optimizer step: sync, normalize, unscale, clip, veto.
  virtual void on_boundary(Context& ctx) { decline(Event::Boundary); }
  /// After the optimizer step (or its veto), the schedule step and zero_grad.
  virtual void on_step_end(Context& ctx) { decline(Event::StepEnd); }
  /// After an epoch's last micro-batch.
  virtual void on_epoch_end(Context& ctx) { decline(Event::EpochEnd); }
  /// Before a validation pass (model in eval mode, no grad).
  virtual void on_validation_start(Context& ctx) { decline(Event::ValidationStart); }
  /// After a validation pass; ctx.validation_loss() is set.
  virtual void on_validation_end(Context& ctx) { decline(Event::ValidationEnd); }
  /// Once at the end, however the run ended (ctx.status()): also after a failure or a stop.
  virtual void on_fit_end(Context& ctx) { decline(Event::FitEnd); }

  /// The plugin's state, for checkpoints.
  virtual StateDict state() const { return {}; }
  /// Restores what `state()` returned; on a resume, before on_fit_start.
  virtual void load_state(const StateDict& s) {}

  /// The name under which the plugin was loaded.
  const std::string& name() const noexcept { return name_; }
  void set_name(std::string n) { name_ = std::move(n); }
  /// The validated options of this instance (set by the core before init).
  const Options& options() const noexcept { return options_; }
  void set_options(Options o) { options_ = std::move(o); }
  /// An error located at the recipe position of option `key`; usable in any hook.
  [[noreturn]] void fail_option(const std::string& key, const std::string& what) const { options_.fail(key, what); }

  /// False once a hook for `e` turned out to be the base one (known after its first dispatch).
  bool handles(Event e) const noexcept { return (declined_ & (1u << static_cast<unsigned>(e))) == 0; }

 protected:
  /// Called by the base hooks only.
  void decline(Event e) noexcept { declined_ |= 1u << static_cast<unsigned>(e); }

 private:
  std::string name_;
  Options options_;
  uint32_t declined_ = 0;
};

/// Calls the hook of `e` on `p`.
void dispatch(Plugin& p, Event e, Context& ctx);

}  // namespace tk
