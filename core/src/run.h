#pragma once
// The parts of a run and the functions that build, plan, check and train it, each named with the
// file that holds it. Not installed. Each file uses only the ones before it in this order (no
// cycle): components, libraries, data_check, rng, memory, planning, checkpoint, resume, describe,
// verify, prefetch, outputs, loop, trainer.
#include <torch/optim/optimizer.h>

#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "files.h"
#include "readable.h"
#include "run_folder.h"
#include "state.h"
#include "tk/checkpoint.h"
#include "tk/components.h"
#include "tk/output.h"
#include "tk/plan.h"
#include "tk/plugin.h"
#include "tk/recipe.h"
#include "tk/registry.h"
#include "tk/trainer.h"

namespace tk::detail {

/// Counts of steps, micro-batches or examples beyond this (~10^12) are beyond any machine: they are
/// refused rather than left to overflow.
constexpr int64_t kMaxCount = int64_t{1} << 40;

/// One `[[plugins]]` entry (or a plugin added in code). A library that only registers components
/// has no instance.
struct Slot {
  std::shared_ptr<Plugin> plugin;
  std::string name, version, file;
};

/// Everything a run is made of. assemble() fills the components from a recipe; plan_run() settles
/// the plan, runs the plugins' setup and makes the optimizer.
struct Run {
  Registry registry;  // first: the libraries outlive everything made from them
  // Second: a plugin added in code may hold the only handle on its library, and its setup may
  // have put that library's code into the model; the model, data and optimizer go first.
  std::vector<Slot> slots;
  Dispatch dispatch;    // who the core calls now (setup, configure, write_files)

  Options run, data_opts, model_opts, loss_opts, opt_opts, sched_opts;
  std::string model_name, data_name, loss_name, opt_name, sched_name;
  ResolvedRecipe resolved;  // what the run was made of, section by section
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  uint64_t seed = 0;
  Bound bound;
  double max_time_s = 0;
  bool tracing = false;  // run.trace, read once: dispatch is on the per-micro-batch path

  DataSplits data;
  ModelPtr model;
  std::unique_ptr<LossFn> loss;
  const Component<OptimizerMaker>* optimizer_maker = nullptr;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  /// The plugins' optimizer wraps (SetupContext::wrap_optimizer), in dispatch order.
  std::vector<std::pair<std::string, OptimizerWrap>> optimizer_wraps;
  std::pair<std::string, MemoryLever> memory_lever;  ///< offered in setup (empty name: none)
  std::unique_ptr<LrSchedule> schedule;
  double base_lr = 0.0;

  bool planned = false;
  std::string planning_error;  // why planning failed: setup may have changed the model, no retry
  PlanState plan;
  std::vector<size_t> order;  // dispatch order of slots that hold a plugin
  int64_t batches_per_epoch = 0, total_steps = 0;
  std::unique_ptr<WindowSchedule> windows;
  std::vector<std::string> warnings;

  Run();
  void warn(const std::string& msg);
  /// Examples this rank sees per epoch: all of them alone; with several ranks, an equal share
  /// (the remainder of the division, under world_size examples, is left out of that epoch).
  int64_t shard_size() const { return data.train->size() / plan.world_size; }
  /// This rank's examples of `epoch`, in order: the same seeded shuffle on every rank, strided by rank.
  at::Tensor shard_order(int64_t epoch) const;
  /// The examples at `indices` of `ds`, on the run's device; floating tensors in the run's dtype.
  Batch fetch(const Dataset& ds, const at::Tensor& indices) const;
  /// A batch tensor moved to `to`: floating ones in the run's dtype, others as they are.
  at::Tensor place(const at::Tensor& t, at::Device to, bool non_blocking = false) const;
  /// Runs `fn` as plugin `slot`'s hook `hook` (configure, setup, write_files, load_state), its
  /// failure reported with the plugin's name and file.
  void call_plugin(const Slot& slot, const char* hook, const std::function<void()>& fn);
};

// ---- libraries.cpp: the recipe's libraries and plugins ---------------------------------------------

/// Reads [run], loads trainkit's standard libraries and every `[[plugins]]` library, makes the
/// plugins with their options, and builds data, model, loss and schedule (components.cpp).
void assemble(Run& run, const Recipe& recipe, const TrainerOptions& opts);
/// Adds a plugin made in code: prepared already, or prepared here with `name` and `options` (TOML).
void add_plugin(Run& run, std::shared_ptr<Plugin> plugin, const std::string& name, const std::string& options,
                uint32_t hooks);
/// What a launcher needs to know of a recipe's plugins without building a run: the capabilities
/// they provide. The recipe's sections and the plugins' options are checked on the way (plugins
/// loaded and given their options; no data, model or memory trial).
std::set<std::string> provided_capabilities(const Recipe& recipe, const TrainerOptions& opts);

// ---- components.cpp: [run] and the components of the recipe's sections -----------------------------

/// The settings of [run]: bound, dtype, device, time limit.
void read_run_section(Run& run, const Recipe& recipe);
/// Data, model, loss, optimizer (checked now, made after setup) and schedule.
void build_components(Run& run, const Recipe& recipe);
/// The component sections' names and options checked against what is registered, nothing made
/// (what a launcher checks before it starts workers).
void check_component_sections(Run& run, const Recipe& recipe);
/// Makes the optimizer over the model's trainable parameters (again, after a trial step).
void make_optimizer(Run& run);
/// Zeroes the gradients of the optimizer's parameters in place, keeping their storage (data
/// parallel's gradients are views of its buckets), on every LibTorch (2.x's zero_grad drops them,
/// 1.x's detaches them in place, which views refuse). A parameter without one gets a zero
/// gradient: every trainable parameter holds one from the start of training, so a step that does
/// not use a parameter steps it with a zero gradient in a fresh run, a resumed one and on every
/// rank alike.
void zero_grads(Run& run);
/// An error about the effective batch, at the recipe line of the window plugin's option `key`
/// when it has one (planning and the memory pick refuse with it).
[[noreturn]] void refuse_window(const Run& run, const std::string& key, const std::string& what);

// ---- data_check.cpp: the data and the model checked before training ---------------------------------

/// The data checked (finite inputs, targets of the loss's kind and range), then one micro-batch
/// through the model and the loss in eval mode, so that a model that does not fit its data is
/// refused naming both.
void check_data_and_model(Run& run);

// ---- rng.cpp: the process's random generators (checkpoints and trials) -------------------------------

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

// ---- memory.cpp: measured memory, trial steps, the micro-batch picked by memory ---------------------

/// Undoes a trial step on the run's model when it goes out of scope: parameters, buffers and
/// random generators put back, gradients cleared, the optimizer made anew.
class TrialGuard {
 public:
  explicit TrialGuard(Run& r);
  ~TrialGuard();
  TrialGuard(const TrialGuard&) = delete;
  TrialGuard& operator=(const TrialGuard&) = delete;

 private:
  Run& r_;
  std::vector<at::Tensor> params_, buffers_;
  RngStates rng_;
};
/// Peak tensor memory of one stretch of a run (a trial step, a training step) on the run's
/// device: on the CPU, every byte LibTorch's CPU allocator hands out while the meter lives, plus
/// the model's parameters and buffers; on CUDA, the caching allocator's peak.
class MemoryMeter {
 public:
  explicit MemoryMeter(const Run& r);
  ~MemoryMeter();
  MemoryMeter(const MemoryMeter&) = delete;
  MemoryMeter& operator=(const MemoryMeter&) = delete;
  /// Peak bytes since the previous call (or the start); a new stretch starts.
  double take_peak();

 private:
  static constexpr uint8_t kPriority = 200;  // above LibTorch's own CPU allocator registration
  at::Device device_;
  double resident_ = 0;
  c10::Allocator* previous_ = nullptr;
};
/// With [data] micro_batch = "auto": measures the peak memory of trial steps and picks the largest
/// micro-batch that fits the budget; every trial is undone.
void pick_micro_batch(Run& run);
/// The divisors of n, ascending.
std::vector<int64_t> divisors_of(int64_t n);

// ---- planning.cpp: the plan, the plugins' configure and setup, the windows ----------------------------

/// Lets the plugins shape the plan and the model, orders them, makes the optimizer (idempotent).
void plan_run(Run& run);
/// After the plugins' configure: infers the window size or the micro-batch from an effective
/// batch a plugin asked for, refusing a combination that does not add up.
void settle_window(Run& run);
/// Micro-batches per epoch, the window schedule and the run's length, from the plan.
void shape_windows(Run& run);
/// Changes the micro-batch to `m`, keeping the examples per optimizer step (k grows to match).
void rebatch(Run& run, int64_t m);
/// The micro-batch to fall back to after an out-of-memory error: the largest that divides the
/// examples per step and is at most half the current one (0: none).
int64_t backed_off_micro_batch(const Run& run);

// ---- resume.cpp: what a run is, and continuing one from a checkpoint ----------------------------------

/// What determines `run`: its resolved recipe without the keys that may change on resume, and its
/// world size.
RunIdentity run_identity(const Run& run);
/// Restores model, optimizer, RNG and plugin states from the checkpoint `which` names (a folder or
/// "latest" of `output_dir`); refuses, listing each difference, a checkpoint whose run differs from
/// `identity` in anything but the keys `allowed` names.
Checkpoint resume_from(Run& run, const std::string& which, const std::filesystem::path& output_dir,
                       const RunIdentity& identity, const std::vector<std::string>& allowed);

// ---- verify.cpp, describe.cpp -------------------------------------------------------------------------

/// The first window's gradient accumulated vs in one batch; the run is planned.
AccumulationCheck verify_accumulation(Run& run);
/// The resolved plan as `tk-run --dry-run` prints it.
std::string describe(Run& run, const Recipe& recipe);

// ---- outputs.cpp: the output folder -------------------------------------------------------------------

/// The run's output folder: the resolved recipe, metrics.jsonl, checkpoints, weights.pt, the
/// plugins' files. Inactive (every call a no-op) when outputs are off or on ranks other than 0.
/// Every write is checked; a failed one throws naming the file, and what was written before stays.
class RunOutputs {
 public:
  RunOutputs(const Run& run, const Recipe& recipe, const TrainerOptions& opts);
  /// Whether this process writes the run's files (rank 0, outputs on).
  bool active() const noexcept { return active_; }
  /// Whether the run writes files at all (on some rank): checkpoints are then taken.
  bool writes() const noexcept { return writes_; }
  const std::filesystem::path& dir() const noexcept { return dir_; }
  /// What determines this run, as its checkpoints record it.
  const RunIdentity& identity() const noexcept { return identity_; }
  /// Creates the folder and locks it for this run's life (another live run there is refused,
  /// naming its PID). Unless resuming, a folder that holds another run is refused, or with
  /// `overwrite` cleared of that run's files (the plugins' among them).
  void claim();
  /// Writes the resolved recipe and opens metrics.jsonl (when resuming: cut back to the
  /// checkpoint's step, a torn last line dropped).
  void open(const std::optional<Checkpoint>& resumed);
  /// Appends one record to metrics.jsonl.
  void record(const JsonLine& line);
  /// Checkpoints the run after micro-batch `b` of `epoch`, the records so far synced to disk first;
  /// returns the checkpoint folder.
  std::filesystem::path checkpoint(Run& run, const Counters& counters, int64_t epoch, int64_t b);
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

  bool active_ = false, writes_ = false, resuming_ = false, overwrite_ = false;
  std::filesystem::path dir_;
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

// ---- loop.cpp ------------------------------------------------------------------------------------------

/// Trains an assembled run.
FitResult train(Run& run, const Recipe& recipe, const TrainerOptions& opts, std::vector<TraceEntry>& trace);

}  // namespace tk::detail
