#pragma once
/// Checkpoints at optimizer-step boundaries: everything needed to continue a run bit-identically.
#include <torch/optim/optimizer.h>

#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "tk/batch.h"
#include "tk/model.h"
#include "tk/run_plan.h"

// What this header declares is libtrainkit's interface: exported (the library hides the rest).
#pragma GCC visibility push(default)

namespace tk {

/// Where training stands at a boundary: the counters and the next micro-batch to read.
struct TrainingPosition {
  Counters counters;
  int64_t next_epoch = 0;
  int64_t next_batch = 0;
  int64_t micro_batch = 0;  ///< examples per micro-batch (per rank) that next_batch counts in (0: not recorded)
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
std::filesystem::path save_checkpoint(const std::filesystem::path& root, Model& model,
                                      torch::optim::Optimizer& optimizer,
                                      const std::vector<std::pair<std::string, StateDict>>& plugin_states,
                                      const TrainingPosition& position, const RunIdentity& identity, int64_t keep);

/// The checkpoint folder `arg` names: a checkpoint folder, a checkpoints root (its latest), or
/// "latest" (the latest under `output_dir`/checkpoints). When a root's `latest` file is missing or
/// names no complete checkpoint, the newest complete `step-<N>` is taken and `note` says so. The
/// error says what was looked for.
std::filesystem::path resolve_checkpoint(const std::string& arg, const std::filesystem::path& output_dir,
                                         std::string* note = nullptr);

/// The identity a checkpoint recorded; empty for a checkpoint written before trainkit recorded it.
std::optional<RunIdentity> read_run_identity(const std::filesystem::path& dir);

/// Restores model (parameters and buffers, by name, shapes checked), optimizer and the CPU RNG
/// from `dir`, and returns the position and plugin states.
Checkpoint load_checkpoint(const std::filesystem::path& dir, Model& model, torch::optim::Optimizer& optimizer);

}  // namespace tk

#pragma GCC visibility pop
