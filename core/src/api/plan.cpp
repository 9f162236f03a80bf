#include "api/api.h"

#include <algorithm>
#include <map>

#include "tk/context.h"
#include "tk/error.h"

namespace tk {


namespace {

bool known_capability(const std::string& name) {
  for (const Capability& k : cap::kKnown)
    if (name == k.name()) return true;
  return false;
}

/// Edit distance, for "did you mean".
size_t distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

/// " (not a known capability; did you mean 'x'?)" or "" for a known name.
std::string unknown_note(const std::string& name, const std::map<std::string, size_t>& provided) {
  if (known_capability(name)) return "";
  std::string best;
  size_t best_d = 4;
  auto consider = [&](const std::string& c) {
    const size_t d = distance(name, c);
    if (d < best_d) best_d = d, best = c;
  };
  for (const Capability& k : cap::kKnown) consider(k.name());
  for (const auto& [c, i] : provided) consider(c);
  return " (not a known capability name" + (best.empty() ? std::string(")") : "; did you mean '" + best + "'?)");
}

}  // namespace

WindowSchedule::WindowSchedule(int64_t batches_per_epoch, int64_t k, LastWindow policy, int64_t epochs)
    : m_(batches_per_epoch), k_(k), epochs_(epochs), policy_(policy) {
  if (m_ < 1) throw Error("an epoch has no micro-batch: the data set is smaller than one micro-batch");
  if (k_ < 1) throw Error("accumulation window must be >= 1, got " + std::to_string(k_));
  if (policy_ == LastWindow::Drop && m_ < k_)
    throw Error("last_window = \"drop\" with " + std::to_string(k_) + " micro-batches per window but only " +
                std::to_string(m_) + " per epoch: no window would ever complete");
}

void WindowSchedule::set_ramp(const BatchRamp& ramp, int64_t effective, int64_t unit,
                              std::function<int64_t(int64_t, int64_t)> samples_in) {
  if (unit < 1 || effective < unit) throw Error("a batch ramp needs an effective batch of at least one micro-batch per rank");
  ramp_ = ramp;
  effective_ = effective;
  unit_ = unit;
  samples_in_ = std::move(samples_in);
}

int64_t WindowSchedule::size_at(int64_t step, int64_t samples) const {
  if (!ramp_.active()) return k_;
  const int64_t pos = ramp_.by_samples ? samples : step;
  if (pos >= ramp_.over) return k_;
  // Linear in the position, rounded down to whole micro-batches per rank, at least one.
  const long double x = static_cast<long double>(ramp_.from) +
                        static_cast<long double>(effective_ - ramp_.from) * pos / ramp_.over;
  return std::max<int64_t>(1, static_cast<int64_t>(x) / unit_);
}

std::optional<Window> WindowSchedule::start(int64_t epoch, int64_t b, int64_t step, int64_t samples) const {
  Window w;
  w.configured = w.size = size_at(step, samples);
  switch (policy_) {
    case LastWindow::Step: w.size = std::min(w.configured, m_ - b); break;
    case LastWindow::Drop:
      if (m_ - b < w.configured) return std::nullopt;
      break;
    case LastWindow::Carry:
      if (epochs_ > 0) w.size = std::min(w.configured, epochs_ * m_ - (epoch * m_ + b));
      break;
  }
  return w;
}

std::optional<Window> WindowSchedule::at(int64_t epoch, int64_t b) const {
  // Fixed windows start at multiples of k: within the epoch, or over the whole run for carry.
  const int64_t first = policy_ == LastWindow::Carry ? epoch * m_ + b : b;
  const int64_t offset = first % k_;
  auto w = start(epoch, b - offset, 0, 0);
  if (w) w->index = offset;
  return w;
}

int64_t WindowSchedule::fixed_steps_from(int64_t epoch, int64_t b, int64_t epochs) const {
  switch (policy_) {
    case LastWindow::Step: return (m_ - b + k_ - 1) / k_ + (epochs - epoch - 1) * ((m_ + k_ - 1) / k_);
    case LastWindow::Drop: return (m_ - b) / k_ + (epochs - epoch - 1) * (m_ / k_);
    case LastWindow::Carry: return (epochs * m_ - (epoch * m_ + b) + k_ - 1) / k_;
  }
  return 0;
}

int64_t WindowSchedule::steps_in(int64_t epochs) const {
  if (!ramp_.active()) return fixed_steps_from(0, 0, epochs);
  // With a ramp: window by window while it lasts, in closed form after it.
  constexpr int64_t kMaxRampSteps = 10'000'000;
  int64_t step = 0, samples = 0;
  auto ramp_done = [&] { return (ramp_.by_samples ? samples : step) >= ramp_.over; };
  auto too_long = [&] {
    if (step > kMaxRampSteps)
      throw Error("the batch ramp lasts more than " + std::to_string(kMaxRampSteps) + " optimizer steps; shorten it");
  };
  if (policy_ == LastWindow::Carry) {
    for (int64_t g = 0; g < epochs * m_; ++step, too_long()) {
      if (ramp_done()) return step + fixed_steps_from(g / m_, g % m_, epochs);
      const auto w = start(g / m_, g % m_, step, samples);
      for (int64_t left = w->size; left > 0;) {  // a carried window may span epochs
        const int64_t b = g % m_, take = std::min(left, m_ - b);
        samples += samples_in_(b, b + take);
        g += take;
        left -= take;
      }
    }
    return step;
  }
  for (int64_t e = 0; e < epochs; ++e) {
    for (int64_t b = 0; b < m_; ++step, too_long()) {
      if (ramp_done()) return step + fixed_steps_from(e, b, epochs);
      const auto w = start(e, b, step, samples);
      if (!w) break;
      samples += samples_in_(b, b + w->size);
      b += w->size;
    }
  }
  return step;
}

bool WindowSchedule::ramp_completes(int64_t total_steps) const {
  if (!ramp_.active()) return true;
  if (!ramp_.by_samples) return ramp_.over <= total_steps;
  // Examples of the windows up to the last step, until the ramp is over or the run is.
  constexpr int64_t kMaxRampSteps = 10'000'000;
  int64_t step = 0, samples = 0;
  for (int64_t e = 0; step < total_steps; ++e) {
    for (int64_t b = 0; b < m_ && step < total_steps; ++step) {
      if (samples >= ramp_.over) return true;
      if (step > kMaxRampSteps)
        throw Error("the batch ramp lasts more than " + std::to_string(kMaxRampSteps) + " optimizer steps; shorten it");
      const auto w = start(e, b, step, samples);
      if (!w) break;
      const int64_t take = std::min(w->size, m_ - b);
      samples += samples_in_(b, b + take);
      b += take;
    }
  }
  return samples >= ramp_.over;
}

std::vector<size_t> order_plugins(const std::vector<PluginDecl>& plugins, std::vector<std::string>* warnings) {
  const size_t n = plugins.size();
  std::map<std::string, size_t> provider;
  for (size_t i = 0; i < n; ++i) {
    for (const auto& cap : plugins[i].contract.provides) {
      auto [it, fresh] = provider.emplace(cap.name(), i);
      if (!fresh)
        throw Error("plugins '" + plugins[it->second].name + "' and '" + plugins[i].name +
                    "' both provide '" + cap.name() + "'; a run can have only one of them");
    }
  }
  for (size_t i = 0; i < n; ++i) {
    for (const auto& need : plugins[i].contract.requires_)
      if (!provider.count(need.name())) {
        const std::string note = unknown_note(need.name(), provider);
        const std::string what = "plugin '" + plugins[i].name + "' requires '" + need.name() +
                                 "', which no plugin in this run provides" +
                                 (note.empty() ? " (add one to [[plugins]]; tk-run --list shows those found)" : note);
        if (!plugins[i].where.file.empty()) throw RecipeError(plugins[i].where, what);
        throw Error(what);
      }
    for (const auto& c : plugins[i].contract.conflicts) {
      auto it = provider.find(c.name());
      if (it != provider.end() && it->second != i)
        throw Error("plugins '" + plugins[i].name + "' and '" + plugins[it->second].name +
                    "' cannot be combined: '" + plugins[i].name + "' conflicts with '" + c.name() + "'");
    }
  }
  // deps[i]: plugins that must run before i.
  std::vector<std::vector<size_t>> deps(n);
  for (size_t i = 0; i < n; ++i)
    for (const auto& cap : plugins[i].contract.after) {
      auto it = provider.find(cap.name());
      if (it != provider.end() && it->second != i) deps[i].push_back(it->second);
      const std::string note = it == provider.end() ? unknown_note(cap.name(), provider) : "";
      if (!note.empty() && warnings)
        warnings->push_back("plugin '" + plugins[i].name + "' orders itself after '" + cap.name() +
                            "', which no plugin of this run provides" + note + ": that ordering has no effect");
    }
  // Stable topological order: repeatedly take the first plugin (in recipe order) that is ready.
  std::vector<size_t> order;
  std::vector<bool> done(n, false);
  while (order.size() < n) {
    bool progressed = false;
    for (size_t i = 0; i < n; ++i) {
      if (done[i]) continue;
      bool ready = std::all_of(deps[i].begin(), deps[i].end(), [&](size_t d) { return done[d]; });
      if (ready) {
        done[i] = true;
        order.push_back(i);
        progressed = true;
        break;
      }
    }
    if (!progressed) {
      for (size_t i = 0; i < n; ++i)
        if (!done[i])
          for (size_t d : deps[i])
            if (!done[d])
              throw Error("plugins '" + plugins[i].name + "' and '" + plugins[d].name +
                          "' each need to run after the other; this combination cannot be ordered");
    }
  }
  return order;
}

}  // namespace tk
