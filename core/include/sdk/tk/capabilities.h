#pragma once
/// Capabilities: what plugins say in their Contract they provide and what must run before them.
/// At most one plugin may provide each capability; the core orders dispatch so that the providers
/// of everything in a plugin's `after` list run first (last in the events that close a region,
/// tk::closes: a plugin after another is nested inside it). The boundary order this encodes is
/// sync -> normalize -> unscale -> clip -> step.
#include <string>
#include <utility>

// What this header declares is libtrainkit's interface: exported (the library hides the rest).
#pragma GCC visibility push(default)

namespace tk {

/// A capability's name, typed: a Contract lists these and RunPlan::has asks for one. trainkit's
/// are the constants of tk::cap; a plugin's own is made explicitly, `tk::Capability{"my.name"}`,
/// so that a bare string (a misspelled "grads.synced", say) does not compile where a capability
/// is expected.
class Capability {
 public:
  explicit Capability(const char* name) : name_(name) {}
  explicit Capability(std::string name) : name_(std::move(name)) {}
  const std::string& name() const noexcept { return name_; }
  bool operator==(const Capability& other) const noexcept { return name_ == other.name_; }
  bool operator!=(const Capability& other) const noexcept { return name_ != other.name_; }
  bool operator<(const Capability& other) const noexcept { return name_ < other.name_; }

 private:
  std::string name_;
};

namespace cap {

inline const Capability kWindow{"window"};                        ///< shapes the accumulation window
inline const Capability kGradsSynced{"grads.synced"};             ///< gradients summed across ranks
inline const Capability kGradsNormalized{"grads.normalized"};     ///< gradients divided by the window's items
inline const Capability kGradsUnscaled{"grads.unscaled"};         ///< loss scale removed, overflow checked
inline const Capability kGradsClipped{"grads.clipped"};           ///< norm or value clipped
inline const Capability kLossScale{"loss.scale"};                 ///< multiplies the loss before backward
inline const Capability kAutocast{"autocast"};                    ///< runs forward under autocast
inline const Capability kOptimizerSharded{"optimizer.sharded"};   ///< the optimizer's state split across the ranks
/// Gradients split across the ranks: from the window's sync on, each rank holds the gradients of
/// the parameters it updates and no others. A plugin that combines gradients (a norm, an overflow
/// check) combines its rank's part and reduces the result over the world. The core leaves a
/// parameter without a gradient at the boundary as it is (no zeros are made for it).
inline const Capability kGradsSharded{"grads.sharded"};
/// Parameters split across the ranks (ZeRO stage 3): between uses each is whole only on the ranks
/// that keep it (tk::ShardedParameters); what reads every parameter gathers them
/// (tk::WholeParameters). The core then reckons each rank's training state with its share of the
/// parameters.
inline const Capability kParamsSharded{"params.sharded"};

/// Every name above. A name in `after` or `requires_` that is neither one of these nor provided
/// by a plugin of the run is reported (a warning for `after`, part of the error for `requires_`):
/// most likely a typo in a plugin's own name, which would silently drop an ordering.
inline const Capability kKnown[] = {kWindow,    kGradsSynced, kGradsNormalized,  kGradsUnscaled, kGradsClipped,
                                    kLossScale, kAutocast,    kOptimizerSharded, kGradsSharded, kParamsSharded};

}  // namespace cap
}  // namespace tk

#pragma GCC visibility pop
