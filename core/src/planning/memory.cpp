// Memory: what a stretch of a run allocates (the CPU allocator counted, CUDA's caching allocator
// read), trial steps that leave no trace, and the micro-batch picked for a memory budget.
#include <c10/core/CPUAllocator.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <map>
#include <mutex>
#include <unordered_map>

#include "assemble/assemble.h"
#include "engine/engine.h"
#include "planning/planning.h"
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
  /// Whether `data` was handed out by this allocator (and is still held).
  bool holds(const void* data) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return held_.count(const_cast<void*>(data)) > 0;
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

/// What a trial step measured.
struct Measured {
  double peak = 0;      ///< this rank's
  TrainingState state;  ///< after the second step
};

/// Peak bytes of a training step at micro-batch `m` in its steady state: the model's parameters
/// and buffers, the batch, activations, gradients and the optimizer's state. The steps are the
/// run's own (the engine, with every plugin's events: autocast, recomputation, a sharded
/// optimizer, data parallel's buckets), two of them, and the second is measured (the optimizer's
/// state exists by then, and the gradients a plugin keeps between steps); with more than one micro-batch per
/// step, two go through forward and backward in each (the second adds its gradients into the
/// first's, through a temporary per parameter).
Measured measure_step(Run& r, int64_t m, int64_t k) {
  TrialGuard guard(r);
  const TrialShape shape(r, m, k, 2);  // the plugins see the trial's micro-batch, window and two steps
  Measured out;
  {
    MemoryMeter meter(r);
    TrialRun trial(r);
    const at::Tensor order = r.shard_order(0);  // the first micro-batches of training, and their index
    const int64_t n = order.size(0), micro_batches = std::min<int64_t>(k, 2);
    for (int step = 0; step < 2; ++step) {
      meter.take_peak();  // the second step's stretch starts here
      trial.open_window(micro_batches);
      for (int64_t i = 0; i < micro_batches; ++i)
        trial.micro_batch(r.fetch(*r.data.train, order.slice(0, std::min(i * m, n - 1), std::min((i + 1) * m, n))));
      trial.step();
    }
    out.peak = meter.take_peak();
    out.state = measure_training_state(r);
    trial.finish();
  }
  guard.restore();
  return out;
}

}  // namespace

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

MemoryMeter::MemoryMeter(const Run& r) : device_(r.device) {
  // What the step holds that was made before the meter: the parameters, buffers, the gradients
  // kept between steps (training zeroes them before its first step) and the optimizer's state (a
  // resume loads it first).
  model_ = r.model;
  std::unordered_set<const void*> seen;  // a parameter tied to another shares its memory (and gradient)
  for (const auto& p : r.model->parameters()) {
    if (p.has_storage() && p.storage().nbytes() > 0) {
      params_at_start_.insert(p.storage().data());  // followed on the CPU: see take_peak
      if (seen.insert(p.storage().data()).second) resident_ += static_cast<double>(p.storage().nbytes());
    }
    if (p.grad().defined() && seen.insert(p.grad().data_ptr()).second) resident_ += static_cast<double>(p.grad().nbytes());
  }
  resident_ += bytes_of(r.model->buffers());
  if (r.optimizer)
    if (const int64_t state = optimizer_state_bytes(*r.optimizer); state > 0) resident_ += static_cast<double>(state);
  if (device_.is_cuda()) {
    compat::cuda_reset_peak(device_);
    return;
  }
  previous_ = c10::GetCPUAllocator();
  if (previous_ == &CountingAllocator::instance()) throw Error("memory meters do not nest");
  CountingAllocator::instance().start(previous_);
  held_parameter_bytes();
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
  auto& counting = CountingAllocator::instance();
  const double peak = resident_ + static_cast<double>(counting.take_peak());
  // The parameters' memory made before any meter and gone now (that of a parameter another rank
  // holds, which sharded parameters free) no longer counts in the next stretch; what this
  // allocator handed out is followed by it as it is freed.
  const double before = params_resident_;
  resident_ += held_parameter_bytes() - before;
  return peak;
}

double MemoryMeter::held_parameter_bytes() {
  double held = 0;
  std::unordered_set<const void*> seen;  // a parameter tied to another shares its memory
  for (const auto& p : model_->parameters()) {
    if (!p.has_storage()) continue;
    const c10::DataPtr& ptr = p.storage().data_ptr();
    // Memory of its own (not a part of a buffer another tensor owns), made before any meter.
    const bool own = ptr.get_context() == ptr.get() && !CountingAllocator::instance().holds(ptr.get());
    if (own && params_at_start_.count(ptr.get()) && seen.insert(ptr.get()).second)
      held += static_cast<double>(p.storage().nbytes());
  }
  return params_resident_ = held;
}

TrialGuard::TrialGuard(Run& r) : r_(r), rng_(save_rng()) {
  torch::NoGradGuard no_grad;
  for (const auto& p : r.model->parameters()) params_.push_back(p.detach().clone());
  for (const auto& b : r.model->buffers()) buffers_.push_back(b.detach().clone());
  for (size_t i : r.order) {
    const Slot& s = r.slots[i];
    declined_.emplace_back(s.plugin.get(), PluginAccess::state(*s.plugin).declined);
    r.call_plugin(s, "state", [&] { states_.emplace_back(&s, s.plugin->state()); });
  }
}

TrialGuard::~TrialGuard() {
  if (restored_) return;
  try {
    restore();
  } catch (...) {  // another error is on its way: it is the one to report
  }
}

void TrialGuard::restore() {
  restored_ = true;
  restore_tensors();
  for (auto& [p, bits] : declined_) PluginAccess::state(*p).declined = bits;
  for (auto& [slot, state] : states_)
    if (!state.empty()) r_.call_plugin(*slot, "load_state", [&, &st = state] { slot->plugin->load_state(st); });
}

void TrialGuard::restore_tensors() {
  torch::NoGradGuard no_grad;
  // The trial's optimizer goes first: a sharded one puts back what it set aside under the
  // parameters (an owner's own values under rounded ones a failed trial left there).
  r_.optimizer.reset();
  auto params = r_.model->parameters();
  std::vector<char> given(params.size(), 0);
  for (size_t i = 0; i < params.size() && i < params_.size(); ++i)
    // Memory a plugin freed (sharded) and a failed trial left so: the saved copy is its memory now,
    // before a conversion reads it.
    if (params[i].has_storage() && params[i].storage().nbytes() < params[i].nbytes()) {
      params[i].set_data(params_[i]);
      given[i] = 1;
    }
  r_.model->to(r_.dtype);  // a trial may have run in another dtype
  params = r_.model->parameters();
  for (size_t i = 0; i < params.size() && i < params_.size(); ++i) {
    if (!given[i]) params[i].copy_(params_[i]);
    params[i].mutable_grad() = at::Tensor();
  }
  auto buffers = r_.model->buffers();
  for (size_t i = 0; i < buffers.size() && i < buffers_.size(); ++i) buffers[i].copy_(buffers_[i]);
  restore_rng(rng_);
  make_optimizer(r_);  // it was made from these parameters before
}

namespace {

/// The micro-batches a step's peak was measured at, with their peaks, and the search over them.
struct BatchSearch {
  Run& r;
  int64_t per_rank;
  std::vector<int64_t> candidates;
  std::function<bool(double)> fits;
  Measured last;  ///< this rank's last trial

  /// The peak of a step at micro-batch `m`: the largest any rank measured, so that every rank
  /// takes the same decisions from it (and the same trials after it).
  double measure(std::map<int64_t, double>& peaks, int64_t m) {
    last = measure_step(r, m, per_rank / m);
    return peaks[m] = r.world->max(last.peak);
  }

  /// The largest candidate whose step fits, with the lever (if any) where it is now; 0 when not
  /// even the smallest does. From `known` (a candidate known to fit, not measured again; 0: the
  /// smallest, measured) up in doublings while the prediction and then the measurement fit; then
  /// the largest divisor in between whose measurement fits.
  int64_t largest_fitting(std::map<int64_t, double>& peaks, int64_t known = 0) {
    // The peak grows about linearly with the micro-batch: from the last two measured, predict.
    auto predict = [&](int64_t m) {
      if (peaks.size() < 2) return 0.0;  // no slope yet: the measurement decides
      auto hi = peaks.rbegin();
      auto lo = std::next(hi);
      const double slope = (hi->second - lo->second) / static_cast<double>(hi->first - lo->first);
      return hi->second + slope * static_cast<double>(m - hi->first);
    };
    int64_t chosen = known > 0 ? known : candidates.front();
    if (known == 0 && !fits(measure(peaks, chosen))) return 0;
    int64_t over = 0;
    for (int64_t d : candidates) {
      if (d < 2 * chosen && d != candidates.back()) continue;
      if (!fits(predict(d)) || !fits(measure(peaks, d))) {
        over = d;
        break;
      }
      chosen = d;
    }
    if (over > 0)
      for (auto it = std::find(candidates.rbegin(), candidates.rend(), over); it != candidates.rend() && *it > chosen; ++it)
        if (*it != over && fits(predict(*it)) && fits(measure(peaks, *it))) {
          chosen = *it;
          break;
        }
    return chosen;
  }
};

std::string list_peaks(const std::map<int64_t, double>& peaks) {
  std::string list;
  for (const auto& [m, b] : peaks) list += (list.empty() ? "" : ", ") + std::to_string(m) + ": " + format_bytes(b);
  return list;
}

/// The bytes a step of the picked micro-batch may take, and what says so: the recipe's
/// memory_budget (questioned where it is more than this machine has), else on a GPU its free memory.
std::pair<double, std::string> step_budget(Run& r) {
  PlanValues& p = r.plan;
  if (p.memory_budget <= 0) {
    if (!r.device.is_cuda())
      refuse_window(r, "memory_budget", "micro_batch = \"auto\" on the CPU needs a memory budget: set [batch] "
                                        "memory_budget (e.g. \"2GiB\")");
    // The smallest any rank has: every rank steps with the micro-batch picked.
    p.memory_budget = -r.world->max(-compat::cuda_free_bytes(r.device));
    return {p.memory_budget, "free memory of " + r.device.str()};
  }
  if (!r.device.is_cuda()) {
    // Every rank of this machine steps at the same time: a budget beyond its share picks a
    // micro-batch the machine cannot hold.
    const int here = local_world_size_from_environment();
    const double have = machine_memory_bytes();
    if (p.memory_budget * here > have)
      r.warn("memory_budget " + format_bytes(p.memory_budget) +
             (here > 1 ? " for each of " + std::to_string(here) + " ranks" : "") + " is more than this machine has (" +
             format_bytes(have) + machine_memory_note() + "): the micro-batch picked to fit it may not fit the machine");
  }
  return {p.memory_budget, "memory_budget"};
}

}  // namespace

void pick_micro_batch(Run& r) {
  PlanValues& p = r.plan;
  if (!p.micro_batch_auto || p.micro_batch > 0) return;
  const std::pair<double, std::string> given = step_budget(r);
  const double budget = given.first;
  const std::string& source = given.second;
  constexpr double kMargin = 0.10;  // the picked step's measured peak is at most 90% of the budget
  BatchSearch search{r, p.effective_batch_goal / p.world_size, {}, [&](double peak) { return peak * (1 + kMargin) <= budget; }, {}};
  for (int64_t d : divisors_of(search.per_rank))
    if (d == 1 || d <= r.shard_size()) search.candidates.push_back(d);

  // With a lever (recomputation, say): the largest micro-batch that fits at its highest level,
  // if that is more than fits without it, then the lowest level at which that one fits (found by
  // bisection). A higher level is taken never to need more memory: what fits without the lever
  // fits with it, and is not measured again.
  const bool lever = !r.memory_lever.first.empty();
  MemoryLever& l = r.memory_lever.second;
  std::map<int64_t, std::map<int64_t, double>> peaks;  // level -> micro-batch -> peak
  int64_t level = 0;
  if (lever) l.set(0);
  int64_t chosen = search.largest_fitting(peaks[0]);
  if (lever && chosen != search.candidates.back()) {
    l.set(l.levels);
    const int64_t best = search.largest_fitting(peaks[l.levels], chosen);
    if (best > chosen) {
      int64_t lo = 0, hi = l.levels;  // best does not fit at lo (or was not tried there), fits at hi
      while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        l.set(mid);
        (search.fits(search.measure(peaks[mid], best)) ? hi : lo) = mid;
      }
      chosen = best;
      level = hi;
    }
  }
  if (chosen == 0) {
    const int64_t m = search.candidates.front();
    const int64_t at = lever ? l.levels : 0;
    // The last trial was this one: its training state.
    const std::string advice = sharding_advice(search.last.state, peaks[at][m], budget / (1 + kMargin), p.world_size,
                                                p.effective_batch_goal);
    refuse_window(r, "memory_budget", "a training step of one micro-batch of " + std::to_string(m) +
                                          (lever ? " with the most " + l.what + " plugin '" + r.memory_lever.first +
                                                       "' offers (" + std::to_string(at) + ")"
                                                 : std::string()) +
                                          " takes " + format_bytes(peaks[at][m]) + "; with a " +
                                          std::to_string(int(kMargin * 100)) + "% margin that is more than the budget of " +
                                          format_bytes(budget) + " (" + source + ")" + advice);
  }
  if (lever) {
    l.set(level);
    p.memory_level = level;
    p.memory_lever_what = l.what;
    p.memory_lever_owner = r.memory_lever.first;
  }
  set_picked_micro_batch(r, chosen);
  p.measured_peaks.assign(peaks[level].begin(), peaks[level].end());
  std::string with, others;
  if (lever) {
    with = " with " + std::to_string(level) + " of " + std::to_string(l.levels) + " " + l.what + " (plugin '" +
           r.memory_lever.first + "')";
    for (const auto& [lv, at] : peaks)
      if (lv != level)
        others += "; with " + std::to_string(lv) + " of " + std::to_string(l.levels) + " " + l.what + ": " + list_peaks(at);
  }
  spdlog::info("micro-batch {} picked by memory{}: a step's peak {} of a {} budget ({}; {}% margin); measured {}{}", chosen,
               with, format_bytes(peaks[level][chosen]), format_bytes(budget), source, int(kMargin * 100),
               list_peaks(peaks[level]), others);
}

}  // namespace tk::detail
