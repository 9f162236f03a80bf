// What a run writes: the output folder, its metrics records, checkpoints, weights and trace.
#include <sys/resource.h>
#include <unistd.h>

#include <ctime>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

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
      .add("effective_batch", ctx.totals_.samples)
      .add("samples", ctx.counters_.samples_seen)
      .add("tokens", ctx.counters_.tokens_seen)
      .add("wall_time", wall_time)
      .add("peak_rss_mib", peak_rss_mib())
      .add("host_reads", ctx.host_reads_);
  if (skipped) line.add("skipped", ctx.vetoed_by_ + ": " + ctx.veto_reason_);
  for (const auto& [k, v] : ctx.metrics_) line.add(k, v);
  return line;
}

fs::path output_dir_of(const Run& run) {
  const std::string& o = run.run.get_string("output");
  return o.empty() ? fs::path("runs") / run.run.get_string("name") : fs::path(o);
}

RunOutputs::RunOutputs(const Run& run, const Recipe& recipe, const TrainerOptions& opts)
    : resuming_(opts.resume.has_value()), overwrite_(opts.overwrite), recipe_(recipe) {
  dir_ = output_dir_of(run);
  active_ = opts.write_outputs && run.plan.rank == 0;  // one rank writes for the world
  identity_ = run_identity(run, recipe);
}

namespace {

/// What of a run a folder holds: the files trainkit writes there that make up a run.
std::vector<std::string> run_files_in(const fs::path& dir) {
  std::vector<std::string> found;
  std::error_code ec;
  if (fs::file_size(dir / "metrics.jsonl", ec) > 0 && !ec) found.push_back("metrics.jsonl");
  if (fs::exists(dir / "weights.pt", ec)) found.push_back("weights.pt");
  if (fs::is_directory(dir / "checkpoints", ec) && !fs::is_empty(dir / "checkpoints", ec)) found.push_back("checkpoints/");
  return found;
}

}  // namespace

void RunOutputs::claim() {
  if (!active_) return;
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) throw Error("cannot create output folder '" + dir_.string() + "': " + ec.message());
  lock_.acquire(dir_);
  if (resuming_) return;
  const auto found = run_files_in(dir_);
  if (found.empty()) return;
  if (!overwrite_)
    throw RunRefused("the output folder '" + dir_.string() + "' holds another run (" +
                join(found.data(), found.data() + found.size()) +
                "): continue it with --resume latest, replace it with --overwrite, or give this run another "
                "run.output");
  spdlog::warn("--overwrite: deleting the run in '{}' ({})", dir_.string(), join(found.data(), found.data() + found.size()));
  for (const char* f : {"metrics.jsonl", "weights.pt", "trace.jsonl", "recipe.toml", "status.json", "report.html", "checkpoints"}) {
    fs::remove_all(dir_ / f, ec);
    if (ec) throw Error("cannot delete '" + (dir_ / f).string() + "': " + ec.message());
  }
}

void RunOutputs::open(const std::optional<Checkpoint>& resumed) {
  if (!active_) return;
  write_atomic(dir_ / "recipe.toml", recipe_.resolved());
  const fs::path file = dir_ / "metrics.jsonl";
  if (resumed) {  // keep the records up to the checkpoint, drop any written after it
    std::ifstream in(file);
    std::string kept;
    for (std::string line; std::getline(in, line);) {
      const auto record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (record.is_discarded() || !record.is_object()) continue;  // a line torn by a full disk
      const auto step = record.find("step");
      if (step == record.end() || !step->is_number_integer() || step->get<int64_t>() <= resumed->position.counters.step)
        kept += line + "\n";
    }
    write_atomic(file, kept);
    metrics_.open(file, /*truncate=*/false);
  } else {
    metrics_.open(file, /*truncate=*/true);
  }
}

void RunOutputs::record(const JsonLine& line) {
  if (!metrics_.is_open()) return;
  metrics_.append(line.str());
  fault_point("metrics-written");
}

fs::path RunOutputs::checkpoint(Run& run, const Counters& counters, int64_t epoch, int64_t b) {
  TrainingPosition pos{counters, epoch, b + 1, run.plan.micro_batch};
  if (pos.next_batch >= run.batches_per_epoch ||
      !run.windows->start(epoch, pos.next_batch, counters.step, counters.samples_seen * run.plan.world_size)) {
    pos.next_epoch = epoch + 1;
    pos.next_batch = 0;
  }
  std::vector<std::pair<std::string, StateDict>> states;
  for (const auto& slot : run.slots)
    if (slot.plugin) states.emplace_back(slot.name, slot.plugin->state());
  metrics_.sync();  // a checkpoint never gets ahead of the records of the steps it holds
  return save_checkpoint(dir_ / "checkpoints", *run.model, *run.optimizer, states, pos, identity_,
                         run.run.get_int("checkpoint_keep"));
}

void RunOutputs::write_weights(const Run& run) const {
  if (!active_) return;
  NamedTensors tensors;
  for (const auto& p : run.model->named_parameters()) tensors.emplace_back(p.key(), p.value());
  for (const auto& b : run.model->named_buffers()) tensors.emplace_back(b.key(), b.value());
  save_tensor_dict(dir_ / "weights.pt", tensors);
}

bool RunOutputs::has_weights() const { return fs::exists(dir_ / "weights.pt"); }

void RunOutputs::status(const char* state, int64_t step, const std::string& detail) const {
  if (!active_) return;
  nlohmann::json s = {{"status", state}, {"step", step}, {"pid", static_cast<int64_t>(getpid())},
                      {"time", static_cast<int64_t>(std::time(nullptr))}};
  if (!detail.empty()) s["detail"] = detail;
  write_atomic(dir_ / "status.json", s.dump() + "\n");
}

void RunOutputs::finish(const Run& run, const std::vector<TraceEntry>& trace) {
  if (!active_) return;
  metrics_.sync();
  metrics_.close();
  write_weights(run);
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
