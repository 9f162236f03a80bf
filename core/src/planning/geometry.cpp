// The batch's shape, with one owner: the micro-batch, the window (k micro-batches per optimizer
// step), the effective batch they make over the world, its ramp and the memory budget of a step.
// The recipe's [batch] section gives them (with the deprecated [data] micro_batch and a plugin's
// RunPlan::set_window, each with a warning that says what to write instead); the functions here
// are the only ones that write them into the plan: settled before the plugins' setup, the
// micro-batch the memory planner picked, a back-off after running out of memory.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cctype>

#include "assemble/assemble.h"
#include "planning/planning.h"

namespace tk::detail {
namespace {

/// The [batch] key for what a plugin's WindowRequest field held, and its option in the plugin.
struct Moved {
  const char* batch_key;
  const char* plugin_key;
};
constexpr Moved kMoved[] = {{"accumulation", "steps"},       {"effective_batch", "effective_batch"},
                            {"memory_budget", "memory_budget"}, {"last_window", "last_window"},
                            {"ramp_from", "ramp_from"},     {"ramp_steps", "ramp_steps"},
                            {"ramp_samples", "ramp_samples"}};

/// The plugin that shaped the window through set_window (deprecated), when one did.
const Slot* window_plugin(const Run& r) {
  for (const auto& s : r.slots)
    if (s.plugin && !r.plan.window_owner.empty() && s.name == r.plan.window_owner) return &s;
  return nullptr;
}

/// The ramp of [batch], checked at its recipe lines.
BatchRamp read_ramp(const Options& o, int64_t effective) {
  BatchRamp ramp;
  const int64_t from = o.get_int("ramp_from"), steps = o.get_int("ramp_steps"), samples = o.get_int("ramp_samples");
  if (from < 0) o.fail("ramp_from", "must be >= 1 (or 0: no ramp)");
  if (steps < 0) o.fail("ramp_steps", "must be >= 0");
  if (samples < 0) o.fail("ramp_samples", "must be >= 0");
  if (steps > 0 && samples > 0) o.fail("ramp_samples", "give the ramp's length in ramp_steps or ramp_samples, not both");
  if (from == 0) {
    if (steps > 0) o.fail("ramp_steps", "a ramp needs ramp_from, the effective batch it starts at");
    if (samples > 0) o.fail("ramp_samples", "a ramp needs ramp_from, the effective batch it starts at");
    return ramp;
  }
  if (effective == 0) o.fail("ramp_from", "a ramp goes up to effective_batch: set effective_batch too");
  if (from >= effective)
    o.fail("ramp_from", "is " + std::to_string(from) + ", not below effective_batch = " + std::to_string(effective));
  if (steps == 0 && samples == 0) o.fail("ramp_from", "give the ramp's length: ramp_steps or ramp_samples");
  ramp.from = from;
  ramp.over = steps > 0 ? steps : samples;
  ramp.by_samples = samples > 0;
  return ramp;
}

/// A plugin's set_window (deprecated): its request is the batch's shape, with a warning that says
/// what [batch] holds instead; a [batch] key that gives the same is refused.
void take_plugin_request(Run& r) {
  PlanValues& p = r.plan;
  const WindowRequest& w = *p.requested;
  for (const auto& m : kMoved)
    if (r.batch_opts.is_set(m.batch_key))
      r.batch_opts.fail(m.batch_key, "plugin '" + p.window_owner + "' shapes the window too (its options steps, "
                                     "effective_batch, memory_budget, last_window, ramp_*): give the batch's shape in "
                                     "[batch] alone");
  p.accumulation = w.steps;
  p.last_window = w.last_window;
  p.effective_batch_goal = w.effective_batch;
  p.memory_budget = w.memory_budget;
  p.ramp = w.ramp;
  std::string lines;
  auto line = [&](const std::string& l) { lines += (lines.empty() ? "" : ", ") + l; };
  if (w.steps > 0) line("accumulation = " + std::to_string(w.steps));
  if (w.effective_batch > 0) line("effective_batch = " + std::to_string(w.effective_batch));
  if (w.memory_budget > 0) line("memory_budget = \"" + std::to_string(static_cast<int64_t>(w.memory_budget)) + "B\"");
  if (w.last_window != LastWindow::Step) line(std::string("last_window = \"") + to_string(w.last_window) + "\"");
  if (w.ramp.active())
    line("ramp_from = " + std::to_string(w.ramp.from) + ", " + (w.ramp.by_samples ? "ramp_samples = " : "ramp_steps = ") +
         std::to_string(w.ramp.over));
  r.warn("plugin '" + p.window_owner + "' gave the batch's shape in its own options, which is deprecated: the batch is "
         "the recipe's [batch] section now; write [batch] " + (lines.empty() ? "accumulation = 1" : lines) +
         " and remove those options from the plugin");
}

}  // namespace

bool micro_batch_given(const Run& r) { return r.batch_opts.is_set("micro_batch") || r.data_opts.is_set("micro_batch"); }

void read_batch(Run& r) {
  PlanValues& p = r.plan;
  const Options& b = r.batch_opts;
  // [data] micro_batch, from before [batch]: still read, with the line to write instead.
  const Options* micro = &b;
  if (r.data_opts.is_set("micro_batch")) {
    if (b.is_set("micro_batch"))
      r.data_opts.fail("micro_batch", "the micro-batch is [batch] micro_batch now, which this recipe sets too: remove this one");
    micro = &r.data_opts;
    const std::string word = r.data_opts.get_word("micro_batch");
    r.warn("[data] micro_batch is deprecated: the batch is the recipe's [batch] section now; write [batch] micro_batch = " +
           (word.empty() ? std::to_string(r.data_opts.get_int("micro_batch")) : "\"" + word + "\""));
  }
  p.micro_batch_auto = micro->get_word("micro_batch") == "auto";
  p.micro_batch = p.micro_batch_auto ? 0 : micro->get_int("micro_batch");
  if (!p.micro_batch_auto && p.micro_batch < 1) micro->fail("micro_batch", "must be >= 1");
  const int64_t effective = b.get_int("effective_batch"), k = b.get_int("accumulation");
  if (effective < 0) b.fail("effective_batch", "must be >= 1 (or 0: not given), got " + std::to_string(effective));
  if (k < 0 || (k == 0 && effective == 0))
    b.fail("accumulation", "must be >= 1 (or 0 with effective_batch: inferred), got " + std::to_string(k));
  // With an effective batch, a window size left out is inferred (or the micro-batch, when it is given).
  p.accumulation = effective > 0 && (k == 0 || !b.is_set("accumulation")) ? 0 : k;
  p.effective_batch_goal = effective;
  const std::string& budget = b.get_string("memory_budget");
  if (!budget.empty()) {
    const auto bytes = parse_bytes(budget);
    if (!bytes) b.fail("memory_budget", bytes_expected(budget));
    // "512" would be bytes, surely not what was meant: a unit is asked for.
    const size_t last = budget.find_last_not_of(' ');
    if (last != std::string::npos && (std::isdigit(static_cast<unsigned char>(budget[last])) || budget[last] == '.'))
      b.fail("memory_budget", "\"" + budget + "\" has no unit: write \"" + budget + "MiB\", \"" + budget +
                                  "GiB\" or, for bytes, \"" + budget + "B\"");
    if (!p.micro_batch_auto)
      b.fail("memory_budget", "applies to a micro-batch picked by memory: set [batch] micro_batch = \"auto\"");
    p.memory_budget = *bytes;
  }
  const std::string& last = b.get_string("last_window");
  p.last_window = last == "drop" ? LastWindow::Drop : last == "carry" ? LastWindow::Carry : LastWindow::Step;
  p.ramp = read_ramp(b, effective);
}

namespace {

/// The data's options the command line set ("; the command line sets --set data.samples=1"), for
/// a refusal of the step against the epoch, located at the batch's line: what else changed the
/// epoch's size, the recipe file not saying so.
std::string data_overrides(const Run& r) {
  std::string set;
  for (const auto& [k, v] : r.data_opts.values())
    if (const SourceLoc at = r.data_opts.where(k); at.file.rfind("--set ", 0) == 0) set += (set.empty() ? "" : ", ") + at.file;
  return set.empty() ? set : "; the command line sets " + set;
}

}  // namespace

void refuse_window(const Run& r, const std::string& key, const std::string& what) {
  if (const Slot* s = window_plugin(r))  // the shape came from a plugin's options (deprecated): there
    for (const auto& m : kMoved)
      if (key == m.batch_key && s->plugin->options().has(m.plugin_key) && s->plugin->options().is_set(m.plugin_key))
        s->plugin->options().fail(m.plugin_key, what);
  if (key == "micro_batch" && r.data_opts.is_set("micro_batch")) r.data_opts.fail("micro_batch", what);
  r.batch_opts.fail(key, what);
}

TrialShape::TrialShape(Run& r, int64_t m, int64_t k, int64_t steps)
    : r_(r), m_(r.plan.micro_batch), k_(r.plan.accumulation), steps_(r.total_steps) {
  r.plan.micro_batch = m;
  r.plan.accumulation = k;
  r.total_steps = steps;
}

TrialShape::~TrialShape() {
  r_.plan.micro_batch = m_;
  r_.plan.accumulation = k_;
  r_.total_steps = steps_;
}

void set_picked_micro_batch(Run& r, int64_t m) {
  const int64_t per_rank = r.plan.effective_batch_goal / r.plan.world_size;
  r.plan.micro_batch = m;
  r.plan.accumulation = per_rank / m;
}

void settle_window(Run& r) {
  PlanValues& p = r.plan;
  if (p.requested) take_plugin_request(r);
  const int64_t goal = p.effective_batch_goal, world = p.world_size;
  const bool m_given = micro_batch_given(r) && !p.micro_batch_auto;
  if (goal < 0 || goal > kMaxCount)
    refuse_window(r, "effective_batch", "an effective batch of " + std::to_string(goal) + " is beyond any machine (at most " +
                                     std::to_string(kMaxCount) + " examples per optimizer step)");
  if (goal == 0) {
    if (p.micro_batch_auto)
      refuse_window(r, "micro_batch", "\"auto\" picks the micro-batch for an effective batch: set [batch] "
                                      "effective_batch (and memory_budget)");
    if (p.accumulation < 1) refuse_window(r, "accumulation", "must be >= 1 without an effective batch to infer it from");
    return;
  }
  const std::string three = "effective_batch = " + std::to_string(goal) + ", micro_batch = " +
                            (p.micro_batch_auto ? std::string("\"auto\"")
                                                : std::to_string(p.micro_batch) + (m_given ? "" : " (the default)")) +
                            ", accumulation = " + (p.accumulation > 0 ? std::to_string(p.accumulation) : std::string("(not set)")) +
                            ", world size " + std::to_string(world);
  if (goal % world != 0)
    refuse_window(r, "effective_batch", three + ": the effective batch does not divide evenly over the " +
                                     std::to_string(world) + " ranks");
  const int64_t per_rank = goal / world;
  if (p.micro_batch_auto) {
    if (p.accumulation > 0)
      refuse_window(r, "accumulation", three + ": with micro_batch = \"auto\" the accumulation follows from the micro-batch "
                                       "picked; remove accumulation");
    p.micro_batch = 0;  // picked after setup, when the optimizer exists (pick_micro_batch)
    return;
  }
  const int64_t m = p.micro_batch;
  if (p.accumulation > 0 && m_given) {
    if (m * p.accumulation != per_rank)
      refuse_window(r, "effective_batch", three + ": " + std::to_string(m) + " x " + std::to_string(p.accumulation) + " x " +
                                       std::to_string(world) + " = " + std::to_string(m * p.accumulation * world) +
                                       ", not " + std::to_string(goal) + "; give any two of the three");
  } else if (p.accumulation > 0) {
    if (per_rank % p.accumulation != 0)
      refuse_window(r, "effective_batch", three + ": " + std::to_string(per_rank) + " examples per rank do not split into " +
                                       std::to_string(p.accumulation) + " equal micro-batches");
    p.micro_batch = per_rank / p.accumulation;
  } else {
    if (per_rank % m != 0)
      refuse_window(r, "effective_batch", three + ": " + std::to_string(per_rank) + " examples per rank are not a whole number of "
                                       "micro-batches of " + std::to_string(m) + "; pick an effective batch that is a "
                                       "multiple of " + std::to_string(m * world) + ", or another micro_batch");
    p.accumulation = per_rank / m;
  }
}

namespace {

/// Warns where each epoch the run reaches ends in a short micro-batch that a window of several
/// holds, under a mean loss: the window's mean of means weighs its few examples as much as a full
/// micro-batch's.
void warn_short_micro_batch(Run& r, int64_t n, int64_t m) {
  const PlanValues& p = r.plan;
  const int64_t k = p.accumulation, rest = n % m, last = r.batches_per_epoch % std::max<int64_t>(k, 1);
  // (Under a ramp the windows of the first epochs are smaller: not reckoned here.)
  if (rest == 0 || m > n || k <= 1 || p.ramp.active() || r.data_opts.get_bool("drop_last") ||
      p.reduction != Reduction::Mean || r.total_steps < (r.batches_per_epoch + k - 1) / k)
    return;
  // A window cut short at the epoch's end: dropped, or one of that micro-batch alone.
  if ((p.last_window == LastWindow::Drop && last != 0) || (p.last_window == LastWindow::Step && last == 1)) return;
  // Sequences padded to a length count their tokens, not their examples: only a sum over them is exact.
  const bool sequences = r.data.info.ignore_index.has_value();
  r.warn_once("each epoch ends in a micro-batch of " + std::to_string(rest) + " examples, not " + std::to_string(m) +
              ", and a mean loss: the step that holds it averages the micro-batches' means, weighing its " +
              std::to_string(rest) + " examples as much as a full micro-batch's " + std::to_string(m) +
              ", unlike one batch; " + (sequences ? "" : "[data] drop_last = true, or ") +
              "a loss with reduction = \"sum\" and the window's gradient divided by its " +
              (sequences ? "counted tokens" : "examples") + " (the normalize option of the plugin that "
              "normalizes it), makes every step exact");
}

}  // namespace

void shape_windows(Run& r) {
  const int64_t n = r.shard_size(), m = r.plan.micro_batch;
  r.batches_per_epoch = r.data_opts.get_bool("drop_last") ? n / m : (n + m - 1) / m;
  if (n == 0)  // the examples, split evenly over the ranks (the remainder dropped), leave none here
    refuse_window(r, "micro_batch", "has no example to take: " +
                                        (r.plan.world_size > 1 ? "the data set split over " + std::to_string(r.plan.world_size) +
                                                                     " ranks leaves none to each; give more data or fewer ranks"
                                                               : std::string("the data set is empty")));
  if (r.batches_per_epoch < 1)
    refuse_window(r, "micro_batch", "is larger than the " + std::string(r.plan.world_size > 1 ? "rank's share of the " : "") +
                                        "data set (" + std::to_string(n) + " examples) and drop_last is on: an epoch "
                                        "has no micro-batch");
  if (m > n && !r.plan.micro_batch_auto && !r.data_opts.get_bool("drop_last")) {  // one micro-batch of them all
    r.warn_once("micro_batch " + std::to_string(m) + " is more than the " +
                (r.plan.world_size > 1 ? "rank's share of the " : "") + "data set's " + std::to_string(n) +
                " examples: each micro-batch is all of them, " + std::to_string(n) + " examples, not the " +
                std::to_string(m) + " the plan counts");
  }
  int64_t micro_batches = 0;
  if (!r.bound.by_steps() && (__builtin_mul_overflow(r.bound.count, r.batches_per_epoch, &micro_batches) ||
                              micro_batches > kMaxCount))
    r.run.fail("epochs", std::to_string(r.bound.count) + " epochs of " + std::to_string(r.batches_per_epoch) +
                             " micro-batches are beyond what any machine can train (at most " +
                             std::to_string(kMaxCount) + " micro-batches)");
  // A window cut at every epoch's end would never take the step the plan says.
  if (r.plan.accumulation > r.batches_per_epoch && r.plan.last_window != LastWindow::Carry)
    refuse_window(r, r.plan.effective_batch_goal > 0 ? "effective_batch" : "accumulation",
                  "an optimizer step of " + std::to_string(r.plan.accumulation) + " micro-batches of " +
                      std::to_string(m) + " (" + std::to_string(r.plan.effective_batch()) +
                      " examples) is more than an epoch holds (" + std::to_string(r.batches_per_epoch) +
                      std::string(r.batches_per_epoch == 1 ? " micro-batch, " : " micro-batches, ") + std::to_string(n) +
                      (n == 1 ? " example" : " examples") + (r.plan.world_size > 1 ? " per rank" : "") +
                      ")" + data_overrides(r) + ": every step would be cut at the epoch's end; ask for a smaller step, "
                      "or set [batch] last_window = \"carry\" so that a window spans epochs");
  r.windows = std::make_unique<WindowSchedule>(r.batches_per_epoch, r.plan.accumulation, r.plan.last_window,
                                               r.bound.by_steps() ? 0 : r.bound.count);
  if (r.plan.ramp.active()) {
    const int64_t world = r.plan.world_size;
    r.windows->set_ramp(r.plan.ramp, r.plan.effective_batch(), m * world,
                        [n, m, world](int64_t b0, int64_t b1) { return world * (std::min(b1 * m, n) - b0 * m); });
  }
  r.total_steps = r.bound.by_steps() ? r.bound.count : r.windows->steps_in(r.bound.count);
  if (r.total_steps < 1) throw Error("the run would take no optimizer step");
  const BatchRamp& ramp = r.plan.ramp;
  if (ramp.active() && !r.windows->ramp_completes(r.total_steps))
    refuse_window(r, ramp.by_samples ? "ramp_samples" : "ramp_steps",
                  "the batch ramp lasts " + std::to_string(ramp.over) + (ramp.by_samples ? " examples" : " optimizer steps") +
                      ", longer than the run's " + std::to_string(r.total_steps) + " optimizer steps" +
                      (ramp.by_samples ? " take" : "") + ": the run would end before its effective batch of " +
                      std::to_string(r.plan.effective_batch()) + "; shorten the ramp or lengthen the run");
  warn_short_micro_batch(r, n, m);
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
