// Steps that leave nothing behind (engine.h): the plugins' whole cycle for the memory planner's
// trials and the accumulation verifier.
#include "engine/engine.h"

namespace tk::detail {
namespace {

/// The trial's state: ctx.trial() true, the plugins' warnings kept and their info lines left out
/// (each trial would repeat them).
LoopState trial_state(Run& run) {
  LoopState s = loop_state(run);
  s.trial = true;
  auto log = run.dispatch.log;
  s.d.log = [log](int level, const std::string& msg) {
    if (level > 0 && log) log(level, msg);
  };
  return s;
}

}  // namespace

TrialRun::TrialRun(Run& run)
    : r_(run), s_(trial_state(run)), events_(run, s_, trace_), engine_(run, s_, events_, phases_) {
  events_.emit(Event::FitStart);
}

TrialRun::~TrialRun() {
  if (!finished_) events_.fit_end_after_failure();
}

void TrialRun::open_window(int64_t size) {
  s_.totals = WindowTotals{};
  s_.window = Window{0, size, size};
  s_.host_reads = 0;
  next_ = 0;
}

void TrialRun::micro_batch(const Batch& batch) {
  s_.window.index = next_++;
  s_.batch = &batch;
  try {
    engine_.micro_batch(batch);
  } catch (...) {
    s_.batch = nullptr;
    throw;
  }
  s_.batch = nullptr;
}

void TrialRun::finish() {
  finished_ = true;
  s_.status = FitStatus::Trial;
  events_.fit_end();
}

}  // namespace tk::detail
