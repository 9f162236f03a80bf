// What a run writes: the output folder, its metrics records, checkpoints, weights and trace.
#include <unistd.h>

#include <algorithm>
#include <ctime>
#include <map>
#include <set>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "run.h"
#include "tk/tensor_io.h"

namespace fs = std::filesystem;

namespace tk::detail {

fs::path output_dir_of(const Run& run) {
  const std::string& o = run.run.get_string("output");
  return o.empty() ? fs::path("runs") / run.run.get_string("name") : fs::path(o);
}

RunOutputs::RunOutputs(const Run& run, const Recipe& recipe, const TrainerOptions& opts)
    : resuming_(opts.resume.has_value()), overwrite_(opts.overwrite), recipe_(recipe), resolved_(run.resolved) {
  dir_ = output_dir_of(run);
  active_ = opts.write_outputs && run.plan.rank == 0;  // one rank writes for the world
  identity_ = run_identity(run);
}

namespace {

constexpr const char* kManifest = "files.json";  // the plugins' files: {"plugins": {name: [file, ...]}}
/// The files the core writes into an output folder (a plugin's file may not take one's name).
const std::set<std::string> kCoreFiles = {"recipe.toml", "metrics.jsonl", "weights.pt", "trace.jsonl", "status.json",
                                          "report.html", "checkpoints", kManifest, ".tk-lock"};

/// Why `file` cannot be a plugin's file name, or "".
std::string bad_file_name(const std::string& file) {
  if (file.empty() || file == "." || file == "..") return "is not a file name";
  if (file.find('/') != std::string::npos || file.find('\0') != std::string::npos)
    return "is not a plain file name (no folders: the file goes into the output folder)";
  if (file.front() == '.') return "starts with a dot (hidden names are the core's)";
  if (kCoreFiles.count(file) || file.rfind("recipe.toml", 0) == 0) return "is one of the core's files";
  if (file.size() > 4 && file.compare(file.size() - 4, 4, ".tmp") == 0) return "ends with .tmp (the core's partial files)";
  return "";
}

/// The plugins' files as files.json records them, by plugin (a plugin that wrote none has an empty
/// list). nullopt when there is no files.json; `damaged` says why when it cannot be read, and then
/// only the names that pass bad_file_name are kept (a damaged or hand-edited list can never name a
/// core file, a folder or anything outside the output folder).
std::optional<std::map<std::string, std::vector<std::string>>> read_manifest(const fs::path& dir,
                                                                             std::string* damaged = nullptr) {
  std::ifstream in(dir / kManifest);
  if (!in) return std::nullopt;
  std::map<std::string, std::vector<std::string>> out;
  const auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  auto bad = [&](const std::string& why) {
    if (damaged && damaged->empty()) *damaged = (dir / kManifest).string() + ": " + why;
  };
  if (!j.is_object() || !j.contains("plugins") || !j["plugins"].is_object()) {
    bad("damaged (not a {\"plugins\": {...}} object)");
    return out;
  }
  for (const auto& [plugin, files] : j["plugins"].items()) {
    auto& list = out[plugin];
    if (!files.is_array()) {
      bad("the entry of plugin '" + plugin + "' is not a list");
      continue;
    }
    for (const auto& f : files)
      if (f.is_string() && bad_file_name(f.get<std::string>()).empty()) list.push_back(f.get<std::string>());
      else bad("an entry of plugin '" + plugin + "' is not a plugin's file name");
  }
  return out;
}

/// The plugins' files, for deleting or looking at (empty without a readable files.json).
std::map<std::string, std::vector<std::string>> plugin_files_in(const fs::path& dir) {
  return read_manifest(dir).value_or(std::map<std::string, std::vector<std::string>>{});
}

/// What of a run a folder holds: the files trainkit writes there that make up a run.
std::vector<std::string> run_files_in(const fs::path& dir) {
  std::vector<std::string> found;
  std::error_code ec;
  if (fs::file_size(dir / "metrics.jsonl", ec) > 0 && !ec) found.push_back("metrics.jsonl");
  if (fs::exists(dir / "weights.pt", ec)) found.push_back("weights.pt");
  if (fs::is_directory(dir / "checkpoints", ec) && !fs::is_empty(dir / "checkpoints", ec)) found.push_back("checkpoints/");
  for (const auto& [plugin, files] : plugin_files_in(dir))
    for (const auto& f : files)
      if (fs::is_regular_file(fs::symlink_status(dir / f, ec))) found.push_back(f);
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
  if (found.empty()) {
    // What an older files.json lists is gone: it is not this new run's.
    fs::remove(dir_ / kManifest, ec);
    return;
  }
  if (!overwrite_)
    throw RunRefused("the output folder '" + dir_.string() + "' holds another run (" +
                join(found.data(), found.data() + found.size()) +
                "): continue it with --resume latest, replace it with --overwrite, or give this run another "
                "run.output");
  spdlog::warn("--overwrite: deleting the run in '{}' ({})", dir_.string(), join(found.data(), found.data() + found.size()));
  // The plugins' files: plain files only (a folder or a link of that name is not one the core
  // wrote), then the core's own, the manifest last, so that a failed deletion leaves the rest listed.
  for (const auto& [plugin, files] : plugin_files_in(dir_))
    for (const auto& f : files)
      if (fs::is_regular_file(fs::symlink_status(dir_ / f, ec)) && !fs::remove(dir_ / f, ec) && ec)
        throw Error("cannot delete '" + (dir_ / f).string() + "': " + ec.message());
  for (const char* f : {"metrics.jsonl", "weights.pt", "trace.jsonl", "recipe.toml", "status.json", "report.html",
                        "checkpoints", kManifest}) {
    fs::remove_all(dir_ / f, ec);
    if (ec) throw Error("cannot delete '" + (dir_ / f).string() + "': " + ec.message());
  }
}

void RunOutputs::open(const std::optional<Checkpoint>& resumed) {
  if (!active_) return;
  write_atomic(dir_ / "recipe.toml", resolved_.toml(recipe_.source()));
  wrote("recipe.toml");
  wrote("metrics.jsonl");
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

void RunOutputs::wrote(const std::string& file) {
  if (std::find(written_.begin(), written_.end(), file) == written_.end()) written_.push_back(file);
}

void RunOutputs::write_weights(const Run& run) {
  NamedTensors tensors;
  for (const auto& p : run.model->named_parameters()) tensors.emplace_back(p.key(), p.value());
  for (const auto& b : run.model->named_buffers()) tensors.emplace_back(b.key(), b.value());
  save_tensor_dict(dir_ / "weights.pt", tensors);
  wrote("weights.pt");
}

void RunOutputs::record_plugin_file(const std::string& plugin, const std::string& file) {
  const std::string why = bad_file_name(file);
  if (!why.empty()) throw Error("the file name '" + file + "' " + why);
  auto files = manifest();
  for (const auto& [other, list] : files)
    if (other != plugin && std::find(list.begin(), list.end(), file) != list.end())
      throw Error("'" + file + "' is plugin '" + other + "''s file in " + dir_.string());
  auto& mine = files[plugin];
  if (std::find(mine.begin(), mine.end(), file) == mine.end()) {
    mine.push_back(file);
    write_manifest(files);  // listed before it exists: never a file of nobody's
  }
  wrote(file);
}

std::map<std::string, std::vector<std::string>> RunOutputs::manifest() const {
  std::string damaged;
  auto files = read_manifest(dir_, &damaged);
  if (!damaged.empty())
    throw Error(damaged + "; it lists the plugins' files of this run: repair it, or delete it and the files it listed");
  return files.value_or(std::map<std::string, std::vector<std::string>>{});
}

void RunOutputs::write_manifest(const std::map<std::string, std::vector<std::string>>& files) const {
  nlohmann::ordered_json j;
  j["plugins"] = nlohmann::ordered_json::object();
  for (const auto& [p, list] : files) j["plugins"][p] = list;
  write_atomic(dir_ / kManifest, j.dump(1) + "\n");
}

void RunOutputs::write_plugin_files(Run& run, bool only_missing) {
  FilesState state{&run.dispatch, run.model.get(), &run.plan, dir_,
                   [this](const std::string& plugin, const std::string& file) { record_plugin_file(plugin, file); }};
  OutputFiles files = ContextAccess::files(state);
  for (size_t i : run.order) {
    const Slot& slot = run.slots[i];
    const auto listed = manifest();
    const auto it = listed.find(slot.name);
    if (only_missing && it != listed.end() &&
        std::all_of(it->second.begin(), it->second.end(), [&](const auto& f) { return fs::exists(dir_ / f); }))
      continue;  // it wrote its files, and they are all there
    run.call_plugin(slot, "write_files", [&] { slot.plugin->write_files(files); });
    auto after = manifest();
    if (!after.count(slot.name)) {  // it wrote none: recorded, so that a resume does not ask again
      after[slot.name] = {};
      write_manifest(after);
    }
  }
}

void RunOutputs::complete_again(Run& run) {
  if (!active_) return;
  if (!fs::exists(dir_ / "weights.pt")) write_weights(run);
  write_plugin_files(run, /*only_missing=*/true);
}

void RunOutputs::status(const char* state, int64_t step, const std::string& detail) const {
  if (!active_) return;
  nlohmann::json s = {{"status", state}, {"step", step}, {"pid", static_cast<int64_t>(getpid())},
                      {"time", static_cast<int64_t>(std::time(nullptr))}};
  if (!detail.empty()) s["detail"] = detail;
  write_atomic(dir_ / "status.json", s.dump() + "\n");
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
  write_atomic(dir_ / "trace.jsonl", text);
  wrote("trace.jsonl");
}

}  // namespace tk::detail
