// What a run writes: the output folder, its metrics records, checkpoints, weights and trace.
#include <sys/resource.h>

#include "run.h"
#include "tk/tensor_io.h"

namespace fs = std::filesystem;

namespace tk::detail {

double peak_rss_mib() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / 1024.0;
}

std::string fmt_loss(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

JsonLine step_record(const LoopContext& ctx, int64_t epoch, bool skipped, double wall_time) {
  JsonLine line;
  line.add("step", ctx.counters_.step)
      .add("epoch", epoch)
      .add("loss", ctx.window_loss_)
      .add("lr", ctx.lr_)
      .add("micro_batches", ctx.totals_.micro_batches)
      .add("samples", ctx.counters_.samples_seen)
      .add("tokens", ctx.counters_.tokens_seen)
      .add("wall_time", wall_time)
      .add("peak_rss_mib", peak_rss_mib());
  if (skipped) line.add("skipped", ctx.vetoed_by_ + ": " + ctx.veto_reason_);
  for (const auto& [k, v] : ctx.metrics_) line.add(k, v);
  return line;
}

RunOutputs::RunOutputs(const Run& run, const TrainerOptions& opts) {
  const std::string& o = run.run.get_string("output");
  dir_ = o.empty() ? fs::path("runs") / run.run.get_string("name") : fs::path(o);
  active_ = opts.write_outputs && run.plan.rank == 0;  // one rank writes for the world
}

void RunOutputs::open(const Recipe& recipe, const std::optional<Checkpoint>& resumed) {
  if (!active_) return;
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) throw Error("cannot create output folder '" + dir_.string() + "': " + ec.message());
  write_atomic(dir_ / "recipe.toml", recipe.resolved());
  const fs::path file = dir_ / "metrics.jsonl";
  if (resumed) {  // keep the records up to the checkpoint, drop any written after it
    std::ifstream in(file);
    std::string kept;
    for (std::string line; std::getline(in, line);) {
      const auto pos = line.find("\"step\": ");
      if (pos != std::string::npos && std::stoll(line.substr(pos + 8)) <= resumed->position.counters.step)
        kept += line + "\n";
    }
    write_atomic(file, kept);
    metrics_.open(file, std::ios::app);
  } else {
    metrics_.open(file, std::ios::trunc);
  }
  if (!metrics_) throw Error("cannot write '" + file.string() + "'");
}

void RunOutputs::record(const JsonLine& line) {
  if (!metrics_.is_open()) return;
  metrics_ << line.str() << '\n';
  metrics_.flush();
  if (!metrics_) throw Error("cannot write '" + (dir_ / "metrics.jsonl").string() + "' (disk full?)");
}

void RunOutputs::flush() {
  if (metrics_.is_open()) metrics_.flush();
}

fs::path RunOutputs::checkpoint(Run& run, const Counters& counters, int64_t epoch, int64_t b) const {
  TrainingPosition pos{counters, epoch, b + 1};
  if (pos.next_batch >= run.batches_per_epoch || !run.windows->at(epoch, pos.next_batch)) {
    pos.next_epoch = epoch + 1;
    pos.next_batch = 0;
  }
  std::vector<std::pair<std::string, StateDict>> states;
  for (const auto& slot : run.slots)
    if (slot.plugin) states.emplace_back(slot.name, slot.plugin->state());
  return save_checkpoint(dir_ / "checkpoints", *run.model, *run.optimizer, states, pos,
                         run.run.get_int("checkpoint_keep"));
}

void RunOutputs::finish(const Run& run, const std::vector<TraceEntry>& trace) const {
  if (!active_) return;
  NamedTensors tensors;
  for (const auto& p : run.model->named_parameters()) tensors.emplace_back(p.key(), p.value());
  for (const auto& b : run.model->named_buffers()) tensors.emplace_back(b.key(), b.value());
  save_tensor_dict(dir_ / "weights.pt", tensors);
  if (!run.tracing) return;
  std::string text;
  for (const auto& e : trace)
    text += JsonLine()
                .add("plugin", e.plugin)
                .add("event", std::string(to_string(e.event)))
                .add("step", e.step)
                .add("micro_step", e.micro_step)
                .str() +
            "\n";
  write_atomic(dir_ / "trace.jsonl", text);
}

}  // namespace tk::detail
