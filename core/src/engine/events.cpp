// The plugins' hooks by event (engine.h): who handles each, in dispatch order, and their calls.
#include "engine/engine.h"

namespace tk::detail {

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
      return PluginRuntimeError("plugin '" + s.name + "' failed in event " + to_string(e) + " at step " +
                                std::to_string(s_.counters.step) + " (micro-batch " +
                                std::to_string(s_.counters.micro_step) + "): " + what);
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
        first = std::make_exception_ptr(PluginRuntimeError("plugin '" + s->name + "' failed in event fit_end at step " +
                                                           std::to_string(s_.counters.step) + ": " + message_of(err)));
    } catch (...) {
      if (!first)
        first = std::make_exception_ptr(PluginRuntimeError("plugin '" + s->name +
                                                           "' failed in event fit_end: an unknown exception"));
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
