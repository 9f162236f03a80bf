// How many examples a step takes and in how many pieces: the window size inferred from an
// effective batch, the micro-batch picked by memory, the windows of the run (fixed or ramping),
// and the micro-batch halved after an out-of-memory error.
#include <c10/core/CPUAllocator.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>
#include <unordered_map>

#include "run.h"
#include "tk/compat.h"

namespace tk::detail {
namespace {

/// Counts every byte the CPU allocator hands out while it is installed: current and peak. Memory
/// allocated before (the parameters, say) is not counted; the caller adds it. One instance for
/// the process, never freed: a tensor made under it may outlive the measurement and still come
/// back to it. Its DataPtrs keep context == data, as Allocator::raw_allocate requires.
class CountingAllocator final : public compat::AllocatorBase {
 public:
  static CountingAllocator& instance() {
    static auto* a = new CountingAllocator;
    return *a;
  }
  c10::DataPtr allocate_bytes(size_t n) const override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    const c10::Device device = inner.device();
    c10::DeleterFnPtr free_fn = inner.get_deleter();
    void* ctx = inner.release_context();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      held_[data] = {ctx, free_fn, n};
      current_ += static_cast<int64_t>(n);
      peak_ = std::max(peak_, current_);
    }
    return {data, data, &release, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  /// Installs it in front of `base`, counting from now.
  void start(c10::Allocator* base) {
    std::lock_guard<std::mutex> lock(mutex_);
    base_ = base;
    start_ = peak_ = current_;
  }
  /// Bytes at the peak since the last call (or start()), beyond what was held at start(); a new
  /// stretch starts.
  int64_t take_peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t p = peak_ - start_;
    peak_ = current_;
    return p;
  }

 private:
  struct Held {
    void* ctx;
    c10::DeleterFnPtr free_fn;
    size_t n;
  };
  CountingAllocator() = default;
  static void release(void* data) {
    auto& self = instance();
    Held h{};
    {
      std::lock_guard<std::mutex> lock(self.mutex_);
      auto it = self.held_.find(data);
      if (it == self.held_.end()) {  // raw-allocated before it was installed: the base's to free
        h.free_fn = self.base_ ? self.base_->raw_deleter() : nullptr;
        h.ctx = data;
      } else {
        h = it->second;
        self.held_.erase(it);
        self.current_ -= static_cast<int64_t>(h.n);
      }
    }
    if (h.free_fn) h.free_fn(h.ctx);
  }

  c10::Allocator* base_ = nullptr;
  mutable std::mutex mutex_;
  mutable std::unordered_map<void*, Held> held_;
  mutable int64_t current_ = 0, peak_ = 0;
  int64_t start_ = 0;
};

double bytes_of(const std::vector<at::Tensor>& ts) {
  double total = 0;
  for (const auto& t : ts) total += static_cast<double>(t.nbytes());
  return total;
}

/// Peak bytes of a training step at micro-batch `m` in its steady state: the model's parameters
/// and buffers, the batch, activations, gradients and the optimizer's state. Two steps are taken
/// and the second is measured (the optimizer's state and the gradients kept by zero_grad exist by
/// then); with more than one micro-batch per step, two go through forward and backward in each
/// (the second adds its gradients into the first's, through a temporary per parameter).
double measure_step(Run& r, int64_t m, int64_t k) {
  TrialGuard guard(r);
  MemoryMeter meter(r);
  const at::Tensor order = r.shard_order(0);  // the first micro-batches of training, and their index
  const int64_t n = order.size(0);
  for (int step = 0; step < 2; ++step) {
    meter.take_peak();  // the second step's stretch starts here
    for (int64_t i = 0; i < std::min<int64_t>(k, 2); ++i) {
      Batch b = r.fetch(*r.data.train, order.slice(0, std::min(i * m, n - 1), std::min((i + 1) * m, n)));
      at::Tensor loss = (*r.loss)(r.model->forward(b.input), b);
      loss.backward();
    }
    r.optimizer->step();
    r.optimizer->zero_grad();
  }
  return meter.take_peak();
}

std::vector<int64_t> divisors_of(int64_t n) {
  std::vector<int64_t> small, large;
  for (int64_t d = 1; d * d <= n; ++d)
    if (n % d == 0) {
      small.push_back(d);
      if (d * d != n) large.push_back(n / d);
    }
  small.insert(small.end(), large.rbegin(), large.rend());
  return small;
}

/// The plugin that set the window, if its options hold `key`: errors about the effective batch
/// point at its recipe line.
[[noreturn]] void refuse(const Run& r, const std::string& key, const std::string& what) {
  for (const auto& s : r.slots)
    if (s.plugin && s.name == r.plan.window_owner && s.plugin->options().has(key)) s.plugin->options().fail(key, what);
  throw Error(what);
}

}  // namespace

MemoryMeter::MemoryMeter(const Run& r) : device_(r.device) {
  resident_ = bytes_of(r.model->parameters()) + bytes_of(r.model->buffers());
  if (device_.is_cuda()) {
    compat::cuda_reset_peak(device_);
    return;
  }
  previous_ = c10::GetCPUAllocator();
  if (previous_ == &CountingAllocator::instance()) throw Error("memory meters do not nest");
  CountingAllocator::instance().start(previous_);
  c10::SetCPUAllocator(&CountingAllocator::instance(), kPriority);
}

MemoryMeter::~MemoryMeter() {
  if (previous_) c10::SetCPUAllocator(previous_, kPriority);
}

double MemoryMeter::take_peak() {
  if (device_.is_cuda()) {
    const double p = compat::cuda_peak_bytes(device_);
    compat::cuda_reset_peak(device_);
    return p;
  }
  return resident_ + static_cast<double>(CountingAllocator::instance().take_peak());
}

RngStates save_rng() {
  RngStates out;
  for (auto& [name, gen] : generators()) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    out.emplace_back(gen, gen.get_state());
  }
  return out;
}

void restore_rng(const RngStates& states) {
  for (auto [gen, state] : states) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  }
}

TrialGuard::TrialGuard(Run& r) : r_(r), rng_(save_rng()) {
  torch::NoGradGuard no_grad;
  for (const auto& p : r.model->parameters()) params_.push_back(p.detach().clone());
  for (const auto& b : r.model->buffers()) buffers_.push_back(b.detach().clone());
}

TrialGuard::~TrialGuard() {
  torch::NoGradGuard no_grad;
  r_.model->to(r_.dtype);  // a trial may have run in another dtype
  auto params = r_.model->parameters();
  for (size_t i = 0; i < params.size() && i < params_.size(); ++i) {
    params[i].copy_(params_[i]);
    params[i].mutable_grad() = at::Tensor();
  }
  auto buffers = r_.model->buffers();
  for (size_t i = 0; i < buffers.size() && i < buffers_.size(); ++i) buffers[i].copy_(buffers_[i]);
  restore_rng(rng_);
  try {
    make_optimizer(r_);
  } catch (...) {  // it was made from these parameters before: cannot fail now
  }
}

void settle_window(Run& r) {
  RunPlan& p = r.plan;
  const int64_t goal = p.effective_batch_goal, world = p.world_size;
  const bool m_given = r.data_opts.is_set("micro_batch") && !p.micro_batch_auto;
  if (goal < 0 || goal > kMaxCount)
    refuse(r, "effective_batch", "an effective batch of " + std::to_string(goal) + " is beyond any machine (at most " +
                                     std::to_string(kMaxCount) + " examples per optimizer step)");
  if (goal == 0) {
    if (p.micro_batch_auto)
      r.data_opts.fail("micro_batch", "\"auto\" picks the micro-batch for an effective batch: set effective_batch "
                                      "(and memory_budget) in a grad_accum plugin entry");
    if (p.accumulation < 1) throw Error("plugin '" + p.window_owner + "' left the window size open without an effective batch");
    return;
  }
  const std::string three = "effective_batch = " + std::to_string(goal) + ", micro_batch = " +
                            (p.micro_batch_auto ? std::string("\"auto\"")
                                                : std::to_string(p.micro_batch) + (m_given ? "" : " (the default)")) +
                            ", steps = " + (p.accumulation > 0 ? std::to_string(p.accumulation) : std::string("(not set)")) +
                            ", world size " + std::to_string(world);
  if (goal % world != 0)
    refuse(r, "effective_batch", three + ": the effective batch does not divide evenly over the " +
                                     std::to_string(world) + " ranks");
  const int64_t per_rank = goal / world;
  if (p.micro_batch_auto) {
    if (p.accumulation > 0)
      refuse(r, "steps", three + ": with micro_batch = \"auto\" the steps follow from the micro-batch picked; remove steps");
    p.micro_batch = 0;  // picked after setup, when the optimizer exists (pick_micro_batch)
    return;
  }
  const int64_t m = p.micro_batch;
  if (p.accumulation > 0 && m_given) {
    if (m * p.accumulation != per_rank)
      refuse(r, "effective_batch", three + ": " + std::to_string(m) + " x " + std::to_string(p.accumulation) + " x " +
                                       std::to_string(world) + " = " + std::to_string(m * p.accumulation * world) +
                                       ", not " + std::to_string(goal) + "; give any two of the three");
  } else if (p.accumulation > 0) {
    if (per_rank % p.accumulation != 0)
      refuse(r, "effective_batch", three + ": " + std::to_string(per_rank) + " examples per rank do not split into " +
                                       std::to_string(p.accumulation) + " equal micro-batches");
    p.micro_batch = per_rank / p.accumulation;
  } else {
    if (per_rank % m != 0)
      refuse(r, "effective_batch", three + ": " + std::to_string(per_rank) + " examples per rank are not a whole number of "
                                       "micro-batches of " + std::to_string(m) + "; pick an effective batch that is a "
                                       "multiple of " + std::to_string(m * world) + ", or another micro_batch");
    p.accumulation = per_rank / m;
  }
}

void pick_micro_batch(Run& r) {
  RunPlan& p = r.plan;
  if (!p.micro_batch_auto || p.micro_batch > 0) return;
  double budget = p.memory_budget;
  std::string source = "memory_budget";
  if (budget <= 0) {
    if (!r.device.is_cuda())
      refuse(r, "memory_budget", "micro_batch = \"auto\" on the CPU needs a memory budget: set memory_budget "
                                 "(e.g. \"2GiB\") in the grad_accum entry");
    budget = p.memory_budget = compat::cuda_free_bytes(r.device);
    source = "free memory of " + r.device.str();
  }
  const int64_t per_rank = p.effective_batch_goal / p.world_size;
  std::vector<int64_t> candidates;
  for (int64_t d : divisors_of(per_rank))
    if (d == 1 || d <= r.shard_size()) candidates.push_back(d);
  constexpr double kMargin = 0.10;  // the picked step's measured peak is at most 90% of the budget
  auto fits = [&](double peak) { return peak * (1 + kMargin) <= budget; };
  std::map<int64_t, double> peaks;
  auto measure = [&](int64_t m) { return peaks[m] = measure_step(r, m, per_rank / m); };
  // The peak grows about linearly with the micro-batch: from the last two measured, predict.
  auto predict = [&](int64_t m) {
    auto hi = peaks.rbegin();
    if (peaks.size() < 2) return hi->second;  // one point: no slope yet; the measurement decides
    auto lo = std::next(hi);
    const double slope = (hi->second - lo->second) / static_cast<double>(hi->first - lo->first);
    return hi->second + slope * static_cast<double>(m - hi->first);
  };
  int64_t chosen = candidates.front();
  if (!fits(measure(chosen)))
    refuse(r, "memory_budget", "a training step of one micro-batch of " + std::to_string(chosen) + " takes " +
                                   format_bytes(peaks[chosen]) + "; with a " + std::to_string(int(kMargin * 100)) +
                                   "% margin that is more than the budget of " + format_bytes(budget) + " (" + source + ")");
  // Up in doublings while the prediction and then the measurement fit; then the largest divisor
  // in between whose measurement fits.
  int64_t over = 0;
  for (int64_t d : candidates) {
    if (d < 2 * chosen && d != candidates.back()) continue;
    if (!fits(predict(d)) || !fits(measure(d))) {
      over = d;
      break;
    }
    chosen = d;
  }
  if (over > 0)
    for (auto it = std::find(candidates.rbegin(), candidates.rend(), over); it != candidates.rend() && *it > chosen; ++it)
      if (*it != over && fits(predict(*it)) && fits(measure(*it))) {
        chosen = *it;
        break;
      }
  p.micro_batch = chosen;
  p.accumulation = per_rank / chosen;
  p.measured_peaks.assign(peaks.begin(), peaks.end());
  std::string list;
  for (const auto& [m, b] : peaks) list += (list.empty() ? "" : ", ") + std::to_string(m) + ": " + format_bytes(b);
  spdlog::info("micro-batch {} picked by memory: a step's peak {} of a {} budget ({}; {}% margin); measured {}", chosen,
               format_bytes(peaks[chosen]), format_bytes(budget), source, int(kMargin * 100), list);
}

void shape_windows(Run& r) {
  const int64_t n = r.shard_size(), m = r.plan.micro_batch;
  r.batches_per_epoch = r.data_opts.get_bool("drop_last") ? n / m : (n + m - 1) / m;
  if (r.batches_per_epoch < 1)
    r.data_opts.fail("micro_batch", "is larger than the " + std::string(r.plan.world_size > 1 ? "rank's share of the " : "") +
                                        "data set (" + std::to_string(n) + " examples) and drop_last is on: an epoch "
                                        "has no micro-batch");
  int64_t micro_batches = 0;
  if (!r.bound.by_steps() && (__builtin_mul_overflow(r.bound.count, r.batches_per_epoch, &micro_batches) ||
                              micro_batches > kMaxCount))
    r.run.fail("epochs", std::to_string(r.bound.count) + " epochs of " + std::to_string(r.batches_per_epoch) +
                             " micro-batches are beyond what any machine can train (at most " +
                             std::to_string(kMaxCount) + " micro-batches)");
  r.windows = std::make_unique<WindowSchedule>(r.batches_per_epoch, r.plan.accumulation, r.plan.last_window,
                                               r.bound.by_steps() ? 0 : r.bound.count);
  if (r.plan.ramp.active()) {
    const int64_t world = r.plan.world_size;
    r.windows->set_ramp(r.plan.ramp, r.plan.effective_batch(), m * world,
                        [n, m, world](int64_t b0, int64_t b1) { return world * (std::min(b1 * m, n) - b0 * m); });
  }
  r.total_steps = r.bound.by_steps() ? r.bound.count : r.windows->steps_in(r.bound.count);
  if (r.total_steps < 1) throw Error("the run would take no optimizer step");
}

void rebatch(Run& r, int64_t m) {
  const int64_t per_rank = r.plan.micro_batch * r.plan.accumulation, steps = r.total_steps;
  r.plan.micro_batch = m;
  r.plan.accumulation = per_rank / m;
  shape_windows(r);
  if (r.total_steps != steps)  // equal for step and drop windows: ceil(ceil(n/m)/k) = ceil(n/(m k))
    throw Error("changing the micro-batch to " + std::to_string(m) + " would change the run's length from " +
                std::to_string(steps) + " to " + std::to_string(r.total_steps) + " steps");
}

int64_t backed_off_micro_batch(const Run& r) {
  const int64_t m = r.plan.micro_batch, per_rank = m * r.plan.accumulation;
  int64_t best = 0;
  for (int64_t d : divisors_of(per_rank))
    if (2 * d <= m) best = d;
  return best;
}

}  // namespace tk::detail
