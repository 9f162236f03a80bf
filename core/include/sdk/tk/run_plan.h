#pragma once
/// The engine's vocabulary: the shape of a run, where a micro-batch sits in its window, counters.
#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>

#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "tk/capabilities.h"

// What this header declares is libtrainkit's interface: exported (the library hides the rest).
#pragma GCC visibility push(default)

namespace tk {

class World;

/// What to do with the short window at the end of an epoch.
enum class LastWindow { Step, Drop, Carry };
const char* to_string(LastWindow p) noexcept;

/// How the loss reduces over its items; plugins that normalize gradients check it.
enum class Reduction { Mean, Sum };
const char* to_string(Reduction r) noexcept;

/// Where the current micro-batch sits in its optimizer-step window; known before its forward pass.
struct Window {
  int64_t index = 0;       ///< 0-based position in the window
  int64_t size = 1;        ///< micro-batches in this window (short for a last window)
  int64_t configured = 1;  ///< the configured window size k
  bool is_last() const noexcept { return index + 1 == size; }
  bool is_first() const noexcept { return index == 0; }
  bool is_short() const noexcept { return size < configured; }
};

/// Step counters, updated by the core.
struct Counters {
  int64_t step = 0;           ///< optimizer steps taken (vetoed ones included)
  int64_t micro_step = 0;     ///< micro-batches processed in total
  int64_t epoch = 0;          ///< 0-based epoch of the current micro-batch
  int64_t batch_in_epoch = 0; ///< 0-based index of the micro-batch in its epoch
  int64_t samples_seen = 0;   ///< examples that went through forward and backward
  int64_t tokens_seen = 0;    ///< target items that counted toward the loss
  int64_t skipped_steps = 0;  ///< optimizer steps vetoed by a plugin
  int64_t schedule_step = 0;  ///< steps the LR schedule has advanced (a vetoed step may not advance it)
  int64_t total_steps = 0;    ///< optimizer steps the run will take (known before it starts)
};

/// Running totals of the current window, kept by the core (a sync plugin may replace them with
/// sums over all ranks before normalization).
struct WindowTotals {
  int64_t micro_batches = 0;  ///< micro-batches whose backward is done
  int64_t samples = 0;        ///< their examples
  int64_t tokens = 0;         ///< their counted target items
  /// Sum of the micro-batches' item-weighted losses, on the device (float64, 0-dim; undefined
  /// before the first backward; each backward adds to it in place, so a plugin that keeps a value
  /// clones it). It stays there until the boundary; a sync plugin all-reduces it in place. The core
  /// reads it once per step, after the boundary event, into loss_sum.
  at::Tensor loss;
  double loss_sum = 0.0;      ///< `loss` read to the host (after the boundary event), for the true window loss
};

/// How long a run trains: a number of epochs or a number of optimizer steps, never both.
struct Bound {
  enum class Unit { Epochs, Steps };
  Unit unit = Unit::Epochs;
  int64_t count = 1;
  bool by_steps() const noexcept { return unit == Unit::Steps; }
};

/// A linear ramp of the effective batch at the start of a run: from `from` examples per optimizer
/// step to the run's effective batch over the first `over` optimizer steps (or examples, over all
/// ranks), in whole micro-batches per rank. The core turns it into a window size per step.
struct BatchRamp {
  int64_t from = 0;          ///< effective batch of the first step (0: no ramp)
  int64_t over = 0;          ///< length of the ramp, in optimizer steps or examples
  bool by_samples = false;   ///< `over` counts examples (all ranks) rather than optimizer steps
  bool active() const noexcept { return from > 0 && over > 0; }
};

/// What a window plugin asks for in Plugin::configure (RunPlan::set_window): the window's size,
/// or the effective batch it follows from, and how the run treats it.
struct WindowRequest {
  /// Micro-batches per optimizer step (k); 0: inferred from `effective_batch` once every plugin
  /// is configured and the world size is known.
  int64_t steps = 1;
  LastWindow last_window = LastWindow::Step;
  /// Examples per optimizer step over all ranks (0: steps x micro_batch x world size). With it, an
  /// unset micro-batch is inferred from `steps`, and a set one is checked against it.
  int64_t effective_batch = 0;
  /// With [batch] micro_batch = "auto": the bytes one training step may take (0: the device's free
  /// memory, CUDA only); the core picks the largest micro-batch that fits.
  double memory_budget = 0;
  BatchRamp ramp;  ///< the effective batch's ramp, if any
};

#pragma GCC visibility push(hidden)  // the core's own: not exported
namespace detail {
struct PlanState;
struct PlanAccess;
}  // namespace detail
#pragma GCC visibility pop

/// The shape of a run, settled before training. Plugins shape it in Plugin::configure, through
/// set_window only; the core then settles what they left open (the window size from
/// an effective batch, the micro-batch from a memory budget). From on_fit_start on, it is final.
/// The core owns what lies behind it: a plugin sees the values, never the bookkeeping.
class RunPlan {
 public:
  /// Examples per micro-batch, per rank (0 while a micro-batch picked by memory is not yet picked:
  /// configure and setup).
  int64_t micro_batch() const noexcept;
  /// Micro-batches per optimizer step (the window size k; under a ramp, the final one).
  int64_t accumulation() const noexcept;
  /// micro_batch x accumulation x world_size.
  int64_t effective_batch() const noexcept;
  /// Examples per optimizer step over all ranks that the window plugin asked for (0: none).
  int64_t effective_batch_goal() const noexcept;
  /// Whether the recipe asked for [batch] micro_batch = "auto" (picked by memory).
  bool micro_batch_auto() const noexcept;
  /// The memory budget of a step when the micro-batch is picked by memory, in bytes.
  double memory_budget() const noexcept;
  /// Peak bytes of one training step measured at each candidate micro-batch, when picked by memory.
  const std::vector<std::pair<int64_t, double>>& measured_peaks() const noexcept;
  /// The level the memory planner picked for the run's memory lever (SetupContext::
  /// offer_memory_lever); -1 when no plugin offered one (from on_fit_start on).
  int64_t memory_level() const noexcept;
  const BatchRamp& ramp() const noexcept;
  LastWindow last_window() const noexcept;
  /// Processes that train together, and this one's rank (the run's world, tk/world.h).
  int world_size() const noexcept;
  int rank() const noexcept;
  /// The run's world: its ranks and their collectives (tk/world.h).
  World& world() const noexcept;
  /// How the recipe's loss reduces over its items.
  Reduction reduction() const noexcept;
  /// Where the model and the batches live.
  c10::DeviceType device() const noexcept;
  /// Whether some plugin of the run provides `cap` (tk/capabilities.h).
  bool has(const Capability& cap) const;
  /// Everything the run's plugins provide.
  const std::set<std::string>& capabilities() const noexcept;
  /// The plugin that set the window ("" when none did).
  const std::string& window_owner() const noexcept;
  /// Whether each gradient keeps its tensor from one optimizer step to the next (zeroed in place
  /// after the step) because a plugin asked for it (keep_gradients). Otherwise the core releases
  /// the gradients after each step, the next backward writes them afresh (no zeroing pass, no
  /// addition into zeros), and at the boundary a trainable parameter that no micro-batch of the
  /// window reached gets a zero gradient: from the boundary on, every trainable parameter has one
  /// either way, and the numbers are the same to the bit.
  bool gradients_kept() const noexcept;

  /// Sets the accumulation window (configure only). A second plugin trying to set it is refused,
  /// naming both.
  void set_window(const WindowRequest& request);
  /// Keeps each gradient's tensor between optimizer steps (configure only): for a plugin that holds
  /// the gradient tensors themselves from one window to the next (data parallel's reducer makes
  /// them views of its buckets). Costs a pass over the gradients after each step, to zero them.
  void keep_gradients();

  RunPlan(const RunPlan&) = delete;
  RunPlan& operator=(const RunPlan&) = delete;

 private:
  friend struct detail::PlanAccess;
  explicit RunPlan(detail::PlanState* state) noexcept : s_(state) {}
  detail::PlanState* s_;
};

}  // namespace tk

#pragma GCC visibility pop
