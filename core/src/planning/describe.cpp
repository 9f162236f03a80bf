// The printed plan of a run: what `tk-run --dry-run` shows.
#include <algorithm>
#include <sstream>

#include "assemble/assemble.h"
#include "engine/engine.h"
#include "planning/planning.h"

namespace tk::detail {
namespace {

/// Said of a schedule whose rate still rises at the run's last step, short of the optimizer's: a
/// warmup longer than the run, most likely (in the plan only: a short trial run of a recipe has
/// one, and does nothing wrong).
std::string rising_note(const Run& d) {
  const int64_t n = d.total_steps;
  if (n < 2 || !d.schedule) return "";
  const double last = d.schedule->lr(n - 1, n), before = d.schedule->lr(n - 2, n);
  if (!(last > before && last < d.base_lr)) return "";
  const std::string to = fmt_loss(last) != fmt_loss(d.base_lr) ? fmt_loss(last) : to_toml(last);  // never "to 0.003 of 0.003"
  return "; its rate still rises at the last step, to " + to + " of the optimizer's " + to_toml(d.base_lr) +
         " (a warmup longer than the run's " + std::to_string(n) + " steps?)";
}

}  // namespace

std::string describe(Run& d, const Recipe& recipe) {
  plan_run(d);
  std::ostringstream out;
  int64_t params = 0, trainable = 0;
  for (const auto& p : distinct_tensors(d.model->parameters())) {
    params += p.numel();
    if (p.requires_grad()) trainable += p.numel();
  }
  const auto& p = d.plan;
  const std::string files = model_files(d);
  out << "recipe        " << recipe.source() << "\n"
      << "model         " << d.model_name << " (" << params << " parameters"
      << (trainable != params ? ", " + std::to_string(trainable) + " trainable" : "") << ", "
      << d.run.get_string("dtype") << ", on " << d.device.str() << ")"
      << (files.empty() ? "" : ", read from " + files) << "\n"
      << "data          " << d.data_name << ": " << d.data.train->size() << " training examples";
  if (d.data.validation) out << ", " << d.data.validation->size() << " validation";
  out << "; " << d.data.info.describe();
  if (!d.data.info.baseline_name.empty())
    out << "; " << d.data.info.baseline_name << " baseline loss " << fmt_loss(d.data.info.baseline_loss);
  out << "\n"
      << "loss          " << d.loss_name << " (reduction " << to_string(p.reduction) << ")\n"
      << "optimizer     " << d.opt_name << " (lr " << to_toml(d.base_lr) << ")\n"
      << "schedule      " << d.sched_name << ", advanced once per optimizer step" << rising_note(d) << "\n"
      << "micro-batch   " << p.micro_batch << " examples per rank, " << d.batches_per_epoch
      << (d.batches_per_epoch == 1 ? " micro-batch per epoch" : " micro-batches per epoch")
      << (p.world_size > 1 ? " (each rank reads " + std::to_string(d.shard_size()) + " examples per epoch)" : "")
      << "\n";
  if (p.micro_batch_auto) {
    out << "              picked by memory (budget " << (p.memory_budget > 0 ? format_bytes(p.memory_budget) : "the GPU's free memory")
        << "); peak of a training step measured at";
    for (const auto& [m, bytes] : p.measured_peaks) out << " " << m << ": " << format_bytes(bytes) << (m == p.micro_batch ? " (picked)" : "") << ";";
    out << "\n";
    if (p.memory_level >= 0)
      out << "              with " << p.memory_level << " " << p.memory_lever_what << ", picked with it by plugin '"
          << p.memory_lever_owner << "'\n";
    if (p.world_size > 1 && !d.world->joined())
      out << "              (measured by this rank alone, without the other ranks' collectives: the run itself "
             "measures with every rank and may pick less)\n";
  }
  out << "accumulation  " << p.accumulation << (p.accumulation == 1 ? " micro-batch" : " micro-batches")
      << " per step (last window: " << to_string(p.last_window)
      << (p.window_owner.empty() ? "" : ", set by plugin " + p.window_owner + " (deprecated: [batch])") << ")"
      << (p.accumulation > d.batches_per_epoch ? "; a window spans epochs (" + std::to_string(d.batches_per_epoch) +
                                                     " micro-batches per epoch)"
                                               : std::string())
      << "\n"
      << "world         " << d.world->describe() << "\n"
      << "effective     " << p.effective_batch() << " examples per optimizer step (" << p.micro_batch << " x "
      << p.accumulation << " x " << p.world_size << ")"
      << (p.world_size > 1 ? "; " + std::to_string(p.micro_batch * p.accumulation) + " per rank" : "")
      << (p.effective_batch_goal > 0 ? "; as asked (effective_batch)" : "") << "\n";
  if (p.ramp.active()) {
    const int64_t unit = p.micro_batch * p.world_size;
    out << "ramp          effective batch " << std::max(unit, p.ramp.from / unit * unit) << " -> " << p.effective_batch()
        << " over the first " << p.ramp.over << (p.ramp.by_samples ? " examples" : " optimizer steps") << " ("
        << d.windows->size_at(0, 0) << " -> " << p.accumulation << " micro-batches per step, in steps of " << unit
        << " examples)\n";
  }
  out << "state         " << describe_state(d) << "\n"
      << "steps         " << d.total_steps << " optimizer steps"
      << (d.bound.by_steps() ? "" : " (" + std::to_string(d.bound.count) + " epochs)") << "\n"
      << "plugins       " << (d.order.empty() ? "(none)" : "in dispatch order:") << "\n";
  int i = 1;
  for (size_t idx : d.order) {
    const Slot& s = d.slots[idx];
    out << "  " << i++ << ". " << s.name << " " << s.version << "  " << s.file << "\n";
    const Options& o = s.plugin->options();
    for (const auto& [k, v] : o.values())
      if (const OptionSpec* spec = o.spec(k); !spec || !spec->retired)  // as recipe.toml: an earlier version's option is no setting
        out << "       " << k << " = " << to_toml(v) << "\n";
  }
  for (const auto& s : d.slots)
    if (!s.plugin) out << "libraries     " << s.name << " " << s.version << "  " << s.file << " (components only)\n";
  for (const auto& w : d.warnings) out << "warning       " << w << "\n";
  return out.str();
}

}  // namespace tk::detail
