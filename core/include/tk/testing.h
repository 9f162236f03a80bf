#pragma once
/// Helpers for testing a plugin's hooks one at a time, without a training run.
#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "tk/context.h"
#include "tk/plugin.h"

namespace tk::testing {

/// A Context whose every field a test sets by hand; hand it to a plugin's hook (see call()).
class ManualContext final : public Context {
 public:
  ManualContext(Model& model, torch::optim::Optimizer& optimizer, const RunPlan& plan,
                Reduction reduction = Reduction::Mean) {
    model_ = &model;
    optimizer_ = &optimizer;
    plan_ = &plan;
    reduction_ = reduction;
  }

  Counters& mutable_counters() noexcept { return counters_; }
  void set_window(const Window& w) noexcept { window_ = w; }
  void set_batch(const Batch* b) noexcept { batch_ = b; }
  void set_loss_value(double v) noexcept { loss_value_ = v; }
  void set_window_loss(double v) noexcept { window_loss_ = v; }
  void set_validation_loss(double v) noexcept { validation_loss_ = v; }
  void set_lr(double v) noexcept { lr_ = v; }
  void set_status(FitStatus s) noexcept { status_ = s; }
  void set_output_dir(std::filesystem::path d) { output_dir_ = std::move(d); }
  /// Where info() and warn() go (level 0 info, 1 warning); nowhere by default.
  void set_log(std::function<void(int, const std::string&)> log) { log_ = std::move(log); }

  /// The metrics plugins added since the last clear_step().
  const std::vector<std::pair<std::string, double>>& metrics() const noexcept { return metrics_; }
  /// One metric's value, NaN when absent.
  double metric_value(const std::string& name) const {
    for (const auto& [k, v] : metrics_)
      if (k == name) return v;
    return std::nan("");
  }
  const std::string& veto_reason() const noexcept { return veto_reason_; }
  const std::string& vetoed_by() const noexcept { return vetoed_by_; }
  /// Forgets the metrics and the veto, as the core does before each boundary.
  void clear_step() {
    metrics_.clear();
    veto_reason_.clear();
    vetoed_by_.clear();
    veto_advances_schedule_ = false;
  }
  /// Calls the hook of `e` on `p` as the core does (with `p`'s name as the current plugin).
  void call(Plugin& p, Event e) {
    current_plugin_ = p.name();
    dispatch(p, e, *this);
    current_plugin_.clear();
  }
};

}  // namespace tk::testing
