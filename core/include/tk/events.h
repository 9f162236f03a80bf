#pragma once
/// The events the training loop emits, in the order documented in docs/plugins.md.
#include <cstdint>
#include <initializer_list>

namespace tk {

enum class Event : uint8_t {
  FitStart,         ///< once, before the first epoch
  EpochStart,       ///< before an epoch's first micro-batch
  MicroBatch,       ///< a micro-batch was fetched; before its forward pass
  Loss,             ///< the loss tensor is ready; plugins may rescale `ctx.loss`
  Backward,         ///< this micro-batch's gradients were added in
  Boundary,         ///< last micro-batch of a window: before the optimizer step
  StepEnd,          ///< after the optimizer step (or its veto), the schedule step and zero_grad
  EpochEnd,         ///< after an epoch's last micro-batch
  ValidationStart,  ///< before a validation pass (model in eval mode, no grad)
  ValidationEnd,    ///< after a validation pass; `ctx.validation_loss` is set
  FitEnd,           ///< once, after training (also after a failure, best effort)
};

inline constexpr int kEventCount = 11;

/// Stable lower-case name ("micro_batch", "boundary", ...), used in traces and errors.
const char* to_string(Event e) noexcept;

/// A set of events a plugin subscribes to.
class EventSet {
 public:
  constexpr EventSet() = default;
  constexpr EventSet(std::initializer_list<Event> events) {
    for (Event e : events) bits_ |= bit(e);
  }
  static constexpr EventSet all() {
    EventSet s;
    s.bits_ = (1u << kEventCount) - 1;
    return s;
  }
  constexpr bool contains(Event e) const { return (bits_ & bit(e)) != 0; }

 private:
  static constexpr uint32_t bit(Event e) { return 1u << static_cast<unsigned>(e); }
  uint32_t bits_ = 0;
};

}  // namespace tk
