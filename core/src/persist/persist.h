#pragma once
// The persist layer: what a run keeps on disk. Its output folder (lock, resolved recipe,
// metrics.jsonl, status.json, checkpoints, weights, the plugins' files), its identity as
// checkpoints record it, and the resume from a checkpoint. Not installed.
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "run/run.h"
#include "support/support.h"
#include "tk/output.h"
#include "tk/trainer.h"

// ---- checkpoint.cpp: checkpoints at optimizer-step boundaries, all a run needs to continue bit-identically

namespace tk {
class ShardedState;

/// Where training stands at a boundary: the counters and the next micro-batch to read.
/// What the whole world has trained on so far (a rank's Counters count its own share).
struct WorldSeen {
  int64_t samples = 0;  ///< examples, every rank's
  int64_t tokens = 0;   ///< counted target items, every rank's
};

struct TrainingPosition {
  Counters counters;
  int64_t next_epoch = 0;
  int64_t next_batch = 0;
  int64_t micro_batch = 0;   ///< examples per micro-batch (per rank) that next_batch counts in (0: not recorded)
  int64_t accumulation = 0;  ///< micro-batches per window on each rank (0: not recorded)
  int64_t world_size = 0;    ///< the ranks that trained it (0: not recorded)
  WorldSeen seen;            ///< the world's counts (recorded, or a rank's times the world size)
};

/// What determines a run, recorded in each checkpoint (run.json) so that resuming it with anything
/// else is refused rather than silently trained on: the resolved recipe (without the keys that may
/// change on resume) and the world size.
struct RunIdentity {
  std::vector<std::pair<std::string, std::string>> recipe;  ///< "section.key" -> TOML value
  int64_t world_size = 1;
  /// The keys of `recipe` at their option's default, not set by the recipe (this run's own view;
  /// run.json does not record it): a key a checkpoint lacks is no difference when it is one of them.
  std::set<std::string> defaults;
  /// Keys of retired options (OptionSpec::retired), this run's view, each with the key it moved to
  /// ("" when it went): a checkpoint that records one is compared at its new key, or differs in
  /// nothing by it.
  std::map<std::string, std::string> retired;
};

/// What load_checkpoint() hands back beyond the model and optimizer it restores.
struct Checkpoint {
  std::filesystem::path dir;
  TrainingPosition position;
  std::map<std::string, StateDict> plugin_states;
};

/// Writes `<root>/step-<N>/` (model.pt, optimizer.pt, trainer.pt, plugin-<name>.pt, run.json)
/// through a temporary folder, fsync and a rename, so that a crash or a full disk mid-write leaves
/// the previous checkpoints intact (the partial folder is removed on a failure); then points
/// `<root>/latest` at it and keeps the newest `keep` checkpoints.
/// An optimizer sharded over the ranks (tk::ShardedState) has every rank write its own share
/// (optimizer-share-<rank>.pt) at the same time: rank 0 here, the others in
/// save_checkpoint_share(); optimizer.pt then holds their count. `failed`: what stopped rank 0
/// before it (the checkpoint then fails on every rank, none left waiting).
std::filesystem::path save_checkpoint(const std::filesystem::path& root, Model& model,
                                      torch::optim::Optimizer& optimizer, World& world,
                                      const std::vector<std::pair<std::string, StateDict>>& plugin_states,
                                      const TrainingPosition& position, const RunIdentity& identity, int64_t keep,
                                      std::string failed = "");

/// A rank other than 0, while rank 0 writes the checkpoint of `step` under `root`: its share of
/// the optimizer state (a tk::ShardedState) and, for one that says which rank keeps each
/// parameter (tk::ParameterKeepers), of the model's parameters. Throws on every rank when any rank
/// could not write its share.
void save_checkpoint_share(const std::filesystem::path& root, int64_t step, Model& model,
                           const torch::optim::Optimizer& optimizer, World& world);

/// Every rank, before training with an optimizer sharded over the ranks: refuses the run when a
/// rank does not see the checkpoint folder `root` that rank 0 writes in (a run on several machines
/// without a shared file system), rather than at its first checkpoint.
void check_folder_shared(const std::filesystem::path& root, World& world);

/// The checkpoint at `root` (a checkpoint folder, or a checkpoints folder: its latest); when
/// `latest` is missing or names no complete checkpoint, the newest complete `step-<N>`, and `note`
/// says so. None when there is no complete checkpoint there.
std::optional<std::filesystem::path> find_checkpoint(const std::filesystem::path& root, std::string* note = nullptr);

/// Where checkpoint `dir` stands (its trainer.pt's position), without loading anything else.
TrainingPosition checkpoint_position(const std::filesystem::path& dir, const std::optional<detail::CheckpointRecord>& record);

/// The checkpoint folder `arg` names: a checkpoint folder, a checkpoints root (its latest), or
/// "latest" (the latest under `output_dir`/checkpoints). When a root's `latest` file is missing or
/// names no complete checkpoint, the newest complete `step-<N>` is taken and `note` says so. The
/// error says what was looked for.
std::filesystem::path resolve_checkpoint(const std::string& arg, const std::filesystem::path& output_dir,
                                         std::string* note = nullptr);

/// Restores model (parameters and buffers, by name, shapes checked), optimizer and the CPU RNG
/// from `dir`, and returns the position and plugin states. `record`: `dir`'s run.json
/// (detail::read_checkpoint_record), none for a checkpoint written before trainkit recorded it.
Checkpoint load_checkpoint(const std::filesystem::path& dir, const std::optional<detail::CheckpointRecord>& record,
                           Model& model, torch::optim::Optimizer& optimizer);
/// Refuses (RunRefused) `dir`'s optimizer state where it was saved in shares and `optimizer` is
/// not sharded, as loading it would: by the files, nothing read.
void check_optimizer_kind(const std::filesystem::path& dir, const torch::optim::Optimizer& optimizer);

}  // namespace tk

namespace tk::detail {

// ---- resume.cpp: what a run is, and continuing one from a checkpoint ----------------------------------

/// The identity's key for what the data set's files hold (DataInfo::fingerprint): beside the recipe's
/// keys, in the [data] section, so that `--allow-change data.fingerprint` lets a change of the files
/// through, and `--allow-change data` any change of the data.
inline constexpr const char* kDataKey = "data.fingerprint";
/// Whether recipe `key` ("run.log_every") may change between a run and its resume without changing
/// what the run trains.
bool may_change_on_resume(const std::string& key);
/// What determines `run`: its resolved recipe without the keys that may change on resume, what its
/// data set's files hold, and its world size.
RunIdentity run_identity(const Run& run);
/// Every rank of a world trains the same recipe: each compares `identity` (hashed, key by key) with
/// rank 0's and the world refuses the run when one differs, that rank naming its keys and values
/// (launchers given different recipes or --set options). Nothing to compare in a world of one.
void agree_on_identity(World& world, const RunIdentity& identity);
/// A checkpoint written by another number of ranks than this run's: the micro-batch and window
/// re-derived so that every step ahead takes the examples it takes on the ranks that wrote it
/// (the checkpoint's micro-batch with another window where the run may accumulate, else its window
/// with another micro-batch), the windows reshaped and the position converted; refused, naming
/// why and the world sizes that would go on exactly, when no split does. On the same world, a
/// split that differs from the checkpoint's is carried over alike: the recipe's, where a change of
/// the batch was let through (`split_allowed`: refused when its steps take another number of
/// examples), else the checkpoint's own (a run that went on from another world size).
void continue_on_world(Run& run, Checkpoint& checkpoint, bool split_allowed);
/// What continue_on_world refuses of a checkpoint at `position` (in `dir`), without changing the
/// run: a dry run's check.
void check_continuation(const Run& run, const TrainingPosition& position, const std::filesystem::path& dir, bool split_allowed);
/// The checkpoint "--resume auto" continues: the newest complete one under `output_dir`, none when
/// there is none; refused when the ranks of a world find different ones.
std::optional<std::filesystem::path> checkpoint_to_continue(Run& run, const std::filesystem::path& output_dir);
/// Restores model, optimizer, RNG and plugin states from the checkpoint `which` names (a folder or
/// "latest" of `output_dir`); refuses, listing each difference, a checkpoint whose run differs from
/// `identity` in anything but the keys `allowed` names.
Checkpoint resume_from(Run& run, const std::string& which, const std::filesystem::path& output_dir,
                       const RunIdentity& identity, const std::vector<std::string>& allowed);
/// A dry run's line for a resume (`which` as resume_from takes it, or "auto"): the checkpoint it
/// would continue and what --allow-change lets through; refused as resume_from refuses a run that
/// differs. Reads the checkpoint's record, no tensor.
std::string resume_plan(const Run& run, const std::string& which, const std::vector<std::string>& allowed);

// ---- run_outputs.cpp: the output folder -------------------------------------------------------------------

/// The run's output folder: the resolved recipe, metrics.jsonl, checkpoints, weights.pt, the
/// plugins' files. Inactive (every call a no-op) when outputs are off or on ranks other than 0.
/// Every write is checked; a failed one throws naming the file, and what was written before stays.
class RunOutputs {
 public:
  RunOutputs(const Run& run, const Recipe& recipe, const TrainerOptions& opts);
  /// A run refused before it wrote anything leaves no folder that claim() made (nor its lock file).
  ~RunOutputs();
  RunOutputs(const RunOutputs&) = delete;
  RunOutputs& operator=(const RunOutputs&) = delete;
  /// Whether this process writes the run's files (rank 0, outputs on).
  bool active() const noexcept { return active_; }
  /// Whether the run writes files at all (on some rank): checkpoints are then taken.
  bool writes() const noexcept { return writes_; }
  const std::filesystem::path& dir() const noexcept { return dir_; }
  /// What determines this run, as its checkpoints record it.
  const RunIdentity& identity() const noexcept { return identity_; }
  /// Creates the folder and locks it for this run's life (another live run there is refused,
  /// naming its PID). Unless resuming (or resuming "auto"), a folder that holds another run is
  /// refused, or with `overwrite` cleared of that run's files (the plugins' among them).
  void claim();
  /// Whether the run resumes "auto": from its newest checkpoint, or afresh when it has none.
  bool resumes_auto() const noexcept { return auto_; }
  /// A run resumed "auto" that finds no checkpoint starts afresh: over the files of a run of this
  /// very resolved recipe (one that stopped before its first checkpoint), deleting them; a folder
  /// that holds another run is refused as claim() refuses it.
  void start_afresh();
  /// Writes the resolved recipe and opens metrics.jsonl (when resuming: cut back to the
  /// checkpoint's step, a torn last line dropped).
  void open(const std::optional<Checkpoint>& resumed);
  /// Appends one record to metrics.jsonl.
  void record(const JsonLine& line);
  /// Checkpoints the run after micro-batch `b` of `epoch`, the records so far synced to disk first;
  /// returns the checkpoint folder.
  std::filesystem::path checkpoint(Run& run, const Counters& counters, const WorldSeen& seen, int64_t epoch, int64_t b);
  /// weights.pt, trace.jsonl when tracing, and for a completed run every plugin's files
  /// (Plugin::write_files).
  void finish(Run& run, const std::vector<TraceEntry>& trace, bool completed);
  /// A resumed run that was already complete: weights.pt, and the files of each plugin that has
  /// one missing, written again.
  void complete_again(Run& run);
  /// status.json: where the run stands ("running", "completed", "max_time", "signal", "failed"),
  /// its step, and for a failure the error. Replaced atomically; a run killed outright leaves
  /// "running" behind, with the PID that held the folder.
  void status(const char* state, int64_t step, const std::string& detail = {}) const;
  /// The state status.json holds ("" when there is none, or it cannot be read).
  std::string recorded_status() const;
  /// The files written or rewritten so far, by name.
  const std::vector<std::string>& written() const noexcept { return written_; }

 private:
  void write_weights(const Run& run);
  void write_plugin_files(Run& run, bool only_missing);
  /// Records `file` as plugin `plugin`'s in files.json before it is written.
  void record_plugin_file(const std::string& plugin, const std::string& file);
  /// Records `file` as the core's in files.json before it is written (once).
  void own(const std::string& file) const;
  /// files.json as it is; refuses a damaged one.
  Manifest load_manifest() const;
  /// The run's record of its files, read from files.json when first needed.
  Manifest& manifest() const;
  void wrote(const std::string& file);

  /// Clears the folder for a new run (claim()): `same_run_may_restart` lets a run of this very
  /// resolved recipe be deleted without `overwrite`.
  void clear_for_new_run(bool same_run_may_restart);
  /// Refuses a start over when checkpoints/ holds a step-<N> folder (none of them complete).
  void refuse_unfinished_checkpoints() const;

  bool active_ = false, writes_ = false, resuming_ = false, auto_ = false, overwrite_ = false;
  std::filesystem::path dir_;
  std::filesystem::path made_;  // the outermost folder claim() created ("" when dir_ was there)
  std::string where_;  // the recipe's place that names it (run.output, else run.name)
  bool named_ = false;  // resumed from a checkpoint folder given by hand (not "latest" or "auto")
  const Recipe& recipe_;
  const ResolvedRecipe& resolved_;
  RunIdentity identity_;
  FolderLock lock_;
  AppendFile metrics_;
  std::vector<std::string> written_;
  mutable Manifest manifest_;  // files.json as this run keeps it (read when first needed)
  mutable bool manifest_loaded_ = false;
};

/// The folder a run writes: run.output, else runs/<run.name>.
std::filesystem::path output_dir_of(const Run& run);

}  // namespace tk::detail
