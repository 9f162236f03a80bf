// ZeRO's arithmetic on a measured step: the training state at each stage over n ranks, and the
// advice a memory refusal gives (planning.h). Pure: the planning layer measures, this reckons.
#include "planning/planning.h"

#include <tk/capabilities.h>
#include <tk/options.h>

#include <algorithm>
#include <cmath>

namespace tk::detail {
namespace {

/// A bucket of gradients summed together at most (as PyTorch DDP's bucket_cap_mb).
constexpr double kBucketBytes = 25.0 * 1024 * 1024;

/// "X at stage `first`, ... and Z at stage 3".
std::string stage_list(const std::vector<double>& at, size_t first) {
  std::string out;
  for (size_t s = first; s < at.size(); ++s)
    out += (s == first ? "" : s + 1 == at.size() ? " and " : ", ") + format_bytes(at[s]) + " at stage " + std::to_string(s);
  return out;
}

}  // namespace

double TrainingState::share(int64_t n) const {
  return std::max(1.0 / static_cast<double>(n), trainable > 0 ? largest_tensor / trainable : 0.0);
}

std::string TrainingState::unsharded() const {
  return "parameters " + format_bytes(frozen + trainable) + ", gradients " + format_bytes(trainable) + ", " +
         (optimizer_known ? "optimizer state " + format_bytes(optimizer_whole)
                          : "the optimizer's state not reported by it, counted as none");
}

std::vector<double> TrainingState::per_rank(int64_t n) const { return on_machine(n, 1); }

std::vector<double> TrainingState::on_machine(int64_t n, int64_t here) const {
  const double P = trainable, G = trainable, O = optimizer_whole, L = largest_block;
  const double B = std::max(L, largest_bucket);  // the gradients of the largest bucket of blocks
  // `here` ranks' parts of a sharded state: each at most the share f, together at most the whole
  // (where one tensor is most of the state, the shares are uneven: one rank holds it, the others
  // little).
  const auto h = static_cast<double>(std::max<int64_t>(here, 1));
  const double parts = std::min(1.0, h * share(n));
  // Beside the state's share (ZeRO's arithmetic, each rank's part at most f), the buffers its
  // sharding needs: the updated parameters broadcast by their owners (stages 1 and 2: a part of
  // them, as the state's); the gradients held whole until their bucket is summed onto its owner,
  // a block's or small neighbouring blocks' (a bucket's of at most 25 MiB without blocks), and
  // that bucket's copy (2); at stage 3
  // three blocks gathered (the one computing, the next, and in backward the one just done) and the
  // parameters of no block, their gradients whole until backward ends, a block's gradients and
  // their copy, and the copy of the block its owners send (one block's for all the ranks
  // together: each owner sends its part of it).
  const double bucket = std::min(kBucketBytes, B > 0 ? B : P);
  return {h * (frozen + P + G + O),
          h * (frozen + P + G) + (O + P) * parts,
          h * (frozen + P + 2 * bucket) + (G + O + P) * parts,
          h * (frozen + std::min(P, loose + 3 * L) + loose + std::min(kBucketBytes, loose) + 2 * std::min(kBucketBytes, B)) +
              (P + G + O) * parts + L};
}

double TrainingState::whole_weights(int64_t n, int64_t here) const {
  const auto h = static_cast<double>(std::max<int64_t>(here, 1));
  return h * (frozen + trainable) + optimizer_whole * std::min(1.0, h * share(n));
}

double TrainingState::most(size_t st, int64_t n, int64_t here) const {
  const double held = on_machine(n, here)[st];
  return st == 3 ? std::max(held, whole_weights(n, here)) : held;
}

std::string sharding_advice(const TrainingState& s, double peak, double limit, int64_t world_size, int64_t batch) {
  const int64_t n = std::max<int64_t>(world_size, 2);
  const bool alone = world_size < 2;  // one rank: nothing sharded whatever the stage
  const std::vector<double> here = s.per_rank(std::max<int64_t>(world_size, 1)), there = s.per_rank(n);
  // The rest of the step (activations, the batch, the buffers): the measured peak beyond what
  // this stage's state and buffers take. Below zero where those buffers are reckoned larger than
  // they were (a small model's): each stage then differs from the measured step by what its state
  // and buffers differ, so the figure of the stage measured is the peak itself, and no other
  // stage's falls below its bare share of the state.
  // One rank shards nothing and sums nothing, whatever its stage: it holds the whole state.
  const double rest = peak - here[alone ? 0 : static_cast<size_t>(s.stage)];
  const double f = s.share(n), P = s.trainable, O = s.optimizer_whole;
  const std::vector<double> bare = {s.whole(), s.frozen + 2 * P + O * f, s.frozen + P + (P + O) * f,
                                    s.frozen + (2 * P + O) * f};
  std::string out = "; the training state is " + format_bytes(s.whole()) +
                    " unsharded (" + s.unsharded() + "), and this step is at ZeRO stage " + std::to_string(s.stage);
  std::vector<double> step;
  for (size_t stage = 0; stage < there.size(); ++stage)
    step.push_back(!alone && stage == static_cast<size_t>(s.stage) ? peak
                                                                   : std::max(rest + there[stage], bare[stage]));
  // From the stage measured (a lower one holds more, and its figure would be a guess).
  out += std::string(alone ? ". On one rank nothing is sharded; over 2 ranks" : ". Over its " + std::to_string(n) + " ranks") +
         ", with the optimizer state sharded from stage 1, the gradients from 2 and the parameters from 3, the step "
         "would take about " + stage_list(step, alone ? 0 : static_cast<size_t>(s.stage));
  // The stages above this one; on one rank, any that shards (over 2 ranks, each stage is new).
  const auto divides = [batch](int64_t ranks) { return batch <= 0 || batch % ranks == 0; };
  for (size_t stage = alone ? 1 : static_cast<size_t>(s.stage) + 1; stage < step.size(); ++stage)
    if (step[stage] <= limit && divides(n))
      return out + ": by these figures stage " + std::to_string(stage) + " would fit (" +
             (alone ? "over 2 ranks, tk-run --nproc 2 with ddp; the stage " : "") + "set by a plugin that provides " +
             cap::kOptimizerSharded.name() + "; tk-run --list shows the plugins)";
  // No higher stage over this world: the fewest ranks at stage 3, if more ranks can do it. A
  // rank holds whole tensors: never less than the largest one's part, and at most one rank per tensor.
  // (The rest at no less than zero: a count of ranks errs towards more.)
  const double sharded = 2 * s.trainable + s.optimizer_whole,
               fixed = std::max(rest, 0.0) + there[3] - sharded * s.share(n);
  const double room = limit - fixed, least = sharded * s.share(std::max<int64_t>(s.tensors, 1));
  if (least > room)
    return out + ": by these figures none fits, over any number of ranks: the rest of the step (activations, the "
                 "parameters gathered) and the least share of the state a rank can hold take " +
           format_bytes(fixed + least) + " on each (estimates: a stage the recipe sets is measured)";
  // The least share fits: the fewest ranks from the even split's count up, at most one per
  // tensor, and a number the effective batch divides over (`batch`, where the recipe sets one).
  const int64_t most = std::max<int64_t>(s.tensors, 1);
  auto k = std::max(static_cast<int64_t>(std::ceil(sharded / room)), n + 1);
  while (k <= most && (sharded * s.share(k) > room || !divides(k))) ++k;
  if (k > most)
    return out + ": none fits; by these figures stage 3 would fit over no number of ranks above " + std::to_string(n) +
           " and up to one per trainable tensor (" + std::to_string(most) + ")" +
           (batch > 0 ? " that the effective batch of " + std::to_string(batch) + " divides over" : "");
  return out + ": none fits; by these figures stage 3 would over " + std::to_string(k) + " ranks (about " +
         format_bytes(fixed + sharded * s.share(k)) + " each)";
}

std::string state_overflow(const TrainingState& s, int64_t world_size, int64_t local, double have,
                           const std::string& have_note) {
  const int64_t n = std::max<int64_t>(world_size, 1), here = std::clamp<int64_t>(local, 1, n);
  const size_t stage = n == 1 ? 0 : static_cast<size_t>(s.stage);  // one rank holds it all, whatever its stage
  // What a rank holds at most (TrainingState::most): at stage 3 never less than the whole weights,
  // which every rank holds as the model is built, and again as the fit ends (gathered for the
  // weights file) beside its share of the optimizer's state (each step releases the gradients).
  const double each = s.most(stage, n, 1), all = s.most(stage, n, here);
  if (all <= have) return "";
  std::string out = "its training state does not fit this machine's memory: about " + format_bytes(each) +
                    " a rank at ZeRO stage " + std::to_string(stage) + " over " + std::to_string(n) + " rank" +
                    (n == 1 ? "" : "s") + (n == 1 && s.stage > 0 ? " (one rank shards nothing, whatever its stage)" : "") +
                    (here == 1 ? std::string()
                               : ", " + format_bytes(all) + " for the " + std::to_string(here) +
                                     " ranks on this machine") +
                    ", and it has " + format_bytes(have) + have_note + " (unsharded: " + s.unsharded() + ")";
  if (stage == 3 && s.whole_weights(n, 1) > s.per_rank(n)[3])
    out += "; at stage 3 each rank still holds the whole weights as the model is built, and as the fit ends beside its "
           "share of the optimizer's state";
  // Machines of `h` ranks each, at least as many ranks as now (more for this stage with as many on
  // a machine): the fewest on which each stage fits (a stage that shards can need more than stage
  // 0, where one tensor is most of the state). A rank holds whole tensors: past one rank a tensor,
  // more ranks change nothing.
  const int64_t tensors = std::max<int64_t>(s.tensors, 1);
  bool more_machines = false, sharded = false, unsharded = false;
  const auto fitting = [&](int64_t h) {
    std::string fits;
    for (size_t st = h == here && stage == 0 ? 1 : 0; st < 4; ++st)
      for (int64_t m = h == here && st == stage ? n / h + 1 : (n + h - 1) / h;; ++m) {
        if (s.most(st, m * h, h) <= have) {
          fits += (fits.empty() ? "" : ", ") + std::string("stage ") + std::to_string(st) + " on " + std::to_string(m) +
                  " machine" + (m == 1 ? "" : "s");
          more_machines = more_machines || m > 1;
          sharded = sharded || st > 0;
          unsharded = unsharded || st == 0;
          break;
        }
        if (st == 0 || m * h >= tensors) break;  // stage 0 holds the whole state on any number
      }
    return fits;
  };
  const auto on_each = [](int64_t h) { return std::to_string(h) + " rank" + (h == 1 ? "" : "s") + " on each machine"; };
  std::string fits = fitting(here);
  int64_t h = here;
  if (fits.empty()) {
    out += "; with " + on_each(here) + ", no stage fits on any number of machines";
    while (fits.empty() && --h >= 1) fits = fitting(h);
    if (fits.empty()) return here > 1 ? out + ", nor with fewer ranks on each" : out;
  }
  // Fewer ranks on a machine than now take more machines than now (h < here <= n).
  std::string how = more_machines ? "tk-run --nnodes" + (h < here ? ", --nproc " + std::to_string(h) : std::string()) : "";
  if (sharded)
    how += (how.empty() ? "" : "; ") + std::string("the stage set by a plugin that provides ") + cap::kOptimizerSharded.name() +
           ", and from stage 3 " + cap::kParamsSharded.name() + "; tk-run --list shows the plugins";
  if (unsharded && stage > 0)
    how += (how.empty() ? "" : "; ") + std::string("stage 0: without the plugin that provides ") + cap::kOptimizerSharded.name();
  return out + "; with " + on_each(h) + ", by these figures " + fits + " would fit" + (how.empty() ? "" : " (" + how + ")");
}

}  // namespace tk::detail
