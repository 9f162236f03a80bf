// A step's record in metrics.jsonl (loop.h): the core's values, rates, memory, plugins' metrics.
#include "loop/loop.h"

namespace tk::detail {

StepRecorder::StepRecorder(const Run& run)
    : r_(run), flops_(flops_of(*run.model)), peak_gflops_(run.run.get_float("peak_gflops")) {}

void StepRecorder::start() {
  // On CUDA reading the caching allocator's peak costs nothing; on the CPU only when asked.
  if (r_.device.is_cuda() || r_.run.get_bool("measure_memory")) meter_.emplace(r_);
}

void StepRecorder::stop() noexcept { meter_.reset(); }

void StepRecorder::open_window() {
  window_flops_ = 0;
  window_t0_ = std::chrono::steady_clock::now();
}

void StepRecorder::add(const Batch& batch) {
  if (flops_) window_flops_ += flops_->train_flops(batch.input.sizes());
}

void StepRecorder::restart_peak() {
  if (meter_) meter_->take_peak();
}

void StepRecorder::add_rates(JsonLine& line, const LoopState& s) const {
  // From the window's first micro-batch to its step's end: what the step itself took (not the
  // validation, checkpoint or record around it). A window redone after a back-off counts anew.
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - window_t0_).count();
  if (secs <= 0.0) return;
  line.add("examples_per_s", static_cast<double>(s.totals.samples) / secs);
  if (s.totals.tokens != s.totals.samples) line.add("tokens_per_s", static_cast<double>(s.totals.tokens) / secs);
  if (!flops_ || window_flops_ <= 0) return;
  line.add("model_gflop", window_flops_ / 1e9).add("gflops", window_flops_ / 1e9 / secs);
  if (peak_gflops_ > 0) line.add("mfu", window_flops_ / 1e9 / secs / peak_gflops_);
}

JsonLine StepRecorder::make(const LoopState& s, int64_t epoch, bool skipped, double wall_time) {
  JsonLine line;
  line.add("step", s.counters.step)
      .add("epoch", epoch)
      .add("loss", s.window_loss)
      .add("lr", s.lr)
      .add("micro_batches", s.totals.micro_batches)
      .add("effective_batch", s.totals.samples)
      .add("samples", s.counters.samples_seen)
      .add("tokens", s.counters.tokens_seen)
      .add("wall_time", wall_time)
      .add("peak_rss_mib", peak_rss_mib())
      .add("host_reads", s.host_reads);
  if (const int64_t held = optimizer_state_bytes(*r_.optimizer); held >= 0)
    line.add("optimizer_state_mib", static_cast<double>(held) / (1024.0 * 1024.0));
  add_rates(line, s);
  if (skipped) line.add("skipped", s.step.vetoed_by + ": " + s.step.veto_reason);
  for (const auto& [k, v] : s.step.metrics) line.add(k, v);
  constexpr double kMiB = 1024.0 * 1024.0;
  const PlanValues& p = r_.plan;
  if (p.micro_batch_auto) line.add("micro_batch", p.micro_batch);
  if (meter_) line.add("step_peak_mib", meter_->take_peak() / kMiB);
  if (p.micro_batch_auto && p.memory_budget > 0) line.add("memory_budget_mib", p.memory_budget / kMiB);
  if (!backoff_note_.empty()) {
    line.add("backoff", backoff_note_);
    backoff_note_.clear();
  }
  return line;
}

}  // namespace tk::detail
