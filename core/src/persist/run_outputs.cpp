// What a run writes: the output folder, its metrics records, checkpoints, weights and trace.
#include <unistd.h>

#include <algorithm>
#include <ctime>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "assemble/assemble.h"
#include "persist/persist.h"
#include "planning/planning.h"
#include "support/support.h"
#include "tk/sharded_state.h"
#include "tk/tensor_io.h"

namespace fs = std::filesystem;

namespace tk::detail {
namespace {

/// `dir` as its parents are walked up from: "runs/x/" is "runs/x" (whose parent is "runs").
fs::path without_trailing_slash(const fs::path& dir) {
  fs::path p = dir.lexically_normal();
  return p.has_filename() || !p.has_parent_path() ? p : p.parent_path();
}

/// The whole text of `file` ("" when it cannot be read).
std::string text_of(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

/// A resolved recipe's text (as to_toml writes it: one `key = value` a line under its section) without
/// what does not change what the run trains: its first line, which says where the recipe was read
/// from (another spelling of its path changes it), and the keys a resume may change (run.log_every).
std::string what_trains(const std::string& resolved) {
  std::istringstream in(resolved);
  std::string line, section, out;
  std::getline(in, line);
  while (std::getline(in, line)) {
    if (!line.empty() && line.front() == '[') section = line.substr(1, line.find(']') - 1);
    const size_t eq = line.find(" = ");
    if (eq != std::string::npos && may_change_on_resume(section + "." + line.substr(0, eq))) continue;
    out += line + '\n';
  }
  return out;
}

}  // namespace

fs::path output_dir_of(const Run& run) {
  const std::string& o = run.run.get_string("output");
  return o.empty() ? fs::path("runs") / run.run.get_string("name") : fs::path(o);
}

RunOutputs::RunOutputs(const Run& run, const Recipe& recipe, const TrainerOptions& opts)
    : resuming_(opts.resume.has_value() && *opts.resume != "auto"),
      auto_(opts.resume.has_value() && *opts.resume == "auto"),
      overwrite_(opts.overwrite),
      recipe_(recipe),
      resolved_(run.resolved) {
  named_ = resuming_ && *opts.resume != "latest";  // a checkpoint folder given by hand
  dir_ = output_dir_of(run);
  const char* key = run.run.get_string("output").empty() ? "name" : "output";
  where_ = run.run.where(key).str() + ": run." + key;
  writes_ = opts.write_outputs;
  active_ = writes_ && run.plan.rank == 0;  // one rank writes for the world
  identity_ = run_identity(run);
}

RunOutputs::~RunOutputs() {
  if (made_.empty()) return;
  std::error_code ec;
  for (fs::directory_iterator it(dir_, ec), end; !ec && it != end; it.increment(ec))
    if (it->path().filename() != ".tk-lock") return;  // the run wrote something: it stays
  if (ec) return;
  // Unlinked while held: a run that opened it finds it taken, a later one makes its own.
  fs::remove(dir_ / ".tk-lock", ec);
  lock_.release();
  for (fs::path p = without_trailing_slash(dir_); fs::remove(p, ec) && p != made_; p = p.parent_path()) {
  }
}

void RunOutputs::claim() {
  if (!active_) return;
  std::error_code ec;
  fs::path made;
  for (int tries = 0;; ++tries) {
    made.clear();
    for (fs::path p = without_trailing_slash(dir_); !p.empty() && !fs::exists(p, ec); p = p.parent_path()) made = p;
    fs::create_directories(dir_, ec);
    // Refused before anything is written: no folder, nothing of the run in it.
    if (ec) throw RunRefused(where_ + ": cannot create the output folder '" + dir_.string() + "': " + ec.message());
    try {
      lock_.acquire(dir_);
      break;
    } catch (const RunRefused&) {
      throw;  // in use: what this run made is another's now
    } catch (const Error&) {
      if (tries == 3 || fs::exists(dir_, ec)) throw;  // not a folder a refused run just gave up
    }
  }
  made_ = made;  // given up again by the destructor only once this run holds it
  if (!resuming_ && !auto_) clear_for_new_run(false);
}

void RunOutputs::start_afresh() {
  if (active_) clear_for_new_run(true);
}

void RunOutputs::refuse_unfinished_checkpoints() const {
  // A checkpoint folder that is not complete (a damaged one, or a file system that failed to list
  // it) is never taken for "no checkpoint": starting over would delete it.
  std::error_code ec;
  std::vector<std::string> found;
  for (fs::directory_iterator it(dir_ / "checkpoints", ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind("step-", 0) == 0 && it->path().extension() != ".tmp") found.push_back(name);
  }
  if (ec && ec != std::errc::no_such_file_or_directory)
    throw Error("cannot list '" + (dir_ / "checkpoints").string() + "': " + ec.message());
  if (!found.empty())
    throw RunRefused("--resume auto: '" + (dir_ / "checkpoints").string() + "' holds " +
                     join(found.data(), found.data() + found.size()) + " and none is a complete checkpoint; move "
                     "them away to start the run over, or resume one of them by its folder");
}

void RunOutputs::clear_for_new_run(bool same_run_may_restart) {
  const FolderSurvey found = survey_folder(dir_);
  auto listed = [](const std::vector<std::string>& v) { return join(v.data(), v.data() + v.size()); };
  std::error_code ec;
  if (!found.foreign.empty())
    throw RunRefused("the output folder '" + dir_.string() + "' holds files trainkit did not write where it writes (" +
                     listed(found.foreign) + "): trainkit never writes over them nor deletes them, with or without "
                     "--overwrite; move them, or give this run another run.output");
  if (found.run.empty()) {
    for (const auto& p : found.deletable) fs::remove_all(p, ec);  // what is left of no run: nothing to keep
    fs::remove(dir_ / "checkpoints", ec);
    return;
  }
  // A start of this very recipe that wrote no checkpoint yet: its records are trained again, the same.
  const bool same_run = same_run_may_restart && what_trains(text_of(dir_ / "recipe.toml")) ==
                                                    what_trains(resolved_.toml(recipe_.source()));
  if (same_run) refuse_unfinished_checkpoints();
  if (same_run)
    spdlog::info("--resume auto: '{}' holds no checkpoint of this run yet; starting it again from step 0",
                 dir_.string());
  else if (same_run_may_restart)
    throw RunRefused("the output folder '" + dir_.string() + "' holds another run (" + listed(found.run) +
                     ") and no checkpoint: --resume auto continues only a run of this same recipe, and its "
                     "recipe.toml differs from this run's; give this run another run.output, or start over with "
                     "--overwrite");
  else if (!overwrite_)
    throw RunRefused("the output folder '" + dir_.string() + "' holds another run (" + listed(found.run) +
                     "): continue it with --resume latest, replace it with --overwrite, or give this run another "
                     "run.output");
  else
    spdlog::warn("--overwrite: deleting the run in '{}' ({})", dir_.string(), listed(found.run));
  // Its files only, each as the survey found it, files.json last: a failed deletion leaves the rest listed.
  for (const auto& p : found.deletable) {
    fs::remove_all(p, ec);
    if (ec) throw Error("cannot delete '" + p.string() + "': " + ec.message());
  }
  fs::remove(dir_ / "checkpoints", ec);  // empty now: anything else there was refused above
}

Manifest& RunOutputs::manifest() const {
  if (!manifest_loaded_) {
    manifest_ = load_manifest();
    manifest_loaded_ = true;
  }
  return manifest_;
}

void RunOutputs::own(const std::string& file) const {
  manifest();
  if (std::find(manifest_.core.begin(), manifest_.core.end(), file) != manifest_.core.end()) return;
  manifest_.core.push_back(file);
  write_manifest(dir_, manifest_);  // listed before it is written: never a file of nobody's
}

void RunOutputs::open(const std::optional<Checkpoint>& resumed) {
  if (!active_) return;
  own("recipe.toml");
  own("metrics.jsonl");
  write_atomic(dir_ / "recipe.toml", resolved_.toml(recipe_.source()));
  wrote("recipe.toml");
  wrote("metrics.jsonl");
  const fs::path file = dir_ / "metrics.jsonl";
  if (resumed) {  // keep the records up to the checkpoint, drop any written after it
    std::ifstream in(file);
    std::string kept;
    int64_t last = 0;
    for (std::string line; std::getline(in, line);) {
      const auto record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (record.is_discarded() || !record.is_object()) continue;  // a line torn by a full disk
      const auto step = record.find("step");
      const bool counted = step != record.end() && step->is_number_integer();
      if (counted) last = std::max(last, step->get<int64_t>());
      if (!counted || step->get<int64_t>() <= resumed->position.counters.step) kept += line + "\n";
    }
    // Resumed from a checkpoint picked by hand behind a later one: what came after it is trained
    // again, and its records go. Said, as it drops what the folder held. (Records after the
    // checkpoint "latest" names, of a run killed between two, go without a word: they are trained
    // again alike.)
    int64_t later = 0;
    std::error_code ec;
    for (fs::directory_iterator it(dir_ / "checkpoints", ec), end; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      const bool step = name.rfind("step-", 0) == 0 && name.size() > 5 && name.size() < 23;
      if (step && name.find_first_not_of("0123456789", 5) == std::string::npos)
        later = std::max<int64_t>(later, std::stoll(name.substr(5)));
    }
    if (named_ && later > resumed->position.counters.step && last > resumed->position.counters.step)
      spdlog::warn("{} is at step {}; the run had recorded up to step {}: its records of steps {} to {} are dropped from "
                   "metrics.jsonl, and its later checkpoints replaced as it trains them again",
                   resumed->dir.string(), resumed->position.counters.step, last, resumed->position.counters.step + 1, last);
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

fs::path RunOutputs::checkpoint(Run& run, const Counters& counters, const WorldSeen& seen, int64_t epoch, int64_t b) {
  TrainingPosition pos{counters, epoch, b + 1, run.plan.micro_batch, run.plan.accumulation, run.plan.world_size, seen};
  if (pos.next_batch >= run.batches_per_epoch || !run.windows->start(epoch, pos.next_batch, counters.step, seen.samples)) {
    pos.next_epoch = epoch + 1;
    pos.next_batch = 0;
  }
  std::vector<std::pair<std::string, StateDict>> states;
  const std::string hook = "state, for the checkpoint of step " + std::to_string(counters.step);
  for (const auto& slot : run.slots)
    if (slot.plugin) run.call_plugin(slot, hook.c_str(), [&] { states.emplace_back(slot.name, slot.plugin->state()); });
  // A failure here with an optimizer sharded over the ranks is the checkpoint's: the other ranks
  // are writing their shares of it, and learn of it there rather than wait.
  std::string failed;
  try {
    metrics_.sync();  // a checkpoint never gets ahead of the records of the steps it holds
    own("checkpoints");
  } catch (const std::exception& e) {
    if (!dynamic_cast<const ShardedState*>(run.optimizer.get())) throw;
    failed = message_of(e);
  }
  return save_checkpoint(dir_ / "checkpoints", *run.model, *run.optimizer, *run.world, states, pos, identity_,
                         run.run.get_int("checkpoint_keep"), failed);
}

void RunOutputs::wrote(const std::string& file) {
  if (std::find(written_.begin(), written_.end(), file) == written_.end()) written_.push_back(file);
}

void RunOutputs::write_weights(const Run& run) {
  const auto* sharded = dynamic_cast<const ShardedParameters*>(run.optimizer.get());
  if (sharded && !sharded->parameters_whole()) {  // a run that failed mid-step: its peers may be gone
    spdlog::warn("weights.pt and weights.safetensors are not written: the parameters are sharded over the ranks and "
                 "the run ended before they were gathered; its last checkpoint holds them");
    return;
  }
  own("weights.pt");
  own("weights.safetensors");
  NamedTensors tensors;
  for (const auto& p : run.model->named_parameters()) tensors.emplace_back(p.key(), p.value());
  for (const auto& b : run.model->named_buffers()) tensors.emplace_back(b.key(), b.value());
  save_tensor_dict(dir_ / "weights.pt", tensors);
  wrote("weights.pt");
  // What the model was built for, so that it can be built again without its data (tk-sample).
  const DataInfo& info = run.data.info;
  std::string shape;
  for (int64_t d : info.input_shape) shape += (shape.empty() ? "" : ",") + std::to_string(d);
  const Metadata meta = {{"trainkit.vocab", std::to_string(info.vocab)},
                         {"trainkit.input_shape", shape},
                         {"trainkit.next_token", info.next_token ? "true" : "false"}};
  save_safetensors(dir_ / "weights.safetensors", tensors, meta);
  wrote("weights.safetensors");
}

void RunOutputs::record_plugin_file(const std::string& plugin, const std::string& file) {
  const std::string why = OutputFiles::name_error(file);
  if (!why.empty()) throw Error(why);
  manifest();
  for (const auto& [other, list] : manifest_.plugins)
    if (other != plugin && std::find(list.begin(), list.end(), file) != list.end())
      throw Error("'" + file + "' is plugin '" + other + "''s file in " + dir_.string());
  auto& mine = manifest_.plugins[plugin];
  if (std::find(mine.begin(), mine.end(), file) == mine.end()) {
    std::error_code ec;
    if (fs::exists(fs::symlink_status(dir_ / file, ec)))  // there before this run, and no run's
      throw RunRefused("'" + (dir_ / file).string() + "' is a file trainkit did not write (files.json does not list "
                       "it), where plugin '" + plugin + "' writes its '" + file + "': trainkit never writes over "
                       "it; move it away and run again with --resume latest, which writes what is missing");
    mine.push_back(file);
    write_manifest(dir_, manifest_);  // listed before it exists: never a file of nobody's
  }
  wrote(file);
}

Manifest RunOutputs::load_manifest() const {
  std::string damaged;
  auto m = read_manifest(dir_, &damaged);
  if (!damaged.empty())
    throw Error(damaged + "; it lists the files of this run: repair it, or delete it and the files it listed");
  return m.value_or(Manifest{});
}

void RunOutputs::write_plugin_files(Run& run, bool only_missing) {
  FilesState state{&run.dispatch, run.model.get(), &run.plan, dir_,
                   [this](const std::string& plugin, const std::string& file) { record_plugin_file(plugin, file); }};
  OutputFiles files = ContextAccess::files(state);
  manifest();
  for (size_t i : run.order) {
    const Slot& slot = run.slots[i];
    const auto it = manifest_.plugins.find(slot.name);
    if (only_missing && it != manifest_.plugins.end() &&
        std::all_of(it->second.begin(), it->second.end(), [&](const auto& f) { return fs::exists(dir_ / f); }))
      continue;  // it wrote its files, and they are all there
    run.call_plugin(slot, "write_files", [&] { slot.plugin->write_files(files); });
    if (!manifest_.plugins.count(slot.name)) {  // it wrote none: recorded, so that a resume does not ask again
      manifest_.plugins[slot.name] = {};
      write_manifest(dir_, manifest_);
    }
  }
}

void RunOutputs::complete_again(Run& run) {
  if (!active_) return;
  manifest();
  if (!fs::exists(dir_ / "weights.pt") || !fs::exists(dir_ / "weights.safetensors")) write_weights(run);
  write_plugin_files(run, /*only_missing=*/true);
}

void RunOutputs::status(const char* state, int64_t step, const std::string& detail) const {
  if (!active_) return;
  nlohmann::json s = {{"status", state}, {"step", step}, {"pid", static_cast<int64_t>(getpid())},
                      {"time", static_cast<int64_t>(std::time(nullptr))}};
  if (!detail.empty()) s["detail"] = detail;
  own("status.json");
  write_atomic(dir_ / "status.json", s.dump() + "\n");
}

std::string RunOutputs::recorded_status() const {
  std::ifstream in(dir_ / "status.json");
  const auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  return j.is_object() && j.contains("status") && j["status"].is_string() ? j["status"].get<std::string>() : "";
}

void RunOutputs::finish(Run& run, const std::vector<TraceEntry>& trace, bool completed) {
  if (!active_) return;
  metrics_.sync();
  metrics_.close();
  write_weights(run);
  if (completed) write_plugin_files(run, /*only_missing=*/false);
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
  own("trace.jsonl");
  write_atomic(dir_ / "trace.jsonl", text);
  wrote("trace.jsonl");
}

}  // namespace tk::detail
