#pragma once
/// Pure planning logic: where each micro-batch sits in its window, and in which order plugins run.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tk/plugin.h"
#include "tk/run_plan.h"

namespace tk {

/// Maps (epoch, micro-batch) to its window position for a window size and last-window policy.
class WindowSchedule {
 public:
  /// `batches_per_epoch` micro-batches per epoch; `epochs` = 0 when the run is bounded by steps.
  WindowSchedule(int64_t batches_per_epoch, int64_t k, LastWindow policy, int64_t epochs);

  /// The window position of micro-batch `b` of epoch `e`, or nullopt when the policy drops it.
  std::optional<Window> at(int64_t epoch, int64_t b) const;
  /// Optimizer steps in `epochs` epochs (the whole run for a bounded carry schedule).
  int64_t steps_in(int64_t epochs) const;

 private:
  int64_t m_, k_, epochs_;
  LastWindow policy_;
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
