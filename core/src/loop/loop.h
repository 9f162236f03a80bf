#pragma once
// The loop layer: training an assembled, planned run. The loop of windows and steps, and the
// parts it is built from: the next micro-batch prepared while one trains. Not installed.
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

#include "persist/persist.h"
#include "run/run.h"
#include "tk/data.h"
#include "tk/trainer.h"

namespace tk::detail {

/// Trains an assembled run.
FitResult train(Run& run, const Recipe& recipe, const TrainerOptions& opts, std::vector<TraceEntry>& trace);

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
