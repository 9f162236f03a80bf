#pragma once
/// Names plugins use in their Contract to say what they provide and what must run before them.
/// At most one plugin may provide each capability; the core orders dispatch so that the providers
/// of everything in a plugin's `after` list run first. The boundary order this encodes is
/// sync -> normalize -> unscale -> clip -> step.
namespace tk::cap {

inline constexpr const char* kWindow = "window";                   ///< shapes the accumulation window
inline constexpr const char* kGradsSynced = "grads.synced";        ///< gradients summed across ranks
inline constexpr const char* kGradsNormalized = "grads.normalized";///< gradients divided by the window's items
inline constexpr const char* kGradsUnscaled = "grads.unscaled";    ///< loss scale removed, overflow checked
inline constexpr const char* kGradsClipped = "grads.clipped";      ///< norm or value clipped
inline constexpr const char* kLossScale = "loss.scale";            ///< multiplies the loss before backward
inline constexpr const char* kAutocast = "autocast";               ///< runs forward under autocast
inline constexpr const char* kOptimizerSharded = "optimizer.sharded"; ///< the optimizer's state split across the ranks

/// Every name above. A name in `after` or `requires_` that is neither one of these nor provided
/// by a plugin of the run is reported (a warning for `after`, part of the error for `requires_`):
/// it is most likely a typo that would silently drop an ordering.
inline constexpr const char* kKnown[] = {kWindow,     kGradsSynced, kGradsNormalized, kGradsUnscaled,
                                         kGradsClipped, kLossScale, kAutocast,        kOptimizerSharded};

}  // namespace tk::cap
