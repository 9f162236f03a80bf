#pragma once
/// The events the training loop emits, in the order documented in docs/plugins.md. Each has a
/// hook of the same name on tk::Plugin (Event::MicroBatch -> Plugin::on_micro_batch).
#include <cstdint>

// What this header declares is libtrainkit's interface: exported (the library hides the rest).
#pragma GCC visibility push(default)

namespace tk {

enum class Event : uint8_t {
  FitStart,         ///< once, before the first epoch
  EpochStart,       ///< before an epoch's first micro-batch
  MicroBatch,       ///< a micro-batch was fetched; before its forward pass
  Loss,             ///< the loss tensor is ready; plugins may rescale `ctx.loss()`
  Backward,         ///< this micro-batch's gradients were added in
  Boundary,         ///< last micro-batch of a window: before the optimizer step
  StepEnd,          ///< after the optimizer step (or its veto), the schedule step and zero_grad
  EpochEnd,         ///< after an epoch's last micro-batch
  ValidationStart,  ///< before a validation pass (model in eval mode, no grad)
  ValidationEnd,    ///< after a validation pass; `ctx.validation_loss()` is set
  FitEnd,           ///< once, after training, however it ended (see Context::status)
};

inline constexpr int kEventCount = 11;

/// Stable lower-case name ("micro_batch", "boundary", ...), used in traces and errors.
const char* to_string(Event e) noexcept;
/// The name of the event's hook on tk::Plugin ("on_micro_batch", "on_boundary", ...).
const char* hook_name(Event e) noexcept;
/// Whether `e` closes what an earlier event opened (Loss closes MicroBatch, StepEnd closes
/// Boundary, EpochEnd, ValidationEnd and FitEnd close their starts): such an event goes to the
/// plugins in reverse dispatch order, so that regions they open nest (inner closed first).
bool closes(Event e) noexcept;

}  // namespace tk

#pragma GCC visibility pop
