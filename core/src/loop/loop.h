#pragma once
// The loop layer: training an assembled, planned run. The loop keeps the windows, the steps and
// the events; its parts, each built once and passed in, keep the rest: the step's record,
// validation, the stop decision, the checkpoint policy, the back-off after running out of memory,
// the account of a non-finite loss, and the next micro-batch prepared while one trains. Not
// installed.
#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "assemble/assemble.h"
#include "engine/engine.h"
#include "persist/persist.h"
#include "planning/planning.h"
#include "run/run.h"
#include "tk/data.h"
#include "tk/trainer.h"

namespace tk::detail {

/// Trains an assembled run.
FitResult train(Run& run, const Recipe& recipe, const TrainerOptions& opts, std::vector<TraceEntry>& trace);

// ---- record.cpp: a step's record ----------------------------------------------------------------

// ---- peak.cpp: the device's matrix-product peak, for MFU ----------------------------------------

/// This device's matrix-product rate in one dtype, for MFU when run.peak_gflops is not given.
struct MachinePeak {
  double gflops = 0;
  std::string key;             ///< device model, threads (or CUDA device), dtype, LibTorch version
  std::filesystem::path file;  ///< the cache it was read from or written to (empty: none)
  bool measured = false;       ///< timed now (not found in the cache)
};
/// The cache of measured peaks: $TK_CACHE_DIR/peak-gflops.json, else
/// $XDG_CACHE_HOME/trainkit/peak-gflops.json, else ~/.cache/trainkit/peak-gflops.json.
std::filesystem::path peak_cache_file();
/// The peak from the cache, or timed (square products, about a second) and kept there.
MachinePeak machine_peak(at::Device device, at::ScalarType dtype);

/// The record of each step in metrics.jsonl: the core's values, the plugins' metrics, the
/// throughput and FLOP rate of the window, its memory peak when measured, a back-off's note.
class StepRecorder {
 public:
  /// Reads what the run asks to measure (run.measure_memory, run.peak_gflops) and whether its
  /// model counts its FLOPs.
  explicit StepRecorder(const Run& run);
  /// Starts measuring memory (on CUDA, or when run.measure_memory asks; on the CPU that counts
  /// every allocation under a lock, so a micro-batch picked by memory counts only during its
  /// trials unless asked).
  void start();
  /// Stops measuring memory.
  void stop() noexcept;
  /// A window begins: its clock and its FLOPs start from zero.
  void open_window();
  /// A micro-batch of the window, counted into its FLOPs.
  void add(const Batch& batch);
  /// What the next record says of a back-off (the micro-batch before and after).
  void note_backoff(std::string note) { backoff_note_ = std::move(note); }
  /// The record of the step just taken (state.counters.step) in `epoch`, at `wall_time` seconds.
  /// `seen`: the world's examples and tokens so far (a step's record counts the world's).
  StepRecord make(const LoopState& state, const WorldSeen& seen, int64_t epoch, bool skipped, double wall_time);
  /// Starts a new memory stretch (validation's memory is not the next step's).
  void restart_peak();
  /// The last record's mfu (NaN when it had none).
  double last_mfu() const noexcept { return last_mfu_; }

 private:
  void add_rates(StepRecord& line, const LoopState& state);
  /// run.peak_gflops, or this machine's peak in the dtype the first forward computed in.
  void find_peak(const LoopState& state);

  const Run& r_;
  std::optional<MemoryMeter> meter_;
  const ModelWithFlops* flops_ = nullptr;  // the model, when it counts its FLOPs
  double window_flops_ = 0, peak_gflops_ = 0;
  bool peak_found_ = false;
  double last_mfu_ = 0;
  std::chrono::steady_clock::time_point window_t0_;
  std::string backoff_note_;
};

// ---- validation.cpp: a validation pass and its record ------------------------------------------

/// Validation over the run's validation split, in eval mode without grad, between its events.
class Validator {
 public:
  Validator(Run& run, LoopState& state, Events& events);
  /// Validates; adds the loss, accuracy or perplexity and the plugins' on_validation_end metrics to
  /// `line`; shows its line on `progress`; appends the loss to `losses`.
  void record(StepRecord& line, Progress& progress, std::vector<double>& losses);
  /// The step the last validation was of (-1: none yet).
  int64_t last_step() const noexcept { return last_step_; }

 private:
  /// Loss (item-weighted) and accuracy (NaN without classes) over the validation split.
  std::pair<double, double> validate();

  Run& r_;
  LoopState& s_;
  Events& events_;
  int64_t last_step_ = -1;
};

// ---- stop.cpp: stopping early at a boundary ------------------------------------------------------

/// Whether a run stops at a boundary before its end: asked to (a signal), or out of time. Every
/// rank stops at the same boundary: the world agrees on the strongest reason any rank has.
class StopRule {
 public:
  StopRule(const Run& run, const TrainerOptions& opts);
  /// The run's clock starts, at step `first_step` (0, or a resume's).
  void start(int64_t first_step);
  /// Seconds since start().
  double elapsed() const;
  /// After a step that is not the run's last: Running to go on, StoppedBySignal or StoppedByTime
  /// (on every rank the same: a collective when the world has more than one).
  FitStatus decide();
  /// A run that time stopped before its schedule's end never took its last learning rates: says
  /// so, with the run.steps that this run's pace fits into run.max_time.
  void note_unfinished_schedule(Run& run, const LoopState& state) const;

 private:
  const Run& r_;
  const TrainerOptions& opts_;
  std::chrono::steady_clock::time_point t0_;
  int64_t first_step_ = 0;
};

// ---- checkpoints.cpp: when a step is checkpointed --------------------------------------------------

/// Checkpoints at boundaries: every run.checkpoint_every steps and at the end of a run that
/// writes files.
class CheckpointPolicy {
 public:
  CheckpointPolicy(Run& run, RunOutputs& outputs);
  /// After the record of the step that `counters` count, in `epoch` at micro-batch `b`: the
  /// checkpoint when one is due (`last`: the run ends here). Returns its folder when this rank
  /// wrote one.
  std::optional<std::filesystem::path> after_step(const Counters& counters, const WorldSeen& seen, int64_t epoch,
                                                  int64_t b, bool last);

 private:
  Run& r_;
  RunOutputs& outputs_;
  int64_t every_ = 0;
};

// ---- backoff.cpp: the micro-batch halved after running out of memory -------------------------------

/// With a micro-batch picked by memory, an out-of-memory error in a window halves the micro-batch
/// (the window size doubles) and the window is redone from its first micro-batch.
class BackOff {
 public:
  explicit BackOff(Run& run);
  /// Whether the run backs off (its micro-batch was picked by memory).
  bool ready() const noexcept;
  /// A window begins at micro-batch `b` with `counters`: what a back-off puts back.
  void window_opened(int64_t b, const Counters& counters);
  /// Undoes the window (its gradients, counts and random draws in `state`), halves the
  /// micro-batch and returns the micro-batch, in the new size, where the window starts again;
  /// `note` says what changed. Refuses, naming the reason, when it cannot.
  int64_t back_off(LoopState& state, const std::string& what, std::string& note);

 private:
  Run& r_;
  int64_t batch_ = 0;  // the window's first micro-batch in the epoch
  Counters counters_;
  RngStates rng_;
};

// ---- diagnosis.cpp: why a loss is not finite --------------------------------------------------------

/// Why the window's loss is not finite, looked for only now that it is: the data of the window's
/// micro-batches (`window_indices`), the parameters, the model's output; the learning rate when
/// none of those.
std::string non_finite_loss(Run& run, const LoopState& state, const std::vector<at::Tensor>& window_indices);

// ---- prefetch.cpp: the next micro-batch ---------------------------------------------------------------

/// Prepares micro-batches ahead of the loop, on one background thread that lives as long as the
/// prefetcher (started with the first batch made ahead): the data set's get() and
/// the move to the run's device. On CUDA the batch is put in pinned memory and copied with
/// non_blocking on a side stream, which the training stream waits for (an event, no host sync).
/// The batch is the same, bit for bit, as Run::fetch would give: only when it is made changes.
///
/// run.prefetch: "on", "off", or "auto": on for CUDA; on the CPU, on when preparing a micro-batch
/// takes at least 5% of the time between two of them over the first ones (synchronous), since a
/// thread costs a hand-off per micro-batch and a core the training could use.
class Prefetcher {
 public:
  /// A micro-batch's place: the batch `b` of `epoch` in micro-batches of `m`.
  struct Key {
    int64_t epoch = -1, b = -1, m = 0;
    bool operator==(const Key& o) const { return epoch == o.epoch && b == o.b && m == o.m; }
  };

  Prefetcher(const Run& run, const Dataset& ds);
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  /// The batch at `indices` (its place `key`): the one prepared ahead when it is that one,
  /// else made now. On CUDA its tensors are ready to use on the current stream.
  Batch take(const Key& key, const at::Tensor& indices);
  /// Starts preparing the batch at `indices` for place `key`, when prefetching is on.
  void ahead(const Key& key, at::Tensor indices);
  /// Waits for the batch in flight and drops it (before anything else reads the data).
  void drain();
  /// Whether a batch for `key` is in flight or ready.
  bool holds(const Key& key) const;
  /// Whether batches are prepared ahead now, and why (for the log).
  bool active() const noexcept { return active_; }
  const std::string& reason() const noexcept { return reason_; }

 private:
  struct Prepared;
  Prepared prepare(const at::Tensor& indices) const;
  Batch finish(Prepared p) const;
  void measure(std::chrono::steady_clock::time_point start, std::chrono::steady_clock::time_point end);

  const Run& run_;
  const Dataset& ds_;
  bool active_ = false, automatic_ = false, cuda_ = false;
  c10::Device device_{c10::kCPU};   // CUDA: the run's device, with its index
  std::optional<c10::Stream> side_;  // CUDA: the stream the copies run on
  std::string reason_;
  // The worker and its one job: a batch asked for (pending_), made (result_ or error_). While the
  // worker makes it, no new one is asked for: ahead() drains first, so the worker waits only
  // between jobs.
  void work();
  std::shared_ptr<Prepared> wait_result();
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::thread worker_;
  bool stop_ = false, pending_ = false;
  Key pending_key_;
  at::Tensor pending_indices_;
  std::shared_ptr<Prepared> result_;
  std::exception_ptr error_;
  // "auto" on the CPU: the first synchronous micro-batches, timed.
  int measured_ = 0;
  double fetch_s_ = 0.0;
  std::chrono::steady_clock::time_point first_take_{};
};

}  // namespace tk::detail
