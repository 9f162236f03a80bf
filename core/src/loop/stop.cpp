// Stopping early at a boundary (loop.h): a signal or the time limit, agreed by the world.
#include <fmt/format.h>

#include <cmath>

#include "loop/loop.h"

namespace tk::detail {

StopRule::StopRule(const Run& run, const TrainerOptions& opts) : r_(run), opts_(opts) {}

void StopRule::start(int64_t first_step) {
  t0_ = std::chrono::steady_clock::now();
  first_step_ = first_step;
}

double StopRule::elapsed() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
}

FitStatus StopRule::decide() {
  // Ordered by strength: the world agrees on the largest value any rank has.
  enum : int64_t { kGoOn = 0, kOutOfTime = 1, kSignalled = 2 };
  int64_t stop = kGoOn;
  if (opts_.stop_requested && opts_.stop_requested()) stop = kSignalled;
  else if (elapsed() >= r_.max_time_s) stop = kOutOfTime;
  if (r_.plan.world_size > 1) stop = r_.world->max(stop);
  return stop == kSignalled ? FitStatus::StoppedBySignal : stop == kOutOfTime ? FitStatus::StoppedByTime
                                                                            : FitStatus::Running;
}

void StopRule::note_unfinished_schedule(Run& run, const LoopState& s) const {
  if (run.plan.rank != 0) return;
  // A schedule whose last rate is this step's lost nothing (a constant one, say).
  const double last = run.schedule->lr(run.total_steps - 1, run.total_steps);
  if (last == s.lr) return;
  const int64_t done = s.counters.step - first_step_;
  const double seconds = elapsed();
  if (done < 1 || seconds <= 0.0) return;
  const auto fit = static_cast<int64_t>(std::floor(static_cast<double>(done) * run.max_time_s / seconds));
  run.warn(fmt::format("run.max_time stopped the run at step {} of run.steps = {}: schedule '{}' had not ended (lr "
                       "{:.3g} at this step, {:.3g} at its last). At this run's pace ({:.3g} s a step) about {} steps "
                       "fit in run.max_time; set run.steps to that for a schedule that ends with the time",
                       s.counters.step, run.total_steps, run.sched_name, s.lr, last, seconds / static_cast<double>(done),
                       first_step_ + fit));
}

}  // namespace tk::detail
