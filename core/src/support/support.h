#pragma once
// The support layer: what every part of a run uses and that knows nothing of a run. Checked,
// durable file operations (every failed write throws an Error naming the file and the reason,
// nothing is left half-written where a reader could take it for whole, one process at a time owns
// a folder); files.json, the record of what of an output folder is trainkit's; figures for people;
// the process's random generators; where its launcher put it. Not installed.
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "tk/output.h"
#include "tk/tensor_io.h"

namespace tk::detail {

// ---- allocator.cpp: the CPU block cache --------------------------------------------------------

/// While one is alive (run.allocator = "caching"), LibTorch's CPU tensors of 1 MiB and more take
/// their memory from a cache of freed blocks of their size class (eight classes per power of two)
/// instead of from the kernel each time; what it keeps free stays within the most that was in use
/// at once. Smaller tensors, and every tensor once the last one is gone, use the allocator it was
/// put in front of. Nests; the memory meter counts on top of it.
class CpuBlockCache {
 public:
  explicit CpuBlockCache(bool on);
  ~CpuBlockCache();
  CpuBlockCache(const CpuBlockCache&) = delete;
  CpuBlockCache& operator=(const CpuBlockCache&) = delete;
  /// Gives every free block back (between phases whose tensors differ: training and validation).
  static void trim();
  struct Stats {
    int64_t hits = 0, misses = 0, returned = 0;  // blocks served from the cache, from below, given back
    int64_t cached_bytes = 0, live_bytes = 0;     // free in the cache, in tensors now
    bool installed = false;
  };
  static Stats stats();

 private:
  bool on_;
};

// ---- files.cpp: durable writes, the folder lock, fault points ------------------------------------

/// The name of the files the ranks write into the checkpoints folder before the first step, to
/// find whether they all see it (`.rank-<rank>-<number>`): the run's own, deleted with it.
inline constexpr const char* kProbePrefix = ".rank-";

/// Writes all of `data` to `file`, replacing it: through `<file>.tmp`, fsync, rename and an fsync
/// of the folder, so that a crash or a kill at any instant leaves either the old or the new file.
void write_file_atomic(const std::filesystem::path& file, const std::string& data);

/// Makes a rename or a new entry in `dir` survive a power cut.
void sync_folder(const std::filesystem::path& dir);

/// One step's record in metrics.jsonl: the core's values under its own keys (tk::metric: the only
/// keys it takes, which plugins' metrics may not), then the plugins' metrics.
class StepRecord {
 public:
  StepRecord& add(MetricKey k, double v) {
    line_.add(k.key(), v);
    return *this;
  }
  StepRecord& add(MetricKey k, int64_t v) {
    line_.add(k.key(), v);
    return *this;
  }
  StepRecord& add(MetricKey k, const std::string& v) {
    line_.add(k.key(), v);
    return *this;
  }
  /// A plugin's metric (its name checked by Context::metric).
  StepRecord& add_plugin_metric(const std::string& name, double v) {
    line_.add(name, v);
    return *this;
  }
  const JsonLine& line() const noexcept { return line_; }

 private:
  JsonLine line_;
};

/// A file that only grows by whole records (metrics.jsonl): each append is one checked write(2)
/// of a complete line, so a kill never leaves a line the kernel has not taken whole.
class AppendFile {
 public:
  AppendFile() = default;
  AppendFile(const AppendFile&) = delete;
  AppendFile& operator=(const AppendFile&) = delete;
  ~AppendFile();

  /// Opens `file` for appending (created when missing, emptied when `truncate`).
  void open(const std::filesystem::path& file, bool truncate);
  bool is_open() const noexcept { return fd_ >= 0; }
  /// Appends `line` and a newline; throws naming the file on any failure (disk full included).
  void append(const std::string& line);
  /// Flushes what was appended to the disk.
  void sync();
  void close();

 private:
  int fd_ = -1;
  std::filesystem::path file_;
};

/// An exclusive lock on a folder for as long as this object lives: `<dir>/.tk-lock`, flock(2)ed
/// and holding the owner's PID. The kernel drops the lock when the process ends, however it ends,
/// so a killed run never blocks its own resume.
class FolderLock {
 public:
  FolderLock() = default;
  FolderLock(const FolderLock&) = delete;
  FolderLock& operator=(const FolderLock&) = delete;
  ~FolderLock();

  /// Takes the lock on `dir` (which must exist); throws, naming the holder's PID, when another
  /// process holds it.
  void acquire(const std::filesystem::path& dir);
  void release();

 private:
  int fd_ = -1;
};

/// A crash point for tests of kill safety: when the environment variable TK_FAULT is
/// "<name>:<n>", the n-th time the run passes point `name` the process kills itself with SIGKILL.
/// Points: metrics-written, checkpoint-partial, checkpoint-renamed, checkpoint-done.
void fault_point(const char* name);
/// Whether TK_FAULT is "<name>:<n>" and this is the n-th time point `name` is passed (for faults
/// other than a kill: "oom" makes the n-th micro-batch of the process fail as out of memory).
bool fault_due(const char* name);

// ---- manifest.cpp: files.json and the survey of an output folder ---------------------------------

/// files.json: the core's files of the run (recipe.toml, metrics.jsonl, ..., checkpoints) and each
/// plugin's (a plugin that wrote none has an empty list). Each file is recorded before it is
/// written, so no file of trainkit's is ever unlisted.
struct Manifest {
  std::vector<std::string> core;
  std::map<std::string, std::vector<std::string>> plugins;
  bool lists_core = true;  ///< false for a files.json that records the plugins' files only
};

/// The name of the record.
inline constexpr const char* kManifestFile = "files.json";

/// files.json of `dir`, nullopt when there is none. Only names that may be trainkit's are kept (a
/// damaged or hand-edited list can never name a folder, a link or anything outside `dir`);
/// `damaged` says why when something was dropped or it cannot be read.
std::optional<Manifest> read_manifest(const std::filesystem::path& dir, std::string* damaged = nullptr);
/// Replaces files.json of `dir` atomically.
void write_manifest(const std::filesystem::path& dir, const Manifest& m);

/// Why `file` cannot be a plugin's file name (a folder, a hidden name, a core file's), or "".
std::string bad_plugin_file_name(const std::string& file);

/// What an output folder holds, sorted out before a new run claims it.
struct FolderSurvey {
  std::vector<std::string> run;      ///< the files of a run of trainkit's that are there (for messages)
  std::vector<std::string> foreign;  ///< files at the names trainkit writes that it did not write
  std::vector<std::filesystem::path> deletable;  ///< what --overwrite deletes: the run's files, files.json last
};

/// Surveys `dir`: a file at one of the names trainkit writes is the run's when files.json lists it
/// (or, in a folder written before files.json existed, when the folder carries trainkit's marks: a
/// resolved recipe.toml, a status.json); checkpoints/ holds the run's step-<N> folders and
/// `latest`, and anything else there is foreign. A report.html is the run's when it is a report.
FolderSurvey survey_folder(const std::filesystem::path& dir);

// ---- output.cpp: figures of a run for people ------------------------------------------------------

/// Peak resident memory of this process so far, in MiB.
double peak_rss_mib();
/// A loss or perplexity for people: 4 significant digits.
std::string fmt_loss(double v);

// ---- tensor_io.cpp ------------------------------------------------------------------------------

/// True the first time it is shown a tensor, false after (a tensor is its TensorImpl): a module
/// that registers one parameter under two names (a weight tied in a TorchScript module) lists it
/// twice, and it must still be stepped, normalized and counted once.
class FirstSight {
 public:
  bool operator()(const at::Tensor& t) { return seen_.insert(t.unsafeGetTensorImpl()).second; }

 private:
  std::set<const c10::TensorImpl*> seen_;
};
/// `tensors` with each tensor once, in the order of its first place (FirstSight).
inline std::vector<at::Tensor> distinct_tensors(const std::vector<at::Tensor>& tensors) {
  FirstSight first;
  std::vector<at::Tensor> out;
  for (const auto& t : tensors)
    if (first(t)) out.push_back(t);
  return out;
}
/// The same for named tensors (a module's `named_parameters()`): each tensor once, under its first
/// name.
template <class Named>
std::vector<std::pair<std::string, at::Tensor>> distinct_named(const Named& items) {
  FirstSight first;
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : items)
    if (first(item.value())) out.emplace_back(item.key(), item.value());
  return out;
}

/// What a checkpoint folder's run.json records of the run that wrote it (persist writes and reads
/// it; `[model] init` reads it to load a checkpoint's model.pt whole).
struct CheckpointRecord {
  int64_t world_size = 1;
  /// The ranks that each wrote the parameters they keep beside model.pt (model_share_file), or 0.
  int64_t model_shares = 0;
  std::vector<std::pair<std::string, std::string>> recipe;  ///< "section.key" -> TOML value
};
/// Writes `record` as `dir`/run.json, atomically.
void write_checkpoint_record(const std::filesystem::path& dir, const CheckpointRecord& record);
/// `dir`'s run.json; nullopt where there is none (a checkpoint of an older trainkit). A format newer
/// than this trainkit reads and a damaged file are refused (RunRefused: no retry reads more), naming it.
std::optional<CheckpointRecord> read_checkpoint_record(const std::filesystem::path& dir);
/// The file in which rank `r` writes the parameters it keeps (tk::ParameterKeepers) into a
/// checkpoint, beside rank 0's model.pt.
std::string model_share_file(int64_t r);
/// `file`'s tensors by name, with the `shares` files model-share-<rank>.pt beside it: for a
/// checkpoint's model.pt, its record's `model_shares`, so the whole model. Refuses (RunRefused: no
/// retry reads more) a share missing and a name that two files hold.
NamedTensors load_model_file(const std::filesystem::path& file, int64_t shares);

// ---- placement.cpp: where a launcher put this process (its environment; nothing connects) --------

/// Where this process sits, as the launcher's environment says (no connection made).
struct Placement {
  int rank = 0, size = 1, local_rank = 0;
  std::string addr = "127.0.0.1";
  int port = 29500;
  std::string source = "single process";  ///< which variables said so
};
/// The placement from RANK/WORLD_SIZE/LOCAL_RANK (torchrun, tk-run --nproc) or, in a task of an
/// srun step, SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID, with MASTER_ADDR and MASTER_PORT; a world
/// of one without them. Refuses values that are not a world (a rank outside it, a port that is no
/// port).
Placement placement_from_environment();
/// This process's rank on its machine as the launcher's environment says (the placement's rule),
/// or -1 when it says none: the GPU a process of a launch takes.
int local_rank_from_environment();
/// The ranks of a world of `world_size` on this machine, by the placement's rule: LOCAL_WORLD_SIZE
/// beside WORLD_SIZE (tk-run, torchrun), or in a task of an srun step this node's count in
/// SLURM_STEP_TASKS_PER_NODE; 1 where neither says, and never more than the world.
int local_world_size_from_environment(int world_size);
/// The same for the world the environment gives (1 where it gives none, or none that is a world:
/// placement_from_environment() refuses that by name).
int local_world_size_from_environment();
/// Node `node`'s entry (from 0) of Slurm's tasks-per-node list ("2(x3),1": two tasks on each of
/// the first three nodes, one on the fourth); 1 where the list does not say or cannot be read.
long slurm_tasks_on_node(const std::string& list, long node);
/// The first host of a Slurm node list ("node[01-04,07],gpu2" -> "node01"), where an srun step's
/// rendezvous runs when MASTER_ADDR is not set; refuses a list it cannot read, naming it.
std::string first_host(const std::string& list);

// ---- rng.cpp: the process's random generators (checkpoints, trials, back-offs) -------------------

/// The process's random generators by checkpoint key (the CPU's, each GPU's).
std::vector<std::pair<std::string, at::Generator>> generators();
/// The states of the process's random generators, to put back later.
using RngStates = std::vector<std::pair<at::Generator, at::Tensor>>;
RngStates save_rng();
void restore_rng(const RngStates& states);
/// The generators' states by checkpoint key, for trainer.pt.
NamedTensors rng_tensors();
/// Restores the generators from trainer.pt's tensors; `where` names the file in errors.
void load_rng_tensors(const std::map<std::string, at::Tensor>& saved, const std::string& where);

}  // namespace tk::detail
