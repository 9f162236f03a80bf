// RunPlan: the plugins' view of the plan, and the way they shape it (in configure only).
#include "tk/run_plan.h"

#include <algorithm>

#include "api/api.h"
#include "tk/error.h"

namespace tk {

namespace detail {
PlanState::PlanState() : view(PlanAccess::view(this)) {}
}  // namespace detail

int64_t RunPlan::micro_batch() const noexcept { return s_->micro_batch; }
int64_t RunPlan::accumulation() const noexcept { return s_->accumulation; }
int64_t RunPlan::effective_batch() const noexcept { return s_->effective_batch(); }
int64_t RunPlan::effective_batch_goal() const noexcept { return s_->effective_batch_goal; }
bool RunPlan::micro_batch_auto() const noexcept { return s_->micro_batch_auto; }
double RunPlan::memory_budget() const noexcept { return s_->memory_budget; }
const std::vector<std::pair<int64_t, double>>& RunPlan::measured_peaks() const noexcept { return s_->measured_peaks; }
int64_t RunPlan::memory_level() const noexcept { return s_->memory_level; }
const BatchRamp& RunPlan::ramp() const noexcept { return s_->ramp; }
LastWindow RunPlan::last_window() const noexcept { return s_->last_window; }
int RunPlan::world_size() const noexcept { return s_->world_size; }
int RunPlan::rank() const noexcept { return s_->rank; }
World& RunPlan::world() const noexcept { return *s_->world; }
Reduction RunPlan::reduction() const noexcept { return s_->reduction; }
c10::DeviceType RunPlan::device() const noexcept { return s_->device; }
bool RunPlan::has(const Capability& cap) const { return s_->has(cap.name()); }
const std::set<std::string>& RunPlan::capabilities() const noexcept { return s_->capabilities; }
const std::string& RunPlan::window_owner() const noexcept { return s_->window_owner; }
bool RunPlan::gradients_kept() const noexcept { return !s_->gradients_kept_by.empty(); }

const char* to_string(LastWindow p) noexcept {
  switch (p) {
    case LastWindow::Step: return "step";
    case LastWindow::Drop: return "drop";
    case LastWindow::Carry: return "carry";
  }
  return "?";
}

const char* to_string(Reduction r) noexcept { return r == Reduction::Mean ? "mean" : "sum"; }

namespace {

/// The plugin calling a setter in configure; refuses a call anywhere else.
const std::string& configuring(const detail::PlanState& s, const char* call) {
  if (!s.dispatch) throw Error(std::string("RunPlan::") + call + " is for a plugin's configure hook");
  s.dispatch->require_hook((std::string("plan.") + call).c_str(), "configure");
  return s.dispatch->plugin;
}

}  // namespace

void RunPlan::set_window(const WindowRequest& w) {
  const std::string& by = configuring(*s_, "set_window()");
  if (!s_->window_owner.empty() && s_->window_owner != by)
    throw Error("plugins '" + s_->window_owner + "' and '" + by +
                "' both set the accumulation window; keep one of them");
  if (w.steps < 0 || (w.steps == 0 && w.effective_batch < 1))
    throw Error("plugin '" + by + "' set an accumulation window of " + std::to_string(w.steps) +
                " (must be >= 1, or 0 with an effective batch to infer it from)");
  s_->requested = w;
  s_->window_owner = by;
}

void RunPlan::keep_gradients() {
  const std::string& by = configuring(*s_, "keep_gradients()");
  auto& kept = s_->gradients_kept_by;
  if (std::find(kept.begin(), kept.end(), by) == kept.end()) kept.push_back(by);
}

}  // namespace tk
