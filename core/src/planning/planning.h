#pragma once
// The planning layer: the plan settled before training. The plugins' configure and order, the
// window from an effective batch, setup, the micro-batch picked by measured memory, the windows,
// the checks of data and model; the printed plan and the accumulation verifier. Not installed.
#include <c10/core/Allocator.h>

#include <string>
#include <unordered_set>
#include <vector>

#include "run/run.h"
#include "support/support.h"
#include "tk/trainer.h"

namespace tk::detail {

// ---- configure.cpp: the plan, the plugins' configure and setup ---------------------------------

/// Lets the plugins shape the plan and the model, orders them, makes the optimizer (idempotent).
void plan_run(Run& run);

// ---- geometry.cpp: the batch's shape, its one owner ------------------------------------------------

/// The batch's shape from [batch] (and the deprecated [data] micro_batch, with a warning), into
/// the plan, before the plugins configure it.
void read_batch(Run& run);
/// Whether the recipe gave the micro-batch ([batch], or the deprecated [data]).
bool micro_batch_given(const Run& run);
/// After the plugins' configure: a plugin's set_window taken (deprecated, with a warning), then
/// the window size or the micro-batch inferred from the effective batch, refusing a combination
/// that does not add up.
void settle_window(Run& run);
/// The micro-batch the memory planner picked; the window size follows from the effective batch.
void set_picked_micro_batch(Run& run, int64_t m);
/// The plan's shape for trial steps (micro-batch `m`, window `k`, a run of `steps`) while it lives,
/// the plan's own (still open before the memory pick) put back after.
class TrialShape {
 public:
  TrialShape(Run& run, int64_t m, int64_t k, int64_t steps);
  ~TrialShape();
  TrialShape(const TrialShape&) = delete;
  TrialShape& operator=(const TrialShape&) = delete;

 private:
  Run& r_;
  int64_t m_, k_, steps_;
};
/// Micro-batches per epoch, the window schedule and the run's length, from the plan.
void shape_windows(Run& run);
/// Changes the micro-batch to `m`, keeping the examples per optimizer step (k grows to match).
void rebatch(Run& run, int64_t m);
/// The micro-batch to fall back to after an out-of-memory error: the largest that divides the
/// examples per step and is at most half the current one (0: none).
int64_t backed_off_micro_batch(const Run& run);
/// An error about the batch's shape at the recipe line of [batch] `key` (or where a deprecated
/// setting gave it: [batch], the deprecated [data] micro_batch, the option of the plugin that set the window).
[[noreturn]] void refuse_window(const Run& run, const std::string& key, const std::string& what);

// ---- data_check.cpp: the data and the model checked before training ---------------------------------

/// The data checked (finite inputs, targets of the loss's kind and range), then one micro-batch
/// through the model and the loss in eval mode, so that a model that does not fit its data is
/// refused naming both.
void check_data_and_model(Run& run);

// ---- memory.cpp: measured memory, trial steps, the micro-batch picked by memory ---------------------

/// Undoes trial steps (TrialRun) on the run: parameters, buffers and random generators put back,
/// gradients cleared, the optimizer made anew, and every plugin's state() given back to its
/// load_state() (a plugin whose state() was empty is not called), with the events it declined.
class TrialGuard {
 public:
  explicit TrialGuard(Run& r);
  /// restore(), unless it ran; its errors are dropped here (another error is on its way).
  ~TrialGuard();
  TrialGuard(const TrialGuard&) = delete;
  TrialGuard& operator=(const TrialGuard&) = delete;
  /// Puts everything back; a plugin's load_state() that fails is reported, naming it.
  void restore();

 private:
  void restore_tensors();

  Run& r_;
  std::vector<at::Tensor> params_, buffers_;
  RngStates rng_;
  std::vector<std::pair<const Slot*, StateDict>> states_;
  std::vector<std::pair<Plugin*, uint32_t>> declined_;
  bool restored_ = false;
};
/// Peak tensor memory of one stretch of a run (a trial step, a training step) on the run's
/// device: on the CPU, every byte LibTorch's CPU allocator hands out while the meter lives, plus
/// what the step holds that was made before (parameters, buffers, gradients, the optimizer's
/// state); on CUDA, the caching allocator's peak.
class MemoryMeter {
 public:
  explicit MemoryMeter(const Run& r);
  ~MemoryMeter();
  MemoryMeter(const MemoryMeter&) = delete;
  MemoryMeter& operator=(const MemoryMeter&) = delete;
  /// Peak bytes since the previous call (or the start); a new stretch starts.
  double take_peak();

 private:
  /// Bytes of the parameters' memory of their own that was made before any meter, was there when
  /// this one started and still is (another meter's is followed by the allocator); kept as
  /// params_resident_.
  double held_parameter_bytes();

  static constexpr uint8_t kPriority = 200;  // above LibTorch's own CPU allocator registration
  at::Device device_;
  ModelPtr model_;
  std::unordered_set<const void*> params_at_start_;  // the memory of each parameter at the start
  double resident_ = 0, params_resident_ = 0;
  c10::Allocator* previous_ = nullptr;
};

// ---- zero_stages.cpp (pure: tested on its own), state_bytes.cpp: ZeRO's arithmetic on a measured step ----

/// The training state of a step (parameters, gradients, the optimizer's state), the whole model's
/// and what this rank holds after the step, for ZeRO's arithmetic.
struct TrainingState {
  double params = 0;                 ///< the bytes of parameters this rank holds
  double optimizer = 0;              ///< this rank's optimizer state
  bool optimizer_known = true;       ///< whether the optimizer reports its state's size
  double trainable = 0, frozen = 0;  ///< the model's parameters, whole
  double optimizer_whole = 0;        ///< every rank's optimizer state together (a sharded one's shares)
  double largest_block = 0, loose = 0;  ///< trainable bytes of the largest block, of those in no block
  /// Trainable bytes of the largest run of neighbouring blocks whose gradients stages 2 and 3 sum
  /// in one bucket (small blocks together); 0: the largest block's.
  double largest_bucket = 0;
  double largest_tensor = 0;         ///< the largest trainable tensor's bytes: a rank's share is never less
  int64_t tensors = 0;               ///< trainable tensors: shards of whole tensors need as many for as many ranks
  int stage = 0;                     ///< the ZeRO stage the step is at (from the plugins' capabilities)
  /// Each rank's bytes of it, with the buffers its sharding needs, at stages 0 to 3 over `n` ranks.
  std::vector<double> per_rank(int64_t n) const;
  /// What `here` of those `n` ranks hold together on one machine: each its unsharded part and
  /// buffers, and their shares of the sharded state, together never more than the whole of it.
  std::vector<double> on_machine(int64_t n, int64_t here) const;
  /// At stage 3, what `here` ranks hold as the model is built and as the fit ends: the whole
  /// weights each, beside their shares of the optimizer's state (each step releases the gradients).
  double whole_weights(int64_t n, int64_t here) const;
  /// The most `here` of `n` ranks hold together at stage `st`: on_machine's, and at stage 3 never
  /// less than whole_weights.
  double most(size_t st, int64_t n, int64_t here) const;
  /// The largest part of a sharded state one of `n` ranks holds (1/n, or its largest tensor's part).
  double share(int64_t n) const;
  /// "parameters X, gradients Y, optimizer state Z": the state unsharded, as refusals spell it.
  std::string unsharded() const;
  /// Its bytes: parameters, gradients and optimizer state, unsharded.
  double whole() const { return frozen + 2 * trainable + optimizer_whole; }
};
/// The training state of a step whose `peak` does not fit `limit` bytes, and which ZeRO stage over
/// the world (over 2 ranks on one) would make it fit: the measured step with each stage's state in
/// place of its own, from the stage measured up. The tail of the memory planner's refusal. The
/// fewest ranks it names are a number `batch` (the effective batch, where the recipe sets one;
/// else 0) divides by.
std::string sharding_advice(const TrainingState& s, double peak, double limit, int64_t world_size, int64_t batch = 0);
/// Before any step: why a run whose training state is `s` (its optimizer's state as a step will
/// make it), at its stage over `world_size` ranks of which `local` share this machine's `have`
/// bytes (`have_note`: where that figure comes from, after it), cannot fit them, and where it
/// would: the fewest machines for each stage, with as many ranks on each or, where none fits so,
/// the most fewer that do; empty when it fits.
std::string state_overflow(const TrainingState& s, int64_t world_size, int64_t local, double have,
                           const std::string& have_note = "");
/// After a step, on every rank (it sums the shares of a sharded optimizer's state over the world);
/// `local`: this rank's alone, no collective (before any step, when no state is held yet).
TrainingState measure_training_state(Run& r, bool local = false);
/// Before any trial or step, on every rank of a run on the CPU: refuses (RecipeError at the model's
/// section) a run whose training state, at the ZeRO stage its plugins provide, cannot fit this
/// machine's memory beside the other ranks on it. The optimizer's state is reckoned from the
/// recipe's optimizer stepped once on a probe (Adam's two moments where it does not say).
void check_state_fits(Run& r);
/// The plan's line on the training state: its size unsharded, and at the run's stage over its
/// ranks what each holds (the most, where one tensor makes the shares uneven).
std::string describe_state(Run& r);
/// With [batch] micro_batch = "auto": measures the peak memory of trial steps and picks the largest
/// micro-batch that fits the budget; every trial is undone.
void pick_micro_batch(Run& run);
/// The divisors of n, ascending.
std::vector<int64_t> divisors_of(int64_t n);

// ---- verify.cpp, describe.cpp -------------------------------------------------------------------------

/// The first window's gradient accumulated vs in one batch; the run is planned.
AccumulationCheck verify_accumulation(Run& run);
/// The resolved plan as `tk-run --dry-run` prints it.
std::string describe(Run& run, const Recipe& recipe);

}  // namespace tk::detail
