// A window's micro-batches and its optimizer step (engine.h): the events around each phase.
#include <c10/util/Exception.h>

#include <cmath>

#include "assemble/assemble.h"
#include "engine/engine.h"
#include "support/support.h"
#include "tk/compat.h"

namespace tk::detail {

void PhaseTimes::mark() {
  if (!on) return;
  if (cuda) compat::cuda_synchronize();
  t = std::chrono::steady_clock::now();
}

void PhaseTimes::add(Phase p) {
  if (!on) return;
  const auto before = t;
  mark();
  ms[static_cast<size_t>(p)] += std::chrono::duration<double, std::milli>(t - before).count();
}

void PhaseTimes::record(StepRecord& line) const {
  static constexpr MetricKey kKeys[kPhases] = {metric::kDataMs,     metric::kForwardMs,   metric::kBackwardMs,
                                                metric::kBoundaryMs, metric::kOptimizerMs, metric::kValidationMs};
  if (!on) return;
  for (size_t p = 0; p < kPhases; ++p)
    if (p != kValidation || ms[p] > 0.0) line.add(kKeys[p], ms[p]);
}

std::string model_files(const Run& r) {
  std::string files;
  for (const auto& c : r.registry.models())
    if (c.name == r.model_name)
      for (const auto& spec : c.specs)
        if (spec.type == OptionType::Path && r.model_opts.has(spec.name) && !r.model_opts.get_path(spec.name).empty())
          files += (files.empty() ? "" : ", ") + r.model_opts.get_path(spec.name);
  // Every model's `init`, whose weights replace its own.
  if (r.model_opts.has("init") && !r.model_opts.get_path("init").empty())
    files += (files.empty() ? "" : ", ") + r.model_opts.get_path("init");
  return files;
}

std::string model_label(const Run& r) {
  const std::string files = model_files(r);
  return "model '" + r.model_name + "'" + (files.empty() ? "" : " (" + files + ")");
}

StepEngine::StepEngine(Run& run, LoopState& state, Events& events, PhaseTimes& phases)
    : r_(run), s_(state), events_(events), phases_(phases) {}

void StepEngine::micro_batch(const Batch& batch) {
  phases_.mark();
  events_.emit(Event::MicroBatch);
  if (s_.compute_dtype == at::ScalarType::Undefined && !s_.trial)
    s_.compute_dtype = compat::autocast_enabled(r_.device.type()) ? compat::autocast_dtype(r_.device.type()) : r_.dtype;
  at::Tensor out = r_.model->forward(batch.input);
  s_.loss = (*r_.loss)(out, batch);
  if (!s_.loss.requires_grad())
    throw Error(model_label(r_) + ": its output does not depend on a trainable parameter (it is detached, or computed "
                "without grad): backward has nothing to differentiate");
  // The loss stays on the device: no host read per micro-batch (loss_value() reads on demand).
  s_.loss_item = s_.loss.detach();
  s_.loss_read = false;
  events_.emit(Event::Loss);
  phases_.add(PhaseTimes::kForward);
  s_.loss.backward();
  s_.loss = at::Tensor();
  Counters& c = s_.counters;
  WindowTotals& t = s_.totals;
  ++c.micro_step;
  c.samples_seen += batch.samples;
  c.tokens_seen += batch.tokens;
  t.micro_batches += 1;
  t.samples += batch.samples;
  t.tokens += batch.tokens;
  // The item-weighted sum, in place: one device op per micro-batch. A float32 (or 16-bit) loss
  // times a count below 2^29 is exact in float64, so the fused add rounds as a mul and an add would.
  const double items = r_.plan.reduction == Reduction::Mean ? static_cast<double>(batch.tokens) : 1.0;
  if (t.loss.defined()) {
    t.loss.add_(s_.loss_item, items);
  } else {
    t.loss = s_.loss_item.to(at::kDouble, /*non_blocking=*/false, /*copy=*/true);  // not an alias of the loss
    if (items != 1.0) t.loss.mul_(items);
  }
  events_.emit(Event::Backward);
  phases_.add(PhaseTimes::kBackward);
}

LoopState loop_state(Run& run) {
  LoopState s;
  s.model = run.model.get();
  s.optimizer = run.optimizer.get();
  s.plan = &run.plan;
  s.world = run.world.get();
  s.counters.total_steps = run.total_steps;
  s.d.log = run.dispatch.log;
  return s;
}

void StepEngine::boundary() {
  s_.lr = r_.schedule->lr(s_.counters.schedule_step, r_.total_steps);
  set_lr(*r_.optimizer, s_.lr);
  s_.step.clear();
  phases_.mark();
  complete_grads(r_);
  events_.emit(Event::Boundary);
  // After the boundary (a sync plugin may have replaced the totals with sums over all ranks):
  // the step's one read from the device.
  s_.read_step_values();
  phases_.add(PhaseTimes::kBoundary);
}

bool StepEngine::step(const std::function<std::string()>& diagnose, bool step_vetoed) {
  boundary();
  const WindowTotals& t = s_.totals;
  s_.window_loss = t.tokens > 0 ? t.loss_sum / static_cast<double>(t.tokens) : 0.0;
  const bool skipped = !s_.step.veto_reason.empty();
  if (!skipped && diagnose && !std::isfinite(s_.window_loss)) throw Error(diagnose());
  if (!skipped || step_vetoed) r_.optimizer->step();
  if (skipped) ++s_.counters.skipped_steps;
  clear_grads(r_);
  ++s_.counters.step;
  if (!skipped || s_.step.veto_advances_schedule) ++s_.counters.schedule_step;
  events_.emit(Event::StepEnd);
  phases_.add(PhaseTimes::kOptimizer);
  return skipped;
}

}  // namespace tk::detail
