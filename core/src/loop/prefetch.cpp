// Micro-batches prepared ahead of the loop (prefetch.h).
#include "loop/loop.h"

#include <spdlog/spdlog.h>

#include "assemble/assemble.h"
#include "planning/planning.h"
#include "tk/version.h"

#if TK_WITH_CUDA
#include <c10/core/Event.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace tk::detail {

namespace {
constexpr int kMeasured = 8;              // "auto" on the CPU decides after this many micro-batches
constexpr double kWorthwhileShare = 0.05;  // of the time between two micro-batches
}  // namespace

struct Prefetcher::Prepared {
  Batch batch;
#if TK_WITH_CUDA
  at::Tensor host_input, host_target;  // the pinned sources of the copies in flight
  std::optional<c10::Event> copied;
#endif
};

Prefetcher::Prefetcher(const Run& run, const Dataset& ds) : run_(run), ds_(ds) {
  const std::string mode = run.run.get_string("prefetch");
  cuda_ = run.device.is_cuda();
#if !TK_WITH_CUDA
  cuda_ = false;  // a CPU build trains on the CPU only
#endif
#if TK_WITH_CUDA
  if (cuda_) {
    // One side stream for the run's copies (the caching allocator keeps memory per stream), on
    // the run's device as the main thread sees it.
    const c10::DeviceIndex index = run.device.has_index() ? run.device.index() : c10::cuda::current_device();
    device_ = c10::Device(c10::kCUDA, index);
    side_ = c10::cuda::getStreamFromPool(false, index);
  }
#endif
  if (mode == "on") {
    active_ = true;
    reason_ = "run.prefetch = \"on\"";
  } else if (mode == "auto" && cuda_) {
    active_ = true;
    reason_ = "a CUDA device: pinned memory, copies on a side stream";
  } else if (mode == "auto") {
    automatic_ = true;
  }
}

Prefetcher::~Prefetcher() {
  drain();
  if (!worker_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

void Prefetcher::work() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    cv_.wait(lock, [this] { return stop_ || (pending_ && !result_ && !error_); });
    if (stop_) return;
    const at::Tensor indices = pending_indices_;
    lock.unlock();
    std::shared_ptr<Prepared> made;
    std::exception_ptr error;
    try {
      made = std::make_shared<Prepared>(prepare(indices));
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    result_ = std::move(made);
    error_ = error;
    cv_.notify_all();
  }
}

std::shared_ptr<Prefetcher::Prepared> Prefetcher::wait_result() {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [this] { return result_ || error_; });
  pending_ = false;
  pending_indices_ = at::Tensor();
  std::shared_ptr<Prepared> made = std::move(result_);
  result_.reset();
  std::exception_ptr error = error_;
  error_ = nullptr;
  lock.unlock();
  if (error) std::rethrow_exception(error);  // the data set's error, at the micro-batch that wants it
  return made;
}

bool Prefetcher::holds(const Key& key) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pending_ && pending_key_ == key;
}

Prefetcher::Prepared Prefetcher::prepare(const at::Tensor& indices) const {
  Prepared p;
#if TK_WITH_CUDA
  if (cuda_ && active_) {
    p.batch = ds_.get(indices);
    auto pin = [](const at::Tensor& t) { return t.is_cpu() && !t.is_pinned() ? t.pin_memory() : t; };
    p.host_input = pin(p.batch.input);
    p.host_target = pin(p.batch.target);
    const c10::cuda::CUDAStream side(*side_);
    c10::cuda::CUDAStreamGuard on_side(side);
    p.batch.input = run_.place(p.host_input, device_, /*non_blocking=*/true);
    p.batch.target = run_.place(p.host_target, device_, /*non_blocking=*/true);
    p.copied.emplace(c10::DeviceType::CUDA);
    p.copied->record(side);
    return p;
  }
#endif
  p.batch = run_.fetch(ds_, indices);
  return p;
}

Batch Prefetcher::finish(Prepared p) const {
#if TK_WITH_CUDA
  if (p.copied) {
    // The training stream waits for the copy (on the device, not the host), and the caching
    // allocator learns that the stream uses memory the side stream allocated.
    const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device_.index());
    p.copied->block(current);
    if (p.batch.input.is_cuda()) p.batch.input.record_stream(current);
    if (p.batch.target.is_cuda()) p.batch.target.record_stream(current);
  }
#endif
  return std::move(p.batch);
}

Batch Prefetcher::take(const Key& key, const at::Tensor& indices) {
  if (holds(key)) return finish(std::move(*wait_result()));
  drain();  // another micro-batch is wanted (a back-off changed the size, a window policy skipped): made anew
  const auto t0 = std::chrono::steady_clock::now();
  Batch b = finish(prepare(indices));
  if (automatic_) measure(t0, std::chrono::steady_clock::now());
  return b;
}

void Prefetcher::measure(std::chrono::steady_clock::time_point start, std::chrono::steady_clock::time_point end) {
  // From the end of the first fetch to the end of the last: kMeasured intervals between
  // micro-batches, each with one fetch in it.
  if (measured_++ == 0) {
    first_take_ = end;
    return;
  }
  fetch_s_ += std::chrono::duration<double>(end - start).count();
  if (measured_ <= kMeasured) return;
  automatic_ = false;
  const double span = std::chrono::duration<double>(end - first_take_).count();
  const double share = span > 0 ? fetch_s_ / span : 0.0;
  char buf[160];
  std::snprintf(buf, sizeof buf, "preparing a micro-batch took %.1f%% of the time between two", 100.0 * share);
  active_ = share >= kWorthwhileShare;
  reason_ = buf;
  spdlog::debug("prefetch: {} ({})", active_ ? "on" : "off", reason_);
}

void Prefetcher::ahead(const Key& key, at::Tensor indices) {
  if (!active_) return;
  drain();
  if (!worker_.joinable()) worker_ = std::thread([this] { work(); });
  {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_ = true;
    pending_key_ = key;
    pending_indices_ = std::move(indices);
  }
  cv_.notify_all();
}

void Prefetcher::drain() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!pending_) return;
  }
  try {
    wait_result();
  } catch (...) {  // dropped with its batch; a take() of that batch would make it again
  }
}

}  // namespace tk::detail
