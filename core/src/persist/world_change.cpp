// A run continued on another number of ranks (persist.h): every step after the checkpoint takes
// the examples it would have taken on the ranks that wrote it, computed by other ranks. The
// examples of an epoch are one order over the whole world (rank r reads positions r, r + N, ...),
// so a window is a stretch of that order whoever computes it; what can change with the world is
// how many examples an epoch leaves out (fewer than N), where its micro-batches end and how a
// short window or a ramp is cut. Each is compared by walking the rest of the run on both worlds.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <memory>

#include "persist/persist.h"
#include "planning/planning.h"

namespace tk::detail {
namespace {

/// The batch's shape on a world of `world` ranks: micro-batch, window, examples per rank and
/// epoch, micro-batches per epoch and the window schedule (null when an epoch has no micro-batch).
struct Shape {
  int64_t world = 1, m = 1, k = 1, n = 0, per_epoch = 0;
  std::unique_ptr<WindowSchedule> windows;
};

Shape shape_on(const Run& r, int64_t world, int64_t m, int64_t k) {
  Shape s;
  s.world = world;
  s.m = m;
  s.k = k;
  s.n = r.data.train->size() / world;
  s.per_epoch = r.data_opts.get_bool("drop_last") ? s.n / m : (s.n + m - 1) / m;
  if (s.per_epoch < 1) return s;
  s.windows = std::make_unique<WindowSchedule>(s.per_epoch, k, r.plan.last_window, r.bound.by_steps() ? 0 : r.bound.count);
  if (r.plan.ramp.active()) {
    const int64_t n = s.n;
    s.windows->set_ramp(r.plan.ramp, m * k * world, m * world,
                        [n, m, world](int64_t b0, int64_t b1) { return world * (std::min(b1 * m, n) - b0 * m); });
  }
  return s;
}

int64_t steps_of(const Run& r, const Shape& s) {
  return r.bound.by_steps() ? r.bound.count : s.windows->steps_in(r.bound.count);
}

/// Where a resumed run starts: the next window's first micro-batch, and what came before it.
struct From {
  int64_t epoch = 0, batch = 0, step = 0, samples = 0, total = 0;
};

/// The examples of each step from `f` to the run's end, as the training loop takes them: pieces
/// (epoch, first, end) of positions in the epoch's order over every rank, each step closed by -1.
std::vector<int64_t> steps_ahead(const Run& r, const Shape& s, From f) {
  std::vector<int64_t> out;
  bool open = false;
  Window w;
  for (int64_t e = f.epoch; f.step < f.total && (r.bound.by_steps() || e < r.bound.count); ++e) {
    for (int64_t i = e == f.epoch ? f.batch : 0; i < s.per_epoch && f.step < f.total; ++i) {
      if (!open) {
        const auto next = s.windows->start(e, i, f.step, f.samples);
        if (!next) break;  // the policy drops the rest of the epoch
        w = *next;
        open = true;
      } else {
        ++w.index;
      }
      const int64_t first = s.world * i * s.m, end = s.world * std::min((i + 1) * s.m, s.n);
      const size_t z = out.size();
      if (z >= 3 && out[z - 1] == first && out[z - 3] == e)
        out[z - 1] = end;  // the stretch goes on
      else
        out.insert(out.end(), {e, first, end});
      f.samples += end - first;
      if (w.is_last()) {
        open = false;
        out.push_back(-1);
        ++f.step;
      }
    }
  }
  return out;
}

/// The micro-batch and window that make `per_rank` examples a step: the plan's own when they do,
/// else the checkpoint's micro-batch `m0` with another window (where the run may accumulate), else
/// its window `k0` with another micro-batch; {0, 0} when none does.
std::pair<int64_t, int64_t> split(const Run& r, int64_t world, int64_t per_rank, int64_t m0, int64_t k0) {
  const PlanValues& p = r.plan;
  if (world == p.world_size && p.micro_batch > 0 && p.micro_batch * p.accumulation == per_rank)
    return {p.micro_batch, p.accumulation};
  const bool may_accumulate = !(p.reduction == Reduction::Mean && !p.has(cap::kGradsNormalized));
  if (per_rank % m0 == 0 && (per_rank / m0 == 1 || may_accumulate)) return {m0, per_rank / m0};
  if (per_rank % k0 == 0) return {per_rank / k0, k0};
  return {0, 0};
}

/// How the checkpoint's run goes on with `world` ranks, or why it cannot with the same steps.
struct Fit {
  int64_t m = 0, k = 0, next_batch = 0;
  std::string why;  ///< empty when it fits
};

class WorldChange {
 public:
  WorldChange(const Run& r, const TrainingPosition& pos)
      : r_(r), pos_(pos), before_(shape_on(r, pos.world_size, pos.micro_batch, pos.accumulation)) {
    batch_ = pos.micro_batch * pos.accumulation * pos.world_size;
    from_ = {pos.next_epoch, pos.next_batch, pos.counters.step, pos.seen.samples, pos.counters.total_steps};
    expected_ = steps_ahead(r, before_, from_);
  }

  Fit on(int64_t world) const {
    Fit f;
    const std::string b = std::to_string(batch_), w = std::to_string(world);
    if (batch_ % world != 0) return why(f, "its " + b + " examples a step do not divide over " + w + " ranks");
    std::tie(f.m, f.k) = split(r_, world, batch_ / world, pos_.micro_batch, pos_.accumulation);
    if (f.m == 0)
      return why(f, std::to_string(batch_ / world) + " examples per rank are neither micro-batches of " +
                        std::to_string(pos_.micro_batch) + " nor " + std::to_string(pos_.accumulation) +
                        " equal micro-batches");
    const int64_t at = pos_.next_batch * pos_.micro_batch * pos_.world_size;  // the next window's first position
    if (at % (f.m * world) != 0)
      return why(f, "the next step starts at example " + std::to_string(at) + " of its epoch, inside a micro-batch of " +
                        w + " ranks");
    f.next_batch = at / (f.m * world);
    const Shape after = shape_on(r_, world, f.m, f.k);
    const int64_t used_before = before_.n * before_.world, used_after = after.n * world;
    if (used_before != used_after)
      return why(f, "an epoch of " + std::to_string(r_.data.train->size()) + " examples is " + std::to_string(used_before) +
                        " examples on " + std::to_string(before_.world) + " ranks (each reads as many), " +
                        std::to_string(used_after) + " on " + w);
    if (!after.windows || steps_of(r_, after) != from_.total)
      return why(f, "the run would have another number of steps on " + w + " ranks");
    From from = from_;
    from.batch = f.next_batch;
    if (steps_ahead(r_, after, from) != expected_)
      return why(f, "the steps ahead would take other examples on " + w + " ranks (micro-batches of " +
                        std::to_string(f.m) + " cut the epoch's end or the ramp elsewhere)");
    return f;
  }

  /// The world sizes up to 64 on which the run goes on exactly, as "1, 2, 4" ("" when none).
  std::string worlds_that_fit() const {
    std::string out;
    for (int64_t w = 1; w <= std::min<int64_t>(batch_, 64); ++w)
      if (batch_ % w == 0 && on(w).why.empty()) out += (out.empty() ? "" : ", ") + std::to_string(w);
    return out;
  }

  int64_t batch() const noexcept { return batch_; }

 private:
  static Fit why(Fit f, std::string what) {
    f.why = std::move(what);
    return f;
  }

  const Run& r_;
  const TrainingPosition& pos_;
  Shape before_;
  int64_t batch_ = 0;
  From from_;
  std::vector<int64_t> expected_;
};

}  // namespace

void continue_on_world(Run& r, Checkpoint& ck) {
  TrainingPosition& pos = ck.position;
  const int64_t before = pos.world_size, now = r.plan.world_size;
  if (before <= 0 || before == now) return;
  const std::string dir = ck.dir.string(), ranks = std::to_string(before) + (before == 1 ? " rank" : " ranks");
  if (pos.accumulation <= 0 || pos.micro_batch <= 0)
    throw RunRefused(dir + " was written by " + ranks + " with a trainkit that did not record its window: resume it on " +
                     ranks);
  const WorldChange change(r, pos);
  const Fit fit = change.on(now);
  if (!fit.why.empty()) {
    const std::string fits = change.worlds_that_fit();
    throw RunRefused("cannot continue " + dir + ", trained on " + ranks + ", on " + std::to_string(now) +
                     " with the same steps: " + fit.why + (fits.empty() ? "" : "; it continues exactly on " + fits + " ranks"));
  }
  r.plan.micro_batch = fit.m;
  r.plan.accumulation = fit.k;
  shape_windows(r);
  spdlog::info("continuing the run of {} on {}: {} examples a step, micro-batches of {} x {} per rank, from the same "
               "example on", ranks, now, change.batch(), fit.m, fit.k);
  pos.next_batch = fit.next_batch;
  pos.micro_batch = fit.m;
  pos.accumulation = fit.k;
  pos.world_size = now;
  // A rank's counts: its share of the world's (the tokens of one rank's share differ a little).
  pos.counters.samples_seen = pos.seen.samples / now;
  pos.counters.tokens_seen = pos.seen.tokens / now;
  pos.counters.batch_in_epoch = std::max<int64_t>(fit.next_batch - 1, 0);
}

}  // namespace tk::detail
