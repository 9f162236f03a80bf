// The plugins' hooks by event (engine.h): who handles each, in dispatch order, and their calls.
#include "engine/engine.h"

namespace tk::detail {
namespace {

/// Where in the run event `e` came, in the records' terms (steps counted from 1): "in step 3,
/// micro-batch 2 of 4"; "in step 3" at its boundary and end (the step the records number 3);
/// "after step 2" (or "before the first step") for the events between steps. A trial step (the
/// plan's measure of memory, the accumulation check) is no step of the records: said so.
std::string position(Event e, const LoopState& s) {
  const Counters& c = s.counters;
  const std::string next = s.trial ? std::string("a trial step before training") : "step " + std::to_string(c.step + 1);
  switch (e) {
    case Event::MicroBatch:
    case Event::Loss:
    case Event::Backward:
      return "in " + next + ", micro-batch " + std::to_string(s.window.index + 1) + " of " +
             std::to_string(s.window.size);
    case Event::Boundary: return "in " + next;
    case Event::StepEnd: return s.trial ? "in " + next : "in step " + std::to_string(c.step);
    default: return c.step == 0 ? "before the first step" : "after step " + std::to_string(c.step);
  }
}

/// "plugin 'x' (its file) failed in event e <position>: <what>".
std::string failed_in(const Slot& s, Event e, const LoopState& state, const std::string& what) {
  return s.label() + " failed in event " + to_string(e) + " " + position(e, state) + ": " + what;
}

}  // namespace

Events::Events(Run& run, LoopState& state, std::vector<TraceEntry>& trace)
    : r_(run), s_(state), trace_(trace) {
  // An event that closes what another opened goes to the plugins in reverse order: the one that
  // opened its region last (innermost) closes it first.
  for (int e = 0; e < kEventCount; ++e) {
    const bool reverse = closes(static_cast<Event>(e));
    for (size_t k = 0; k < run.order.size(); ++k) {
      const size_t i = run.order[reverse ? run.order.size() - 1 - k : k];
      if (run.slots[i].plugin->handles(static_cast<Event>(e))) handlers_[e].push_back(&run.slots[i]);
    }
  }
  for (const Slot* s : handlers_[static_cast<size_t>(Event::FitStart)]) not_started_.insert(s);
}

void Events::emit(Event e) {
  auto& list = handlers_[static_cast<size_t>(e)];
  for (size_t i = 0; i < list.size();) {
    const Slot& s = *list[i];
    if (!s.plugin->handles(e)) {  // it declined the event (in this hook or another)
      list.erase(list.begin() + static_cast<std::ptrdiff_t>(i));
      continue;
    }
    s_.d.enter(s.name, hook_name(e), e);
    auto failure = [&](const std::string& what) {
      s_.d.leave();
      return PluginRuntimeError(failed_in(s, e, s_, what));
    };
    try {
      dispatch(*s.plugin, e, s_);
    } catch (const std::exception& err) {  // LibTorch's among them: one line, no C++ stack
      throw failure(message_of(err));
    } catch (...) {
      throw failure("an unknown exception");
    }
    if (e == Event::FitStart) not_started_.erase(&s);
    if (r_.tracing) trace_.push_back({s.name, e, s_.counters.step, s_.counters.micro_step});
    ++i;
  }
  s_.d.leave();
}

void Events::fit_end() {
  std::exception_ptr first;
  for (const Slot* s : handlers_[static_cast<size_t>(Event::FitEnd)]) {
    if (!s->plugin->handles(Event::FitEnd)) continue;
    s_.d.enter(s->name, hook_name(Event::FitEnd), Event::FitEnd);
    try {
      dispatch(*s->plugin, Event::FitEnd, s_);
    } catch (const std::exception& err) {
      if (!first)
        first = std::make_exception_ptr(PluginRuntimeError(failed_in(*s, Event::FitEnd, s_, message_of(err))));
    } catch (...) {
      if (!first)
        first = std::make_exception_ptr(PluginRuntimeError(failed_in(*s, Event::FitEnd, s_, "an unknown exception")));
    }
    if (r_.tracing) trace_.push_back({s->name, Event::FitEnd, s_.counters.step, s_.counters.micro_step});
  }
  s_.d.leave();
  if (first) std::rethrow_exception(first);
}

void Events::fit_end_after_failure() {
  if (s_.status != FitStatus::Running) return;  // fit_end itself failed: every plugin had it already
  s_.status = FitStatus::Failed;
  for (const Slot* s : handlers_[static_cast<size_t>(Event::FitEnd)]) {
    if (not_started_.count(s) || !s->plugin->handles(Event::FitEnd)) continue;
    try {
      s_.d.enter(s->name, hook_name(Event::FitEnd), Event::FitEnd);
      dispatch(*s->plugin, Event::FitEnd, s_);
    } catch (...) {
    }
  }
  s_.d.leave();
}

}  // namespace tk::detail
