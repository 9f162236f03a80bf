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
  for (const auto& [plugin, cap] : provided(r)) r.plan.capabilities.insert(cap.name());
  std::vector<PluginDecl> decls;
  for (size_t i : with_plugin) {
    const Slot& s = r.slots[i];
    r.call_plugin(s, "configure", [&] { s.plugin->configure(r.plan.view); });
    decls.push_back({s.name, s.plugin->contract(), s.plugin->options().section_loc()});
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

/// A window of several micro-batches of a mean loss adds up k means: a plugin must divide them
/// (grads.normalized) for the step to be the big batch's. A sum loss needs none.
void check_normalized(const Run& r) {
  const PlanValues& p = r.plan;
  if ((p.accumulation > 1 || p.ramp.active()) && p.reduction == Reduction::Mean && !p.has(cap::kGradsNormalized))
    refuse_window(r, p.effective_batch_goal > 0 ? "effective_batch" : "accumulation",
                  std::to_string(p.accumulation) + " micro-batches per step of a mean loss need a plugin that "
                  "normalizes the window's gradient (one that provides " + cap::kGradsNormalized.name() + "; tk-run --list "
                  "shows the plugins): without one the step would take the sum of " + std::to_string(p.accumulation) +
                  " means");
}

void plan_once(Run& r) {
  r.plan.reset();
  // The world, from the launcher's environment: read when the run is planned, never by a launcher
  // that only asks what the plugins provide.
  if (!r.world) r.world = std::make_unique<ProcessWorld>(placement_from_environment());
  r.world->configure(r.world_opts, r.device, r.may_join_world);
  r.world->stop_waiting_when(r.stop_requested);
  r.plan.world_size = r.world->size();
  r.plan.rank = r.world->rank();
  r.plan.world = r.world.get();
  read_batch(r);
  r.plan.reduction = r.loss->reduction();
  r.plan.device = r.device.type();
  configure_plugins(r);
  if (r.plan.world_size > 1 && !r.plan.has(cap::kGradsSynced))
    throw Error("this process is rank " + std::to_string(r.plan.rank) + " of a world of " +
                std::to_string(r.plan.world_size) + " (" + r.world->describe() + "), and no plugin sums the gradients "
                "across it (" + cap::kGradsSynced.name() + "): each rank would train its own run; add a data-parallel plugin "
                "to [[plugins]] (tk-run --list shows those found)");
  settle_window(r);
  check_effective_batch(r);
  set_up_plugins(r);
  // The optimizer is made after setup, over what is trainable then.
  r.model->to(r.device, r.dtype);
  make_optimizer(r);
  check_state_fits(r);
  pick_micro_batch(r);
  CpuBlockCache::trim();  // a trial's larger blocks are not training's
  check_normalized(r);
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


}  // namespace tk::detail
