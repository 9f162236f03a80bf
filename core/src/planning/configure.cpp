// The plan of a run: the plugins configure it and are ordered by their contracts, the window is
// settled from an effective batch, the plugins' setup may change the model, the optimizer is made,
// the micro-batch picked by memory (memory.cpp), the windows shaped and the data checked.
#include <spdlog/spdlog.h>

#include "assemble/assemble.h"
#include "planning/planning.h"

namespace tk::detail {
namespace {

/// The run's plugins, their capabilities in the plan, each one's configure, and the dispatch
/// order their contracts give.
void configure_plugins(Run& r) {
  std::vector<size_t> with_plugin;
  for (size_t i = 0; i < r.slots.size(); ++i)
    if (r.slots[i].plugin) with_plugin.push_back(i);
  for (size_t i : with_plugin)
    for (const auto& cap : r.slots[i].plugin->contract().provides) r.plan.capabilities.insert(cap);
  std::vector<PluginDecl> decls;
  for (size_t i : with_plugin) {
    const Slot& s = r.slots[i];
    r.call_plugin(s, "configure", [&] { s.plugin->configure(r.plan.view); });
    decls.push_back({s.name, s.plugin->contract()});
  }
  std::vector<std::string> notes;
  r.order.clear();
  for (size_t k : order_plugins(decls, &notes)) r.order.push_back(with_plugin[k]);
  for (const auto& n : notes) r.warn(n);
}

/// Refuses an effective batch no machine could take (or whose product overflows).
void check_effective_batch(const Run& r) {
  const PlanValues& p = r.plan;
  int64_t effective = 0;
  if (!p.micro_batch_auto &&
      (p.accumulation < 1 || p.accumulation > kMaxCount ||
       __builtin_mul_overflow(p.micro_batch, p.accumulation, &effective) ||
       __builtin_mul_overflow(effective, p.world_size, &effective) || effective > kMaxCount))
    throw Error("the plan's effective batch (micro-batch " + std::to_string(p.micro_batch) + " x accumulation " +
                std::to_string(p.accumulation) + " x world " + std::to_string(p.world_size) +
                ") is beyond any machine (at most " + std::to_string(kMaxCount) + " examples per optimizer step)");
}

/// Each plugin's setup, in dispatch order: it may freeze, replace or add parameters.
void set_up_plugins(Run& r) {
  r.optimizer_wraps.clear();
  r.memory_lever = {};
  SetupState state{&r.dispatch, r.world.get(), &r.model, &r.plan, &r.data.info, &r.optimizer_wraps, &r.memory_lever};
  SetupContext setup = ContextAccess::setup(state);
  for (size_t i : r.order) {
    const Slot& s = r.slots[i];
    r.call_plugin(s, "setup", [&] { s.plugin->setup(setup); });
  }
}

void plan_once(Run& r) {
  r.plan.reset();
  r.world->configure(r.world_opts, r.device, r.may_join_world);
  r.plan.world_size = r.world->size();
  r.plan.rank = r.world->rank();
  r.plan.world = r.world.get();
  r.plan.micro_batch_auto = r.data_opts.get_word("micro_batch") == "auto";
  r.plan.micro_batch = r.plan.micro_batch_auto ? 0 : r.data_opts.get_int("micro_batch");
  r.plan.reduction = r.loss->reduction();
  r.plan.device = r.device.type();
  configure_plugins(r);
  if (r.plan.world_size > 1 && !r.plan.has(cap::kGradsSynced))
    throw Error("this process is rank " + std::to_string(r.plan.rank) + " of a world of " +
                std::to_string(r.plan.world_size) + " (" + r.world->describe() + "), and no plugin sums the gradients "
                "across it (" + cap::kGradsSynced + "): each rank would train its own run; add [[plugins]] name = "
                "\"ddp\"");
  settle_window(r);
  check_effective_batch(r);
  set_up_plugins(r);
  // The optimizer is made after setup, over what is trainable then.
  r.model->to(r.device, r.dtype);
  make_optimizer(r);
  pick_micro_batch(r);
  shape_windows(r);
  check_data_and_model(r);
  if (r.plan.accumulation > 1 && has_batchnorm(*r.model))
    r.warn("the model has BatchNorm and accumulates " + std::to_string(r.plan.accumulation) +
           " micro-batches per step: its statistics are computed per micro-batch of " +
           std::to_string(r.plan.micro_batch) + " examples, not per window of " +
           std::to_string(r.plan.micro_batch * r.plan.accumulation) +
           " (tk-run --verify-accumulation measures the difference)");
  r.planned = true;
}

}  // namespace

void plan_run(Run& r) {
  if (r.planned) return;
  if (!r.planning_error.empty()) throw Error("the run could not be planned: " + r.planning_error);
  try {
    plan_once(r);
  } catch (const std::exception& e) {
    r.planning_error = e.what();
    throw;
  }
}


void settle_window(Run& r) {
  PlanValues& p = r.plan;
  const int64_t goal = p.effective_batch_goal, world = p.world_size;
  const bool m_given = r.data_opts.is_set("micro_batch") && !p.micro_batch_auto;
  if (goal < 0 || goal > kMaxCount)
    refuse_window(r, "effective_batch", "an effective batch of " + std::to_string(goal) + " is beyond any machine (at most " +
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
    refuse_window(r, "effective_batch", three + ": the effective batch does not divide evenly over the " +
                                     std::to_string(world) + " ranks");
  const int64_t per_rank = goal / world;
  if (p.micro_batch_auto) {
    if (p.accumulation > 0)
      refuse_window(r, "steps", three + ": with micro_batch = \"auto\" the steps follow from the micro-batch picked; remove steps");
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
  // A window cut at every epoch's end would never take the step the plan says.
  if (r.plan.accumulation > r.batches_per_epoch && r.plan.last_window != LastWindow::Carry)
    refuse_window(r, r.plan.effective_batch_goal > 0 ? "effective_batch" : "steps",
                  "an optimizer step of " + std::to_string(r.plan.accumulation) + " micro-batches of " +
                      std::to_string(m) + " (" + std::to_string(r.plan.effective_batch()) +
                      " examples) is more than an epoch holds (" + std::to_string(r.batches_per_epoch) +
                      " micro-batches, " + std::to_string(n) + " examples" + (r.plan.world_size > 1 ? " per rank" : "") +
                      "): every step would be cut at the epoch's end; ask for a smaller step, or set last_window = "
                      "\"carry\" so that a window spans epochs");
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

void refuse_window(const Run& r, const std::string& key, const std::string& what) {
  for (const auto& s : r.slots)
    if (s.plugin && s.name == r.plan.window_owner && s.plugin->options().has(key)) s.plugin->options().fail(key, what);
  throw Error(what);
}

int64_t backed_off_micro_batch(const Run& r) {
  const int64_t m = r.plan.micro_batch, per_rank = m * r.plan.accumulation;
  int64_t best = 0;
  for (int64_t d : divisors_of(per_rank))
    if (2 * d <= m) best = d;
  return best;
}

}  // namespace tk::detail
