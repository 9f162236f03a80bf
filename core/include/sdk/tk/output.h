#pragma once
/// What a run writes and shows: JSON lines, the progress display, atomic file writes.
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

// What this header declares is libtrainkit's interface: exported (the library hides the rest).
#pragma GCC visibility push(default)

namespace tk {

/// Builds one JSON object on one line, keys in insertion order.
class JsonLine {
 public:
  JsonLine& add(const std::string& key, double v);
  JsonLine& add(const std::string& key, int64_t v);
  JsonLine& add(const std::string& key, const std::string& v);
  std::string str() const { return "{" + body_ + "}"; }

 private:
  void key(const std::string& k);
  std::string body_;
};

/// The keys of a step's record in metrics.jsonl that the core writes: X(constant, key). A plugin's
/// metric (Context::metric) may take none of them; the core writes no other key (its record takes
/// only these constants).
#define TK_CORE_METRICS(X)                                                                             \
  X(kStep, "step") X(kEpoch, "epoch") X(kLoss, "loss") X(kLr, "lr") X(kMicroBatches, "micro_batches")   \
  X(kEffectiveBatch, "effective_batch") X(kSamples, "samples") X(kTokens, "tokens")                     \
  X(kWallTime, "wall_time") X(kPeakRssMib, "peak_rss_mib") X(kHostReads, "host_reads")                  \
  X(kOptimizerStateMib, "optimizer_state_mib") X(kSkipped, "skipped") X(kMicroBatch, "micro_batch")     \
  X(kStepPeakMib, "step_peak_mib") X(kMemoryBudgetMib, "memory_budget_mib") X(kBackoff, "backoff")      \
  X(kValidationLoss, "validation_loss") X(kValidationAccuracy, "validation_accuracy")                   \
  X(kValidationPerplexity, "validation_perplexity") X(kDataMs, "data_ms") X(kForwardMs, "forward_ms")   \
  X(kBackwardMs, "backward_ms") X(kBoundaryMs, "boundary_ms") X(kOptimizerMs, "optimizer_ms")           \
  X(kValidationMs, "validation_ms") X(kExamplesPerS, "examples_per_s") X(kTokensPerS, "tokens_per_s")   \
  X(kModelGflop, "model_gflop") X(kGflops, "gflops") X(kMfu, "mfu")

/// A key of the core's in a step's record (tk::metric::kLoss, ...).
class MetricKey {
 public:
  constexpr explicit MetricKey(const char* key) noexcept : key_(key) {}
  constexpr const char* key() const noexcept { return key_; }

 private:
  const char* key_;
};

namespace metric {
#define TK_METRIC_CONSTANT(constant, key) inline constexpr MetricKey constant{key};
TK_CORE_METRICS(TK_METRIC_CONSTANT)
#undef TK_METRIC_CONSTANT
#define TK_METRIC_ENTRY(constant, key) constant,
/// Every key the core writes, in the order of TK_CORE_METRICS.
inline constexpr MetricKey kCoreKeys[] = {TK_CORE_METRICS(TK_METRIC_ENTRY)};
#undef TK_METRIC_ENTRY
}  // namespace metric

/// JSON string literal for `s`, quotes included.
std::string json_quote(const std::string& s);

/// Writes `data` to `file` through a temporary file, fsync and a rename, so that a crash or a kill
/// leaves the old file or the new one; throws naming the file and the reason (a full disk too).
void write_atomic(const std::filesystem::path& file, const std::string& data);

enum class ProgressMode { Auto, Bar, Plain, None };

/// Step progress: a live line on a terminal, periodic plain lines otherwise.
class Progress {
 public:
  Progress(ProgressMode mode, int64_t total_steps, int64_t every);
  /// Reports the state after optimizer step `step` (1-based).
  void update(int64_t step, int64_t epoch, double loss, double lr, double samples_per_s,
              double elapsed_s);
  /// The same, with the step's model FLOPs utilization (shown when finite).
  void update(int64_t step, int64_t epoch, double loss, double lr, double samples_per_s, double elapsed_s,
              double mfu);
  /// The run goes on from optimizer step `step` (a resume): the time left is reckoned from the
  /// steps after it, not from the whole run's.
  void starting_at(int64_t step) noexcept { first_ = step; }
  /// A line of its own (validation results), keeping the live line intact.
  void note(const std::string& line);
  /// Ends the live line.
  void finish();

 private:
  bool live_ = false;
  bool quiet_ = false;
  bool open_ = false;
  int64_t total_, every_;
  int64_t first_ = 0;  // the step this part of the run started after
};

/// "1m05s", "12.3s".
std::string format_duration(double seconds);

}  // namespace tk

#pragma GCC visibility pop
