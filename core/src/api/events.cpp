// The events (tk/events.h): their names, their hooks' names, and the call of a hook by event.
#include "tk/events.h"

#include "tk/plugin.h"
#include "api/api.h"

namespace tk {

const char* to_string(Event e) noexcept {
  switch (e) {
    case Event::FitStart: return "fit_start";
    case Event::EpochStart: return "epoch_start";
    case Event::MicroBatch: return "micro_batch";
    case Event::Loss: return "loss";
    case Event::Backward: return "backward";
    case Event::Boundary: return "boundary";
    case Event::StepEnd: return "step_end";
    case Event::EpochEnd: return "epoch_end";
    case Event::ValidationStart: return "validation_start";
    case Event::ValidationEnd: return "validation_end";
    case Event::FitEnd: return "fit_end";
  }
  return "?";
}

const char* hook_name(Event e) noexcept {
  switch (e) {
#define TK_HOOK_NAME(hook, event, context) \
  case Event::event: return #hook;
    TK_EVENT_HOOKS(TK_HOOK_NAME)
#undef TK_HOOK_NAME
  }
  return "?";
}

bool closes(Event e) noexcept {
  return e == Event::Loss || e == Event::StepEnd || e == Event::EpochEnd || e == Event::ValidationEnd ||
         e == Event::FitEnd;
}

namespace detail {

void dispatch(Plugin& p, Event e, LoopState& state) {
  switch (e) {
#define TK_DISPATCH(hook, event, context)                  \
  case Event::event: {                                     \
    auto ctx = ContextAccess::view<context>(state);        \
    p.hook(ctx);                                           \
    return;                                                \
  }
    TK_EVENT_HOOKS(TK_DISPATCH)
#undef TK_DISPATCH
  }
}

}  // namespace detail

}  // namespace tk
