#include "persist/persist.h"

#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <optional>
#include <sstream>

#include "tk/error.h"
#include "tk/output.h"
#include "tk/sharded_state.h"
#include "tk/tensor_io.h"
#include "support/support.h"

namespace fs = std::filesystem;

namespace tk {
namespace {

constexpr const char* kPluginPrefix = "plugin-";
/// optimizer.pt's key for the number of shares an optimizer sharded over the ranks saved.
constexpr const char* kSharesKey = "tk_optimizer_shares";

std::string share_file(int64_t r) { return "optimizer-share-" + std::to_string(r) + ".pt"; }

/// A checkpoint folder that was moved into place whole (a partial one is still `<name>.tmp`).
bool is_complete(const fs::path& dir) {
  for (const char* f : {"model.pt", "optimizer.pt", "trainer.pt"})
    if (!fs::is_regular_file(dir / f)) return false;
  return true;
}

/// The complete `step-<N>` folders under `root`, oldest first.
std::vector<fs::path> complete_checkpoints(const fs::path& root) {
  std::vector<fs::path> all;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string f = e.path().filename().string();
    if (f.rfind("step-", 0) == 0 && e.path().extension() != ".tmp" && is_complete(e.path())) all.push_back(e.path());
  }
  std::sort(all.begin(), all.end());
  return all;
}

std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

/// Makes `dir` (and the folders above it).
void make_folder(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw Error("cannot create checkpoint folder '" + dir.string() + "': " + ec.message());
}

/// Where a checkpoint's parameters go. With an optimizer that shards them between uses and says
/// who keeps each (tk::ParameterKeepers, a tk::ShardedState too), each rank writes those it keeps
/// beside its share of the state, and model.pt holds the rest; else model.pt holds them all,
/// gathered first.
struct ParameterSplit {
  bool by_rank = false;
  NamedTensors mine;     // this rank's (by_rank)
  NamedTensors shared;   // model.pt's: the parameters every rank holds, or all of them; the buffers
};

ParameterSplit split_parameters(Model& model, const torch::optim::Optimizer& optimizer, int64_t rank) {
  ParameterSplit split;
  const auto* keepers = dynamic_cast<const ParameterKeepers*>(&optimizer);
  const bool shares = keepers && dynamic_cast<const ShardedState*>(&optimizer);
  for (const auto& p : model.named_parameters()) {  // a tied tensor under each of its names
    const int64_t keeper = shares ? keepers->keeper_of(p.value()) : -1;
    split.by_rank = split.by_rank || keeper >= 0;
    if (keeper < 0) split.shared.emplace_back(p.key(), p.value());
    else if (keeper == rank) split.mine.emplace_back(p.key(), p.value());
  }
  for (const auto& b : model.named_buffers()) split.shared.emplace_back(b.key(), b.value());
  return split;
}

/// The parameters as a checkpoint saves them: split, and while this lives, parameters sharded
/// between uses gathered whole on every rank for model.pt, unless each rank writes its own.
struct ParametersToSave {
  ParametersToSave(Model& model, const torch::optim::Optimizer& optimizer, int64_t rank)
      : split(split_parameters(model, optimizer, rank)) {
    if (!split.by_rank) whole.emplace(&optimizer);
  }
  ParameterSplit split;
  std::optional<WholeParameters> whole;
};

/// Every rank at once: its share of `state` (and with `params.by_rank`, of the parameters) into
/// `tmp`, the checkpoint's temporary folder (rank 0 made it before the first barrier; rank 0 moves
/// it into place after the last). `failed`: what stopped this rank before (rank 0 making the
/// folder). A rank that failed makes every rank throw, so none waits for it.
void write_shares(const fs::path& tmp, const ShardedState& state, const ParameterSplit& params, World& world,
                  std::string failed = "") {
  world.barrier();
  const auto attempt = [&](const std::string& what, const auto& write) {
    if (!failed.empty()) return;
    try {
      write();
    } catch (const std::exception& e) {
      failed = "rank " + std::to_string(world.rank()) + " could not write " + what + ": " + message_of(e);
    }
  };
  // Rank 0 made the folder: made here too, a network file system may not list it yet.
  attempt("in the checkpoint folder", [&] { make_folder(tmp); });
  if (params.by_rank)
    attempt("its share of the parameters",
            [&] { save_tensor_dict(tmp / detail::model_share_file(world.rank()), params.mine); });
  attempt("its share of the optimizer state", [&] {
    torch::serialize::OutputArchive archive;
    state.save_share(archive);
    std::ostringstream bytes;
    archive.save_to(bytes);
    detail::write_file_atomic(tmp / share_file(world.rank()), bytes.str());
  });
  detail::fault_point("checkpoint-share");
  if (world.max(int64_t{failed.empty() ? 0 : 1}) == 0) return;
  throw Error(failed.empty() ? "another rank could not write its share of the checkpoint into '" + tmp.string() +
                                   "'; this checkpoint is not written (the earlier ones are kept)"
                             : failed);
}

/// optimizer.pt: the optimizer's state; for one sharded over the ranks, how many shares the ranks
/// wrote beside it (write_shares) and how they fit together.
std::string optimizer_file(const torch::optim::Optimizer& optimizer, const World& world) {
  torch::serialize::OutputArchive archive;
  if (const auto* sharded = dynamic_cast<const ShardedState*>(&optimizer)) {
    archive.write(kSharesKey, at::tensor(std::vector<int64_t>{world.size()}), /*is_buffer=*/true);
    sharded->save_layout(archive);
  } else {
    optimizer.save(archive);
  }
  std::ostringstream bytes;
  archive.save_to(bytes);
  return bytes.str();
}

}  // namespace

namespace {

NamedTensors position_tensors(const TrainingPosition& p) {
  const Counters& c = p.counters;
  auto t = torch::tensor({c.step, c.micro_step, c.epoch, c.batch_in_epoch, c.samples_seen, c.tokens_seen,
                          c.skipped_steps, c.schedule_step, c.total_steps, p.next_epoch, p.next_batch, p.micro_batch,
                          p.accumulation, p.world_size, p.seen.samples, p.seen.tokens},
                         torch::kLong);
  NamedTensors out{{"position", t}};
  for (auto& named : detail::rng_tensors()) out.push_back(std::move(named));
  return out;
}

TrainingPosition position_from(const torch::Tensor& t, int64_t world_size) {
  // 11 fields: written before the micro-batch was recorded; 12: before the window and the world.
  if (t.numel() != 11 && t.numel() != 12 && t.numel() != 16)
    throw Error("checkpoint position has " + std::to_string(t.numel()) + " fields, expected 16");
  auto v = t.to(torch::kLong);
  auto at = [&](int i) { return v[i].item<int64_t>(); };
  TrainingPosition p;
  p.counters.step = at(0);
  p.counters.micro_step = at(1);
  p.counters.epoch = at(2);
  p.counters.batch_in_epoch = at(3);
  p.counters.samples_seen = at(4);
  p.counters.tokens_seen = at(5);
  p.counters.skipped_steps = at(6);
  p.counters.schedule_step = at(7);
  p.counters.total_steps = at(8);
  p.next_epoch = at(9);
  p.next_batch = at(10);
  if (t.numel() >= 12) p.micro_batch = at(11);
  if (t.numel() >= 16) {
    p.accumulation = at(12);
    p.world_size = at(13);
    p.seen = {at(14), at(15)};
  } else {  // every rank read as many examples (and, mostly, tokens) as rank 0
    p.world_size = world_size;
    p.seen = {p.counters.samples_seen * std::max<int64_t>(world_size, 1), p.counters.tokens_seen * std::max<int64_t>(world_size, 1)};
  }
  return p;
}

}  // namespace

fs::path save_checkpoint(const fs::path& root, Model& model, torch::optim::Optimizer& optimizer, World& world,
                         const std::vector<std::pair<std::string, StateDict>>& plugin_states,
                         const TrainingPosition& position, const RunIdentity& identity, int64_t keep,
                         std::string failed) {
  const std::string name = step_name(position.counters.step);
  const fs::path final_dir = root / name, tmp = root / (name + ".tmp");
  const auto* sharded = dynamic_cast<const ShardedState*>(&optimizer);
  const ParametersToSave to_save(model, optimizer, world.rank());  // every rank (save_checkpoint_share)
  const ParameterSplit& params = to_save.split;
  std::error_code ec;
  // `failed`: what stopped this rank before the ranks write their shares together.
  try {
    if (failed.empty()) {
      make_folder(root);
      fs::remove_all(tmp, ec);
      make_folder(tmp);
    }
  } catch (const std::exception& e) {
    if (!sharded) throw;
    failed = message_of(e);
  }
  if (!failed.empty() && !sharded) throw Error(failed);
  try {
    if (sharded) write_shares(tmp, *sharded, params, world, failed);
    save_tensor_dict(tmp / "model.pt", params.shared);
    detail::fault_point("checkpoint-partial");
    detail::write_file_atomic(tmp / "optimizer.pt", optimizer_file(optimizer, world));
    save_tensor_dict(tmp / "trainer.pt", position_tensors(position));
    for (const auto& [plugin, s] : plugin_states)
      save_tensor_dict(tmp / (kPluginPrefix + plugin + ".pt"), NamedTensors(s.begin(), s.end()));
    detail::write_checkpoint_record(tmp, {identity.world_size, params.by_rank ? world.size() : 0, identity.recipe});

    fs::remove_all(final_dir, ec);
    if (::rename(tmp.c_str(), final_dir.c_str()) != 0)
      throw Error("cannot move checkpoint into place at '" + final_dir.string() + "': " + std::strerror(errno));
    detail::sync_folder(root);
  } catch (...) {
    fs::remove_all(tmp, ec);  // a partial checkpoint only takes the space a full disk lacks
    throw;
  }
  detail::fault_point("checkpoint-renamed");
  write_atomic(root / "latest", name + "\n");
  detail::fault_point("checkpoint-done");

  const auto all = complete_checkpoints(root);
  for (size_t i = 0; keep > 0 && i + static_cast<size_t>(keep) < all.size(); ++i) fs::remove_all(all[i], ec);
  return final_dir;
}

void save_checkpoint_share(const fs::path& root, int64_t step, Model& model, const torch::optim::Optimizer& optimizer,
                           World& world) {
  const ParametersToSave to_save(model, optimizer, world.rank());  // as rank 0 does
  write_shares(root / (step_name(step) + ".tmp"), dynamic_cast<const ShardedState&>(optimizer), to_save.split, world);
}

void check_folder_shared(const fs::path& root, World& world) {
  if (world.size() == 1) return;
  // Each rank writes a file of its own, named for this start (rank 0's process id and clock), and
  // rank 0 looks for them: names it never looked up, which a network file system's cache of
  // missing names cannot hide. One left by a start that died here is the run's own (named with
  // detail::kProbePrefix, which survey_checkpoints knows): the next start deletes it.
  at::Tensor nonce = at::tensor(std::vector<int64_t>{
      world.rank() == 0 ? ((static_cast<int64_t>(::getpid()) << 32) ^
                           std::chrono::steady_clock::now().time_since_epoch().count()) & INT64_MAX
                        : 0});
  world.broadcast(nonce, 0);
  const auto probe = [&](int64_t r) {
    return root / (std::string(detail::kProbePrefix) + std::to_string(r) + "-" + std::to_string(nonce.item<int64_t>()));
  };
  struct Remove {
    fs::path file;
    ~Remove() {
      std::error_code ec;
      fs::remove(file, ec);
    }
  } remove{probe(world.rank())};  // however this ends
  std::string failed;
  try {
    make_folder(root);
    write_atomic(remove.file, "");
  } catch (const std::exception& e) {
    failed = message_of(e);
  }
  const int64_t failing = world.max(int64_t{failed.empty() ? -1 : world.rank()});  // also: every probe is written
  int64_t blind = -1;  // the first rank whose file rank 0 does not see
  std::error_code ec;
  for (int64_t r = 1; failing < 0 && world.rank() == 0 && r < world.size() && blind < 0; ++r)
    if (!fs::exists(probe(r), ec)) blind = r;  // an error looking counts as not seen
  blind = world.max(blind);
  if (failing >= 0)
    throw Error(!failed.empty() ? failed
                                : "rank " + std::to_string(failing) + " could not write in the checkpoint folder '" +
                                      root.string() + "'");
  if (blind >= 0)
    throw RunRefused("rank 0 does not see what rank " + std::to_string(blind) + " writes in the checkpoint folder '" +
                     root.string() + "': with an optimizer sharded over the ranks each rank writes its own share of "
                     "every checkpoint there; put the run's output folder (run.output) on a file system every rank "
                     "sees");
}

std::optional<fs::path> find_checkpoint(const fs::path& root, std::string* note) {
  if (is_complete(root)) return root;
  std::string latest;
  std::ifstream(root / "latest") >> latest;
  if (!latest.empty() && is_complete(root / latest)) return root / latest;
  const auto all = complete_checkpoints(root);  // empty when `root` is no folder
  if (all.empty()) return std::nullopt;
  if (note)
    *note = (latest.empty() ? "'" + (root / "latest").string() + "' is missing"
                            : "'" + (root / "latest").string() + "' names '" + latest + "', which is not a complete checkpoint") +
            "; taking the newest complete one, " + all.back().filename().string();
  return all.back();
}

TrainingPosition checkpoint_position(const fs::path& dir, const std::optional<detail::CheckpointRecord>& record) {
  for (auto& [k, t] : load_tensor_dict(dir / "trainer.pt"))
    if (k == "position") return position_from(t, record ? record->world_size : 0);
  throw RunRefused((dir / "trainer.pt").string() + " holds no position: it is damaged");
}

NamedTensors load_model_weights(const fs::path& path) {
  std::error_code ec;
  fs::path file = path;
  if (fs::is_directory(path, ec)) {  // a checkpoint, or a checkpoints folder's latest (as --resume takes them)
    const auto found = find_checkpoint(path);
    if (!found)
      throw RunRefused(path.string() + " holds no complete checkpoint (a folder with model.pt, optimizer.pt and "
                       "trainer.pt, or a checkpoints folder of step-<N> ones): give one, its model.pt, a weights.pt or a "
                       ".safetensors file");
    file = *found / "model.pt";
  } else if (file.parent_path().extension() == ".tmp") {
    throw RunRefused(file.string() + " is in a checkpoint that was never completed (the run stopped while writing it): "
                     "give a complete one");
  }
  if (file.extension() == ".safetensors") return load_safetensors(file);
  // A checkpoint's model.pt comes with the shares of the parameters its record names.
  const auto record = file.filename() == "model.pt" ? detail::read_checkpoint_record(file.parent_path()) : std::nullopt;
  return detail::load_model_file(file, record ? record->model_shares : 0);
}

fs::path resolve_checkpoint(const std::string& arg, const fs::path& output_dir, std::string* note) {
  const fs::path root = arg == "latest" ? output_dir / "checkpoints" : fs::path(arg);
  if (auto found = find_checkpoint(root, note)) return *found;
  throw RunRefused("no checkpoint at '" + root.string() + "' (expected a folder with trainer.pt, or a checkpoints folder "
              "with step-<N> folders" + (arg == "latest" ? ", under the run's output folder" : "") + ")");
}

namespace {

/// Refuses a state saved in `count` shares for an optimizer that is not sharded.
void check_sharded(const std::string& file, int64_t count, const torch::optim::Optimizer& optimizer) {
  if (!dynamic_cast<const ShardedState*>(&optimizer))
    throw RunRefused(file + ": the optimizer state was saved in " + std::to_string(count) +
                     " shares (optimizer-share-<rank>.pt), one per rank of an optimizer sharded over the ranks; this "
                     "run's optimizer is not sharded, and cannot read them");
}

}  // namespace

void check_optimizer_kind(const fs::path& dir, const torch::optim::Optimizer& optimizer) {
  int64_t count = 0;
  while (fs::exists(dir / share_file(count))) ++count;
  if (count > 0) check_sharded((dir / "optimizer.pt").string(), count, optimizer);
}

namespace {

/// optimizer.pt: the optimizer's state, or the number of shares the ranks of a sharded optimizer
/// wrote beside it.
void load_optimizer(const fs::path& dir, torch::optim::Optimizer& optimizer) {
  const std::string file = (dir / "optimizer.pt").string();
  torch::serialize::InputArchive archive;
  at::Tensor shares;
  try {
    archive.load_from(file);
    if (!archive.try_read(kSharesKey, shares, /*is_buffer=*/true)) return optimizer.load(archive);
  } catch (const c10::Error& e) {
    throw RunRefused(file + ": damaged, or saved for another optimizer: " + message_of(e));
  }
  const int64_t count = shares.item<int64_t>();
  check_sharded(file, count, optimizer);
  auto* sharded = dynamic_cast<ShardedState*>(&optimizer);
  // Every rank looks for every share, though it may read only its own: a share missing is refused
  // on every rank alike, before any rank waits on another.
  for (int64_t r = 0; r < count; ++r)
    if (!fs::is_regular_file(dir / share_file(r)))
      throw RunRefused((dir / share_file(r)).string() + ": missing; the checkpoint holds " + std::to_string(count) +
                       " shares of the optimizer state, 0 to " + std::to_string(count - 1));
  std::string reading = file;  // the file an error concerns
  try {
    sharded->load_shares(archive, count, [&](int64_t r, torch::serialize::InputArchive& share) {
      if (r < 0 || r >= count) throw Error("share " + std::to_string(r) + " of " + std::to_string(count) + " asked for");
      reading = (dir / share_file(r)).string();
      share.load_from(reading);
    });
  } catch (const RunRefused&) {
    throw;
  } catch (const std::exception& e) {
    throw RunRefused(reading + ": damaged, or saved for another optimizer: " + message_of(e));
  }
}

}  // namespace

Checkpoint load_checkpoint(const fs::path& dir, const std::optional<detail::CheckpointRecord>& record, Model& model,
                           torch::optim::Optimizer& optimizer) {
  Checkpoint ck;
  ck.dir = dir;
  std::map<std::string, torch::Tensor> saved;
  for (auto& [k, t] : detail::load_model_file(dir / "model.pt", record ? record->model_shares : 0)) saved.emplace(k, t);
  torch::NoGradGuard no_grad;
  auto restore = [&](const std::string& name, torch::Tensor& dst) {
    auto it = saved.find(name);
    // What the checkpoint holds does not fit this run (a refusal); a file that cannot be read is an Error.
    if (it == saved.end())
      throw RunRefused(dir.string() + ": the checkpoint has no '" + name + "'; it was saved from a different model");
    if (it->second.sizes() != dst.sizes())
      throw RunRefused(dir.string() + ": '" + name + "' has shape " + c10::str(it->second.sizes()) +
                       " in the checkpoint, " + c10::str(dst.sizes()) + " in the model");
    dst.copy_(it->second);
    saved.erase(it);
  };
  for (auto& p : model.named_parameters()) restore(p.key(), p.value());
  for (auto& b : model.named_buffers()) restore(b.key(), b.value());
  if (!saved.empty())
    throw RunRefused(dir.string() + ": the checkpoint has '" + saved.begin()->first + "', which the model does not");
  load_optimizer(dir, optimizer);
  std::map<std::string, torch::Tensor> trainer;
  for (auto& [k, t] : load_tensor_dict(dir / "trainer.pt")) trainer.emplace(k, t);
  ck.position = position_from(trainer.at("position"), record ? record->world_size : 0);  // 0: unknown
  detail::load_rng_tensors(trainer, (dir / "trainer.pt").string());
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string f = e.path().filename().string();
    if (f.rfind(kPluginPrefix, 0) != 0 || e.path().extension() != ".pt") continue;
    StateDict s;
    for (auto& [k, t] : load_tensor_dict(e.path())) s.emplace(k, t);
    ck.plugin_states.emplace(f.substr(std::strlen(kPluginPrefix), f.size() - std::strlen(kPluginPrefix) - 3), s);
  }
  return ck;
}

}  // namespace tk
