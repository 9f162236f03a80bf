// A step's record in metrics.jsonl (loop.h): the core's values, rates, memory, plugins' metrics.
#include <spdlog/spdlog.h>

#include <cmath>

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

void StepRecorder::find_peak(const LoopState& s) {
  peak_found_ = true;
  if (peak_gflops_ > 0 || s.compute_dtype == at::ScalarType::Undefined) return;
  MachinePeak p;
  try {
    p = machine_peak(r_.device, s.compute_dtype);
  } catch (const std::exception& e) {  // a dtype without matrix products on this device: no mfu
    spdlog::warn("mfu: the matrix-product peak in {} could not be timed ({}); set run.peak_gflops for mfu",
                 c10::toString(s.compute_dtype), e.what());
    return;
  }
  peak_gflops_ = p.gflops;
  spdlog::info("mfu: against {:.1f} GFLOP/s, the matrix-product peak of {} ({}; {}); run.peak_gflops sets another",
               p.gflops, p.key, p.measured ? "measured now" : "measured before", p.file.empty() ? "not kept" : "kept in " + p.file.string());
}

void StepRecorder::add_rates(StepRecord& line, const LoopState& s) {
  last_mfu_ = std::nan("");
  // From the window's first micro-batch to its step's end: what the step itself took (not the
  // validation, checkpoint or record around it). A window redone after a back-off counts anew.
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - window_t0_).count();
  if (secs <= 0.0) return;
  line.add(metric::kExamplesPerS, static_cast<double>(s.totals.samples) / secs);
  if (s.totals.tokens != s.totals.samples) line.add(metric::kTokensPerS, static_cast<double>(s.totals.tokens) / secs);
  if (!flops_ || window_flops_ <= 0) return;
  line.add(metric::kModelGflop, window_flops_ / 1e9).add(metric::kGflops, window_flops_ / 1e9 / secs);
  if (!peak_found_) find_peak(s);
  if (peak_gflops_ > 0) {
    last_mfu_ = window_flops_ / 1e9 / secs / peak_gflops_;
    line.add(metric::kMfu, last_mfu_);
  }
}

StepRecord StepRecorder::make(const LoopState& s, const WorldSeen& seen, int64_t epoch, bool skipped, double wall_time) {
  StepRecord line;
  line.add(metric::kStep, s.counters.step)
      .add(metric::kEpoch, epoch)
      .add(metric::kLoss, s.window_loss)
      .add(metric::kLr, s.lr)
      .add(metric::kMicroBatches, s.totals.micro_batches)
      .add(metric::kEffectiveBatch, s.totals.samples)
      .add(metric::kSamples, seen.samples)
      .add(metric::kTokens, seen.tokens)
      .add(metric::kWallTime, wall_time)
      .add(metric::kPeakRssMib, peak_rss_mib())
      .add(metric::kHostReads, s.host_reads);
  if (const int64_t held = optimizer_state_bytes(*r_.optimizer); held >= 0)
    line.add(metric::kOptimizerStateMib, static_cast<double>(held) / (1024.0 * 1024.0));
  add_rates(line, s);
  if (skipped) line.add(metric::kSkipped, s.step.vetoed_by + ": " + s.step.veto_reason);
  for (const auto& [k, v] : s.step.metrics) line.add_plugin_metric(k, v);
  constexpr double kMiB = 1024.0 * 1024.0;
  const PlanValues& p = r_.plan;
  if (p.micro_batch_auto) line.add(metric::kMicroBatch, p.micro_batch);
  if (meter_) line.add(metric::kStepPeakMib, meter_->take_peak() / kMiB);
  if (p.micro_batch_auto && p.memory_budget > 0) line.add(metric::kMemoryBudgetMib, p.memory_budget / kMiB);
  if (!backoff_note_.empty()) {
    line.add(metric::kBackoff, backoff_note_);
    backoff_note_.clear();
  }
  return line;
}

}  // namespace tk::detail
