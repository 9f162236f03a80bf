// What a run is (its identity, as checkpoints record it) and continuing one from a checkpoint:
// the recorded run compared with this one, then model, optimizer, generators and plugin states.
#include <algorithm>
#include <initializer_list>
#include <map>
#include <optional>
#include <set>

#include "assemble/assemble.h"
#include "persist/persist.h"
#include "planning/planning.h"
#include "tk/abi.h"

#include <spdlog/spdlog.h>

namespace fs = std::filesystem;

namespace tk::detail {

bool may_change_on_resume(const std::string& key) {
  static const std::set<std::string> kMayChange = {
      "run.name",         "run.output",      "run.max_time",    "run.log_every",        "run.validate_every",
      "run.trace",        "run.measure_memory", "run.phase_times", "run.peak_gflops",    "run.checkpoint_every",
      "run.checkpoint_keep", "run.prefetch", "run.allocator", "world.backend", "world.timeout_s", "world.rendezvous_timeout_s"};
  return kMayChange.count(key) > 0;
}

RunIdentity run_identity(const Run& r) {
  RunIdentity id;
  id.world_size = r.plan.world_size;
  id.retired = r.resolved.retired();
  for (auto& [k, v, is_default, same_on_cpu] : r.resolved.values()) {
    if (may_change_on_resume(k)) continue;
    // Values its component declares bit-identical on the CPU (an optimizer's per_tensor and
    // foreach steps) are not part of what a run is there.
    if (same_on_cpu && r.device.is_cpu()) continue;
    id.recipe.emplace_back(k, v);
    if (is_default) id.defaults.insert(k);
  }
  // What the data set's files hold: another recipe could name the same files, the same recipe other ones.
  if (!r.data.info.fingerprint.empty()) id.recipe.emplace_back(kDataKey, r.data.info.fingerprint);
  return id;
}

namespace {

/// `s` hashed, to compare texts across ranks as numbers.
int64_t text_hash(const std::string& s) { return static_cast<int64_t>(abi::text_hash(s) >> 1); }

}  // namespace

std::optional<fs::path> checkpoint_to_continue(Run& r, const fs::path& output_dir) {
  std::string note;
  const auto found = find_checkpoint(output_dir / "checkpoints", &note);
  if (!note.empty()) r.warn(note);
  // Every rank continues the same checkpoint, or none: the folder is one that all of them read.
  const int64_t mine = found ? text_hash(found->filename().string()) : -1;
  World& world = *r.world;
  if (world.size() > 1) {
    const int64_t most = world.max(mine), least = -world.max(-mine);
    if (most != least)
      throw RunRefused("--resume auto: rank " + std::to_string(world.rank()) + " finds " +
                       (found ? "checkpoint " + found->string() : "no checkpoint in " + (output_dir / "checkpoints").string()) +
                       ", another rank finds another: every rank must see the run's output folder (run.output) on "
                       "one shared file system");
  }
  return found;
}

void agree_on_identity(World& world, const RunIdentity& identity) {
  if (world.size() < 2) return;
  std::vector<int64_t> mine;  // key hash, value hash, ...
  for (const auto& [k, v] : identity.recipe) {
    mine.push_back(text_hash(k));
    mine.push_back(text_hash(v));
  }
  at::Tensor count = at::tensor({static_cast<int64_t>(mine.size())}, at::kLong);
  world.broadcast(count, 0);
  at::Tensor zero = world.rank() == 0 ? at::tensor(mine, at::kLong) : at::zeros({count.item<int64_t>()}, at::kLong);
  world.broadcast(zero, 0);
  std::map<int64_t, int64_t> theirs;
  const int64_t* z = zero.data_ptr<int64_t>();
  for (int64_t i = 0; i + 1 < zero.numel(); i += 2) theirs[z[i]] = z[i + 1];
  std::vector<std::string> differ;
  bool differ_in_data = false;
  for (const auto& [k, v] : identity.recipe) {
    const auto it = theirs.find(text_hash(k));
    const bool missing = it == theirs.end();
    if (!missing && it->second == text_hash(v)) {
      theirs.erase(it);
      continue;
    }
    differ.push_back(k + " = " + v + (missing ? " (rank 0 has no " + k + ")" : std::string()));
    differ_in_data = differ_in_data || k == kDataKey;
    if (!missing) theirs.erase(it);
  }
  if (!theirs.empty())
    differ.push_back(std::to_string(theirs.size()) + " key" + (theirs.size() == 1 ? "" : "s") +
                     " of rank 0's recipe that this rank's lacks");
  at::Tensor bad = at::tensor({differ.empty() ? int64_t{0} : int64_t{1}}, at::kLong);
  world.all_reduce(bad, ReduceOp::Max);
  if (!differ.empty())
    throw RunRefused("rank " + std::to_string(world.rank()) + " trains another recipe than rank 0: " +
                     join(differ.data(), differ.data() + differ.size()) + " here, other values on rank 0; every "
                     "launcher of a run must be given the same recipe and the same --set options" +
                     (differ_in_data ? ", and read the same data files" : ""));
  if (bad.item<int64_t>() > 0)
    throw RunRefused("another rank trains another recipe than rank 0 (that rank's error names the keys); every "
                     "launcher of a run must be given the same recipe and the same --set options");
}

namespace {

/// Hands each plugin its state from a checkpoint (before fit_start); warns about states nobody loads.
void restore_plugin_states(Run& r, Checkpoint& resumed) {
  for (const auto& slot : r.slots) {
    if (!slot.plugin) continue;
    auto it = resumed.plugin_states.find(slot.name);
    if (it == resumed.plugin_states.end()) {
      r.warn("plugin '" + slot.name + "' has no state in " + resumed.dir.string() + "; it starts fresh");
      continue;
    }
    r.call_plugin(slot, "load_state", [&] { slot.plugin->load_state(it->second); });
    resumed.plugin_states.erase(it);
  }
  for (const auto& [name, st] : resumed.plugin_states)
    r.warn("the checkpoint holds state of plugin '" + name + "', which this run does not load; ignored");
}

/// How the checkpoint's run and this one differ, each entry "key: old -> new" or "key = value".
struct Differences {
  std::vector<std::string> refused;   ///< what `allowed` does not cover
  std::vector<std::string> defaults;  ///< keys the checkpoint does not record, at their default here
  std::vector<std::string> allowed;   ///< the differences `allowed` covers
  bool unrecorded_data = false;       ///< the checkpoint does not record its data's files
};

/// The labels of the plugins a run's recipe had (its "plugins" entry: a TOML string of labels joined by
/// ", "); nullopt when it does not record them.
std::optional<std::set<std::string>> plugins_of(const std::vector<std::pair<std::string, std::string>>& recipe) {
  for (const auto& [k, v] : recipe) {
    if (k != "plugins") continue;
    std::set<std::string> out;
    const std::string list = v.size() >= 2 && v.front() == '"' ? v.substr(1, v.size() - 2) : v;
    for (size_t at = 0; at < list.size();) {
      const size_t comma = std::min(list.find(", ", at), list.size());
      out.insert(list.substr(at, comma - at));
      at = comma + 2;
    }
    return out;
  }
  return std::nullopt;
}


/// Whether an --allow-change entry `a` lets `key` through: "all", the key, or a section above it.
bool covers(const std::string& a, const std::string& key) { return a == "all" || a == key || key.rfind(a + ".", 0) == 0; }

/// Compares the checkpoint's run with this one. A key the checkpoint does not record is an option
/// the trainkit (or plugin) that wrote it did not have yet: left at its default, it trains what that
/// one trained, and is no difference. The options of a plugin the checkpoint's run did not have are
/// part of adding it: differences like the "plugins" entry itself.
Differences differences(const CheckpointRecord& saved, const RunIdentity& now, const std::vector<std::string>& allowed) {
  auto is_allowed = [&](const std::string& key) {
    for (const auto& a : allowed) {
      if (covers(a, key)) return true;
      for (const auto& [old, moved] : now.retired)  // an old key (or its section) allows where it moved
        if (moved == key && covers(a, old)) return true;
    }
    return false;
  };
  std::map<std::string, std::string> before;
  for (const auto& [k, v] : saved.recipe) {  // an option that moved since is compared where it is now
    auto moved = now.retired.find(k);
    const bool elsewhere = moved != now.retired.end() && !moved->second.empty();
    before[elsewhere ? moved->second : k] = v;
  }
  const auto had = plugins_of(saved.recipe), has = plugins_of(now.recipe);
  auto of_added_plugin = [&](const std::string& key) {
    if (!had || !has || key.rfind("plugins.", 0) != 0) return false;
    // A label may hold dots (a plugin named by its file): the key is "plugins.<label>.<option>",
    // of the longest label of this run that it starts with.
    std::string label;
    for (const auto& l : *has)
      if (l.size() > label.size() && key.rfind("plugins." + l + ".", 0) == 0) label = l;
    return !label.empty() && !had->count(label);
  };
  Differences out;
  auto show = [](const std::string* v) { return v ? *v : std::string("(not set)"); };
  for (const auto& [k, v] : now.recipe) {
    auto it = before.find(k);
    const std::string* old = it == before.end() ? nullptr : &it->second;
    if (!old && k == kDataKey)
      out.unrecorded_data = true;
    else if (!old && now.defaults.count(k) && !of_added_plugin(k))
      out.defaults.push_back(k + " = " + v);
    else if (!old || escape_controls(*old) != v)
      (is_allowed(k) ? out.allowed : out.refused).push_back(k + ": " + show(old) + " -> " + v);
    if (it != before.end()) before.erase(it);
  }
  for (const auto& [k, v] : before)
    if (!now.retired.count(k)) (is_allowed(k) ? out.allowed : out.refused).push_back(k + ": " + v + " -> (not set)");
  return out;  // another world size is continue_on_world's to judge
}

/// The --allow-change entries that name no key or section of this run's recipe nor of the
/// checkpoint's (a misspelt key would let nothing through, silently).
std::vector<std::string> unknown_allowances(const Run& r, const CheckpointRecord* saved, const std::vector<std::string>& allowed) {
  std::set<std::string> keys = {kDataKey, "world_size"};  // what a world change once needed let through
  for (const auto& [k, v, is_default, same_on_cpu] : r.resolved.values()) keys.insert(k);
  for (const auto& [old, moved] : r.resolved.retired()) keys.insert(old);
  if (saved)
    for (const auto& [k, v] : saved->recipe) keys.insert(k);
  std::vector<std::string> unknown;
  for (const auto& a : allowed)
    if (a != "all" && std::none_of(keys.begin(), keys.end(), [&](const std::string& k) { return covers(a, k); }))
      unknown.push_back(a);
  return unknown;
}

/// Why the run's length cannot change on a resume, and what trains on from checkpoint `dir`.
std::string length_note(const fs::path& dir) {
  return "the run's length in optimizer steps (run.steps; or run.epochs, with the batch and the data that make an epoch's "
         "steps) cannot change on a resume, --allow-change included: its schedule "
         "and data order were made for it; to train on from this checkpoint, start a new run from its weights with "
         "[model] init = \"" + (dir / "model.pt").string() + "\"";
}

/// Whether one of these differences (`key: before -> after`) begins with one of `prefixes`.
bool any_starts(const std::vector<std::string>& differences, std::initializer_list<const char*> prefixes) {
  return std::any_of(differences.begin(), differences.end(), [&](const std::string& d) {
    return std::any_of(prefixes.begin(), prefixes.end(), [&](const char* p) { return d.rfind(p, 0) == 0; });
  });
}

/// Whether one of these differences is the run's length itself.
bool changes_length(const std::vector<std::string>& differences) {
  return any_starts(differences, {"run.steps:", "run.epochs:"});
}

/// One item a line, indented, for a message.
std::string lines(const std::vector<std::string>& items) {
  return "\n  " + join(items.data(), items.data() + items.size(), "\n  ");
}

/// What a resume from checkpoint `dir` (its `record`) checks before it loads anything (another
/// optimizer's state would not even load): the --allow-change entries, and how the runs differ.
Differences compare_runs(const Run& r, const fs::path& dir, const std::optional<CheckpointRecord>& record,
                         const RunIdentity& identity, const std::vector<std::string>& allowed) {
  const auto unknown = unknown_allowances(r, record ? &*record : nullptr, allowed);
  if (!unknown.empty())
    throw RunRefused("--allow-change " + unknown.front() + ": neither this recipe nor the checkpoint's has such a key "
                     "or section (a key as \"optimizer.lr\", a section as \"optimizer\", or \"all\")");
  if (!record) return {};
  Differences diff = differences(*record, identity, allowed);
  if (!diff.refused.empty())
    throw RunRefused("cannot resume from " + dir.string() + ": this run differs from the one that wrote it (checkpoint -> now):" +
                lines(diff.refused) + "\nresume with the recipe and options it was started with (its output folder's recipe.toml), "
                "or allow a change on purpose with --allow-change KEY" +
                (changes_length(diff.refused) ? "; " + length_note(dir) : std::string()));
  return diff;
}

/// Refuses a resume from `dir` whose run is of another length than the checkpoint's (`saved`
/// optimizer steps), naming a change let through that makes it (`diff`).
void check_length(const Run& r, const fs::path& dir, int64_t saved, const Differences& diff) {
  if (saved == r.total_steps) return;
  // Where the length itself was let through, that is the change; else one that makes an epoch's steps.
  const bool length = changes_length(diff.allowed);
  const std::string cause = length || diff.allowed.empty()
                                ? "resume with the recipe it was made with"
                                : "what --allow-change let through changes how many optimizer steps its epochs take:" +
                                      lines(diff.allowed) + "\n";
  throw RunRefused(dir.string() + ": the checkpoint is of a run of " + std::to_string(saved) + " steps, this one has " +
                   std::to_string(r.total_steps) + ": " + cause + (length || diff.allowed.empty() ? "; " : "") +
                   length_note(dir));
}

}  // namespace

std::string resume_plan(const Run& r, const std::string& which, const std::vector<std::string>& allowed) {
  const fs::path out = output_dir_of(r);
  std::string note;
  std::optional<fs::path> dir;
  if (which != "auto")
    dir = resolve_checkpoint(which, out, &note);
  else if (!(dir = find_checkpoint(out / "checkpoints", &note)))
    return "--resume auto: no checkpoint in " + (out / "checkpoints").string() + ", so a new run";
  const auto record = read_checkpoint_record(*dir);
  const Differences diff = compare_runs(r, *dir, record, run_identity(r), allowed);
  const TrainingPosition at = checkpoint_position(*dir, record);
  // On the same world and split the run's length compares as it is; else once the step is carried over.
  const bool split_allowed = any_starts(diff.allowed, {"batch."});
  const bool carried = (at.world_size > 0 && at.world_size != r.plan.world_size) ||
                       (at.micro_batch > 0 && at.micro_batch != r.plan.micro_batch) ||
                       (at.accumulation > 0 && at.accumulation != r.plan.accumulation) || split_allowed;
  if (!carried) check_length(r, *dir, at.counters.total_steps, diff);
  check_continuation(r, at, *dir, split_allowed);
  if (r.optimizer) check_optimizer_kind(*dir, *r.optimizer);
  std::string plan = "from " + dir->string() + (note.empty() ? "" : " (" + note + ")") + ", at step " +
                     std::to_string(at.counters.step) + " of " + std::to_string(at.counters.total_steps) +
                     (at.counters.step == at.counters.total_steps ? " (complete: it would train nothing)" : "");
  if (!diff.allowed.empty()) plan += "; --allow-change lets through (checkpoint -> now):" + lines(diff.allowed);
  if (!diff.defaults.empty()) plan += "\n              options it does not record, at their defaults:" + lines(diff.defaults);
  if (!record) plan += "\n              it does not record the recipe it was made with (an older trainkit wrote it)";
  return plan + "\n              (compared without loading it: its tensors are checked when the run starts)";
}

Checkpoint resume_from(Run& r, const std::string& which, const fs::path& output_dir, const RunIdentity& identity,
                       const std::vector<std::string>& allowed) {
  std::string note;
  const fs::path dir = resolve_checkpoint(which, output_dir, &note);
  if (!note.empty()) r.warn(note);
  const auto record = read_checkpoint_record(dir);
  const Differences diff = compare_runs(r, dir, record, identity, allowed);
  if (record) {
    if (!diff.allowed.empty())
      spdlog::info("resuming with what --allow-change lets through (checkpoint -> now):{}", lines(diff.allowed));
    if (!diff.defaults.empty())
      r.warn(dir.string() + " does not record these options (they are newer than what wrote it); resuming with their "
             "defaults, as the run that wrote it trained:" + lines(diff.defaults));
    if (diff.unrecorded_data)
      r.warn(dir.string() + " does not record which data files it trained on (an older trainkit wrote it, or its "
             "data set recorded none): make sure they are the ones it was started with");
  } else {
    r.warn(dir.string() + " does not record the recipe it was made with (written by an older trainkit): "
           "make sure this recipe is the one it was started with");
  }
  Checkpoint resumed;
  try {
    resumed = load_checkpoint(dir, record, *r.model, *r.optimizer);
  } catch (const RunRefused& e) {  // what was saved does not fit this run's model or optimizer
    if (diff.allowed.empty()) throw;
    throw RunRefused(message_of(e) + "\nthis resume changes the run that wrote the checkpoint (let through with "
                     "--allow-change):" + lines(diff.allowed) + "\nwhat the checkpoint holds may not fit these "
                     "changes: resume without the ones the error above concerns");
  }
  restore_plugin_states(r, resumed);
  // A change of the batch let through: the recipe's split of the step, from the same example on.
  continue_on_world(r, resumed, any_starts(diff.allowed, {"batch."}));
  check_length(r, resumed.dir, resumed.position.counters.total_steps, diff);
  return resumed;
}

}  // namespace tk::detail
