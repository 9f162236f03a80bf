// A run continued on another number of ranks (persist.h): every step after the checkpoint takes
// the examples it would have taken on the ranks that wrote it, with the same weights, computed by
// other ranks. The examples of an epoch are one order over the whole world (rank r reads positions
// r, r + N, ...), so a window is a stretch of that order whoever computes it; what can change with
// the world is how many examples an epoch leaves out (fewer than N), where its micro-batches end
// (a mean loss weighs an example by its micro-batch's size), how a short window or a ramp is cut.
// Each is compared by walking the rest of the run on both worlds, step by step.
#include <spdlog/spdlog.h>

#include <ATen/ops/eq.h>

#include <algorithm>
#include <memory>
#include <optional>

#include "persist/persist.h"
#include "planning/planning.h"
#include "tk/model.h"

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

/// Where a resumed run starts: the next window's first micro-batch, and what came before it.
struct From {
  int64_t epoch = 0, batch = 0, step = 0, samples = 0, total = 0;
};

/// The steps from `From` to the run's end as the training loop takes them (loop.cpp), one at a
/// time: each step's examples as pieces (epoch, first, end, weight) of positions in the epoch's
/// order over every rank. With a mean loss an example's weight is 1 / (its micro-batch's size x
/// the window's micro-batches over the world); with a sum loss every example weighs the same.
class Walk {
 public:
  Walk(const Run& r, const Shape& s, From f) : r_(r), s_(s), f_(f), e_(f.epoch), i_(f.batch) {
    mean_ = r.plan.reduction == Reduction::Mean;
  }

  /// The next step's pieces into `out`; false after the last step.
  bool next(std::vector<int64_t>& out) {
    out.clear();
    std::vector<int64_t> sizes;  // each micro-batch's examples on a rank, in the window
    bool open = false;
    Window w;
    while (f_.step < f_.total && (r_.bound.by_steps() || e_ < r_.bound.count)) {
      if (i_ >= s_.per_epoch) {
        ++e_;
        i_ = 0;
        continue;
      }
      if (!open) {
        const auto start = s_.windows->start(e_, i_, f_.step, f_.samples);
        if (!start) {  // the policy drops the rest of the epoch
          i_ = s_.per_epoch;
          continue;
        }
        w = *start;
        open = true;
      } else {
        ++w.index;
      }
      const int64_t first = s_.world * i_ * s_.m, size = std::min((i_ + 1) * s_.m, s_.n) - i_ * s_.m;
      out.insert(out.end(), {e_, first, first + s_.world * size, size});
      f_.samples += s_.world * size;
      ++i_;
      if (w.is_last()) {
        ++f_.step;
        weigh(out, static_cast<int64_t>(out.size() / 4) * s_.world);
        return true;
      }
    }
    return false;
  }

 private:
  /// Each piece's size becomes its examples' weight's denominator (0 for a sum loss); contiguous
  /// pieces of one weight become one.
  void weigh(std::vector<int64_t>& pieces, int64_t micro_batches) const {
    std::vector<int64_t> merged;
    for (size_t p = 0; p < pieces.size(); p += 4) {
      const int64_t weight = mean_ ? pieces[p + 3] * micro_batches : 0;
      const size_t z = merged.size();
      if (z >= 4 && merged[z - 4] == pieces[p] && merged[z - 2] == pieces[p + 1] && merged[z - 1] == weight)
        merged[z - 2] = pieces[p + 2];
      else
        merged.insert(merged.end(), {pieces[p], pieces[p + 1], pieces[p + 2], weight});
    }
    pieces.swap(merged);
  }

  const Run& r_;
  const Shape& s_;
  From f_;
  int64_t e_, i_;
  bool mean_ = true;
};

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
  }

  /// The first split of the step over `world` ranks that takes the same steps: the plan's own,
  /// the checkpoint's micro-batch with another window (where the run may accumulate), its window
  /// with another micro-batch.
  Fit on(int64_t world) const {
    if (batch_ % world != 0)
      return why("its " + std::to_string(batch_) + " examples a step do not divide over " + std::to_string(world) + " ranks");
    const int64_t per_rank = batch_ / world, m0 = pos_.micro_batch, k0 = pos_.accumulation;
    const PlanValues& p = r_.plan;
    const bool may_accumulate = !(p.reduction == Reduction::Mean && !p.has(cap::kGradsNormalized));
    std::vector<std::pair<int64_t, int64_t>> splits;
    if (world == p.world_size && p.micro_batch > 0 && p.micro_batch * p.accumulation == per_rank)
      splits.emplace_back(p.micro_batch, p.accumulation);
    if (per_rank % m0 == 0 && (per_rank / m0 == 1 || may_accumulate)) splits.emplace_back(m0, per_rank / m0);
    if (per_rank % k0 == 0) splits.emplace_back(per_rank / k0, k0);
    if (splits.empty())
      return why(std::to_string(per_rank) + " examples per rank are neither micro-batches of " + std::to_string(m0) +
                 " nor " + std::to_string(k0) + " equal micro-batches");
    Fit first;
    for (const auto& [m, k] : splits) {
      Fit f = with(world, m, k);
      if (f.why.empty()) return f;
      if (first.why.empty()) first = std::move(f);
    }
    return first;
  }

  /// The world sizes up to 64 on which the run goes on exactly, as "1, 2, 4" ("" when none).
  std::string worlds_that_fit() const {
    std::string out;
    for (int64_t w = 1; w <= std::min<int64_t>(batch_, 64); ++w)
      if (batch_ % w == 0 && on(w).why.empty()) out += (out.empty() ? "" : ", ") + std::to_string(w);
    return out;
  }

  int64_t batch() const noexcept { return batch_; }

  /// The run going on over `world` ranks in micro-batches of m x k, or why it cannot with the same steps.
  Fit with(int64_t world, int64_t m, int64_t k) const {
    const std::string w = std::to_string(world), split = std::to_string(m) + " x " + std::to_string(k);
    const int64_t at = pos_.next_batch * pos_.micro_batch * pos_.world_size;  // the next window's first position
    if (at % (m * world) != 0)
      return why("the next step starts at example " + std::to_string(at) + " of its epoch, inside a micro-batch of " +
                 w + " ranks of " + std::to_string(m));
    const Shape after = shape_on(r_, world, m, k);
    const int64_t used_before = before_.n * before_.world, used_after = after.n * world;
    if (used_before != used_after)
      return why("an epoch of " + std::to_string(r_.data.train->size()) + " examples is " + std::to_string(used_before) +
                 " examples on " + std::to_string(before_.world) + " ranks (each reads as many), " +
                 std::to_string(used_after) + " on " + w);
    if (!after.windows || (r_.bound.by_steps() ? r_.bound.count : after.windows->steps_in(r_.bound.count)) != from_.total)
      return why("the run would have another number of steps on " + w + " ranks");
    From from = from_;
    from.batch = at / (m * world);
    Walk expected(r_, before_, from_), got(r_, after, from);
    std::vector<int64_t> a, b;
    for (int64_t step = from_.step + 1;; ++step) {
      const bool more = expected.next(a);
      if (more != got.next(b) || a != b)
        return why("step " + std::to_string(step) + " would take other examples on " + w + " ranks (micro-batches of " +
                   split + "), or weigh them otherwise: an epoch's end, a short window or the ramp cut elsewhere");
      if (!more) break;
    }
    Fit f;
    f.m = m;
    f.k = k;
    f.next_batch = from.batch;
    return f;
  }

 private:
  static Fit why(std::string what) {
    Fit f;
    f.why = std::move(what);
    return f;
  }

  const Run& r_;
  const TrainingPosition& pos_;
  Shape before_;
  int64_t batch_ = 0;
  From from_;
};

/// Why the micro-batches of another world would change the step whatever their sizes, or "": they
/// are regrouped (a rank of 2 holds examples 0, 2, ..., one process 0, 1, ...), which BatchNorm's
/// statistics and a mean over items that do not all count (padding) depend on.
std::string regrouping_changes_step(const Run& r) {
  if (has_batchnorm(*r.model)) return "the model has BatchNorm, whose statistics are of each micro-batch's examples";
  const auto& info = r.data.info;
  if (r.plan.reduction != Reduction::Mean || !info.ignore_index) return "";
  const auto* t = dynamic_cast<const TensorDataset*>(r.data.train.get());
  if (t && (at::isFloatingType(t->targets().scalar_type()) || !t->targets().eq(*info.ignore_index).any().item<bool>()))
    return "";
  return "a mean loss over items of which some do not count (ignore_index) weighs each by its micro-batch's count; "
         "a sum loss normalized by the window's counted items takes the same step on any world";
}

}  // namespace

namespace {

std::string ranks_word(int64_t n) { return std::to_string(n) + (n == 1 ? " rank" : " ranks"); }

/// How a checkpoint at `pos` goes on in this run: its split of the step and how it fits.
struct Carry {
  bool resplit = false;  // on the same world, in another split
  Fit fit;
  int64_t batch = 0;     // examples a step
};

/// How `pos` (of checkpoint `dir`) is carried over to this run's world and split; nothing where it
/// goes on as it is. Refused (RunRefused) where the same steps cannot go on.
std::optional<Carry> carry_of(const Run& r, const TrainingPosition& pos, const std::string& dir, bool split_allowed) {
  const int64_t before = pos.world_size, now = r.plan.world_size;
  // The same world split otherwise: carried over as to another world, the same examples in each
  // step, in the recipe's split where a change of the batch was let through, else in the
  // checkpoint's (a run that went on from another world size keeps the split it was carried into).
  // (A measured micro-batch is the checkpoint's: Loop::start_from.)
  const PlanValues& p = r.plan;
  const bool resplit = before == now && !p.micro_batch_auto && pos.micro_batch > 0 && pos.accumulation > 0 &&
                       (pos.micro_batch != p.micro_batch || pos.accumulation != p.accumulation);
  if (before <= 0 || (before == now && !resplit) || pos.counters.step >= pos.counters.total_steps) return std::nullopt;
  const std::string ranks = ranks_word(before);
  const std::string refused =
      "cannot continue " + dir + ", trained " +
      (resplit ? "in micro-batches of " + std::to_string(pos.micro_batch) + " x " + std::to_string(pos.accumulation) +
                     " per rank, as " + std::to_string(p.micro_batch) + " x " + std::to_string(p.accumulation)
               : "on " + ranks + ", on " + std::to_string(now)) +
      " with the same steps: ";
  if (resplit && split_allowed && p.micro_batch * p.accumulation != pos.micro_batch * pos.accumulation)
    throw RunRefused(refused + "a step of " + std::to_string(pos.micro_batch * pos.accumulation * now) + " examples is not one of " +
                     std::to_string(p.micro_batch * p.accumulation * now) + ": the examples a step takes cannot change on "
                     "a resume, only how they are split into micro-batches");
  if (pos.accumulation <= 0 || pos.micro_batch <= 0)
    throw RunRefused(refused + "it was written by a trainkit that did not record its window; resume it on " + ranks);
  if (const std::string why = regrouping_changes_step(r); !why.empty()) throw RunRefused(refused + why);
  const WorldChange change(r, pos);
  Fit fit = resplit && split_allowed ? change.with(now, p.micro_batch, p.accumulation) : change.on(now);
  if (!fit.why.empty()) {
    const std::string fits = resplit ? "" : change.worlds_that_fit();
    throw RunRefused(refused + fit.why +
                     (fits.empty() ? "" : "; it continues exactly on " + fits + (fits == "1" ? " rank" : " ranks")));
  }
  return Carry{resplit, std::move(fit), change.batch()};
}

}  // namespace

void check_continuation(const Run& r, const TrainingPosition& pos, const std::filesystem::path& dir, bool split_allowed) {
  carry_of(r, pos, dir.string(), split_allowed);
}

void continue_on_world(Run& r, Checkpoint& ck, bool split_allowed) {
  TrainingPosition& pos = ck.position;
  const int64_t before = pos.world_size, now = r.plan.world_size;
  if (before <= 0) {  // a checkpoint that does not say: of this world, as before its world was recorded
    pos.world_size = now;
    pos.seen = {pos.counters.samples_seen * now, pos.counters.tokens_seen * now};
    return;
  }
  const auto carry = carry_of(r, pos, ck.dir.string(), split_allowed);
  if (!carry) return;
  const Fit& fit = carry->fit;
  const bool resplit = carry->resplit;
  const std::string ranks = ranks_word(before);
  // The plan printed before the resume is the recipe's on this world: said when the run's differs.
  const std::string planned = fit.m == r.plan.micro_batch && fit.k == r.plan.accumulation
                                  ? ""
                                  : " (in place of the plan's " + std::to_string(r.plan.micro_batch) + " x " +
                                        std::to_string(r.plan.accumulation) + ")";
  r.plan.micro_batch = fit.m;
  r.plan.accumulation = fit.k;
  shape_windows(r);
  if (resplit && (fit.m != pos.micro_batch || fit.k != pos.accumulation))
    spdlog::info("continuing the run in micro-batches of {} x {} per rank (it trained in {} x {}): {} examples a step, "
                 "from the same example on", fit.m, fit.k, pos.micro_batch, pos.accumulation, carry->batch);
  else if (resplit)
    spdlog::info("continuing the run in its micro-batches of {} x {} per rank{}: {} examples a step", fit.m, fit.k,
                 planned, carry->batch);
  else
    spdlog::info("continuing the run of {} on {}: {} examples a step, micro-batches of {} x {} per rank{}, from the same "
                 "example on", ranks, now, carry->batch, fit.m, fit.k, planned);
  pos.next_batch = fit.next_batch;
  pos.micro_batch = fit.m;
  pos.accumulation = fit.k;
  if (before == now) {  // the same ranks: their own counts stand
    pos.counters.batch_in_epoch = std::max<int64_t>(fit.next_batch - 1, 0);
    return;
  }
  pos.world_size = now;
  // A rank's counts: its share of the world's (the tokens of one rank's share differ a little).
  pos.counters.samples_seen = pos.seen.samples / now;
  pos.counters.tokens_seen = pos.seen.tokens / now;
  pos.counters.batch_in_epoch = std::max<int64_t>(fit.next_batch - 1, 0);
}

}  // namespace tk::detail
