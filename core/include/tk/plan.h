#pragma once
/// Pure planning logic: where each micro-batch sits in its window, and in which order plugins run.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "tk/plugin.h"
#include "tk/run_plan.h"

// What this header declares is libtrainkit's interface: exported (the library hides the rest).
#pragma GCC visibility push(default)

namespace tk {

/// Where each micro-batch sits in its optimizer-step window, for a window size (fixed, or ramping
/// with the effective batch) and a last-window policy.
class WindowSchedule {
 public:
  /// `batches_per_epoch` micro-batches per epoch; `epochs` = 0 when the run is bounded by steps.
  WindowSchedule(int64_t batches_per_epoch, int64_t k, LastWindow policy, int64_t epochs);

  /// Makes the window size follow `ramp` up to the run's `effective` batch: at each window's start,
  /// effective batch x / `unit` micro-batches (unit = micro-batch x world size, x rounded down to
  /// a whole unit, at least one). `samples_in(b0, b1)` counts the examples (all ranks) of
  /// micro-batches [b0, b1) of an epoch, for ramps over examples. Refuses a ramp of more than
  /// 10^7 optimizer steps.
  void set_ramp(const BatchRamp& ramp, int64_t effective, int64_t unit,
                std::function<int64_t(int64_t, int64_t)> samples_in);

  /// The window that starts at micro-batch `b` of `epoch`, as optimizer step `step` after
  /// `samples` examples (all ranks); nullopt when the policy drops the rest of the epoch.
  std::optional<Window> start(int64_t epoch, int64_t b, int64_t step, int64_t samples) const;
  /// The position of micro-batch `b` of `epoch` in a fixed-size schedule (no ramp), or nullopt when
  /// the policy drops it.
  std::optional<Window> at(int64_t epoch, int64_t b) const;
  /// Optimizer steps in `epochs` epochs (the whole run for a bounded carry schedule).
  int64_t steps_in(int64_t epochs) const;
  /// Micro-batches of the window that starts as optimizer step `step` after `samples` examples.
  int64_t size_at(int64_t step, int64_t samples) const;
  /// Whether the ramp (if any) is over within a run of `total_steps` optimizer steps: it lasts at
  /// most that many steps, or the run's steps take at least its examples.
  bool ramp_completes(int64_t total_steps) const;

 private:
  int64_t fixed_steps_from(int64_t epoch, int64_t b, int64_t epochs) const;

  int64_t m_, k_, epochs_;
  LastWindow policy_;
  BatchRamp ramp_;
  int64_t effective_ = 0, unit_ = 1;
  std::function<int64_t(int64_t, int64_t)> samples_in_;
};

/// A plugin as the orderer sees it.
struct PluginDecl {
  std::string name;
  Contract contract;
};

/// Dispatch order for plugins: the providers of what a plugin lists in `after` come first, recipe
/// order otherwise. Refuses two providers of one capability, an unmet requirement, a conflict or
/// a cycle, naming both plugins involved. A capability in `after` that no plugin provides and that
/// is not a known name (tk/capabilities.h) adds a warning to `warnings`: most likely a typo.
std::vector<size_t> order_plugins(const std::vector<PluginDecl>& plugins,
                                  std::vector<std::string>* warnings = nullptr);

}  // namespace tk

#pragma GCC visibility pop
