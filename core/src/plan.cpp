#include "tk/plan.h"

#include <algorithm>
#include <map>

#include "tk/context.h"
#include "tk/error.h"

namespace tk {

const char* to_string(Event e) noexcept {
  switch (e) {
    case Event::FitStart: return "fit_start";
    case Event::EpochStart: return "epoch_start";
    case Event::MicroBatch: return "micro_batch";
    case Event::Loss: return "loss";
    case Event::Backward: return "backward";
    case Event::Boundary: return "boundary";
    case Event::StepEnd: return "step_end";
    case Event::EpochEnd: return "epoch_end";
    case Event::ValidationStart: return "validation_start";
    case Event::ValidationEnd: return "validation_end";
    case Event::FitEnd: return "fit_end";
  }
  return "?";
}

const char* to_string(LastWindow p) noexcept {
  switch (p) {
    case LastWindow::Step: return "step";
    case LastWindow::Drop: return "drop";
    case LastWindow::Carry: return "carry";
  }
  return "?";
}

const char* to_string(Reduction r) noexcept { return r == Reduction::Mean ? "mean" : "sum"; }

const char* to_string(FitStatus s) noexcept {
  switch (s) {
    case FitStatus::Running: return "running";
    case FitStatus::Completed: return "completed";
    case FitStatus::StoppedByTime: return "max_time";
    case FitStatus::StoppedBySignal: return "signal";
    case FitStatus::Failed: return "failed";
  }
  return "?";
}

void dispatch(Plugin& p, Event e, Context& ctx) {
  switch (e) {
    case Event::FitStart: p.on_fit_start(ctx); return;
    case Event::EpochStart: p.on_epoch_start(ctx); return;
    case Event::MicroBatch: p.on_micro_batch(ctx); return;
    case Event::Loss: p.on_loss(ctx); return;
    case Event::Backward: p.on_backward(ctx); return;
    case Event::Boundary: p.on_boundary(ctx); return;
    case Event::StepEnd: p.on_step_end(ctx); return;
    case Event::EpochEnd: p.on_epoch_end(ctx); return;
    case Event::ValidationStart: p.on_validation_start(ctx); return;
    case Event::ValidationEnd: p.on_validation_end(ctx); return;
    case Event::FitEnd: p.on_fit_end(ctx); return;
  }
}

namespace {

bool known_capability(const std::string& name) {
  for (const char* k : cap::kKnown)
    if (name == k) return true;
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
  for (const char* k : cap::kKnown) consider(k);
  for (const auto& [c, i] : provided) consider(c);
  return " (not a known capability name" + (best.empty() ? std::string(")") : "; did you mean '" + best + "'?)");
}

}  // namespace

void RunPlan::set_window(int64_t k, LastWindow policy, const std::string& by) {
  if (!window_owner.empty() && window_owner != by)
    throw Error("plugins '" + window_owner + "' and '" + by +
                "' both set the accumulation window; keep one of them");
  if (k < 1) throw Error("plugin '" + by + "' set an accumulation window of " + std::to_string(k) + " (must be >= 1)");
  accumulation = k;
  last_window = policy;
  window_owner = by;
}

void RunPlan::set_world(int world, int rank_, const std::string& by) {
  if (!world_owner.empty() && world_owner != by)
    throw Error("plugins '" + world_owner + "' and '" + by + "' both set the world size; keep one of them");
  if (world < 1 || rank_ < 0 || rank_ >= world)
    throw Error("plugin '" + by + "' set world size " + std::to_string(world) + " and rank " + std::to_string(rank_));
  world_size = world;
  rank = rank_;
  world_owner = by;
}

WindowSchedule::WindowSchedule(int64_t batches_per_epoch, int64_t k, LastWindow policy, int64_t epochs)
    : m_(batches_per_epoch), k_(k), epochs_(epochs), policy_(policy) {
  if (m_ < 1) throw Error("an epoch has no micro-batch: the data set is smaller than one micro-batch");
  if (k_ < 1) throw Error("accumulation window must be >= 1, got " + std::to_string(k_));
  if (policy_ == LastWindow::Drop && m_ < k_)
    throw Error("last_window = \"drop\" with " + std::to_string(k_) + " micro-batches per window but only " +
                std::to_string(m_) + " per epoch: no window would ever complete");
}

std::optional<Window> WindowSchedule::at(int64_t epoch, int64_t b) const {
  Window w;
  w.configured = k_;
  switch (policy_) {
    case LastWindow::Step: {
      int64_t start = b - b % k_;
      w.index = b % k_;
      w.size = std::min(k_, m_ - start);
      return w;
    }
    case LastWindow::Drop: {
      if (b >= (m_ / k_) * k_) return std::nullopt;
      w.index = b % k_;
      w.size = k_;
      return w;
    }
    case LastWindow::Carry: {
      int64_t g = epoch * m_ + b;
      w.index = g % k_;
      w.size = k_;
      if (epochs_ > 0) {
        int64_t total = epochs_ * m_;
        int64_t last_start = (total / k_) * k_;
        if (g >= last_start) w.size = total - last_start;
      }
      return w;
    }
  }
  return w;
}

int64_t WindowSchedule::steps_in(int64_t epochs) const {
  switch (policy_) {
    case LastWindow::Step: return epochs * ((m_ + k_ - 1) / k_);
    case LastWindow::Drop: return epochs * (m_ / k_);
    case LastWindow::Carry: return (epochs * m_ + k_ - 1) / k_;
  }
  return 0;
}

std::vector<size_t> order_plugins(const std::vector<PluginDecl>& plugins, std::vector<std::string>* warnings) {
  const size_t n = plugins.size();
  std::map<std::string, size_t> provider;
  for (size_t i = 0; i < n; ++i) {
    for (const auto& cap : plugins[i].contract.provides) {
      auto [it, fresh] = provider.emplace(cap, i);
      if (!fresh)
        throw Error("plugins '" + plugins[it->second].name + "' and '" + plugins[i].name +
                    "' both provide '" + cap + "'; a run can have only one of them");
    }
  }
  for (size_t i = 0; i < n; ++i) {
    for (const auto& need : plugins[i].contract.requires_)
      if (!provider.count(need))
        throw Error("plugin '" + plugins[i].name + "' requires '" + need + "', which no plugin in this run provides" +
                    unknown_note(need, provider));
    for (const auto& c : plugins[i].contract.conflicts) {
      auto it = provider.find(c);
      if (it != provider.end() && it->second != i)
        throw Error("plugins '" + plugins[i].name + "' and '" + plugins[it->second].name +
                    "' cannot be combined: '" + plugins[i].name + "' conflicts with '" + c + "'");
    }
  }
  // deps[i]: plugins that must run before i.
  std::vector<std::vector<size_t>> deps(n);
  for (size_t i = 0; i < n; ++i)
    for (const auto& cap : plugins[i].contract.after) {
      auto it = provider.find(cap);
      if (it != provider.end() && it->second != i) deps[i].push_back(it->second);
      const std::string note = it == provider.end() ? unknown_note(cap, provider) : "";
      if (!note.empty() && warnings)
        warnings->push_back("plugin '" + plugins[i].name + "' orders itself after '" + cap +
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
