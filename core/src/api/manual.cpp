// The parts of trainkit::testing (tk/testing.h) that stand in for the core's own state: a
// ManualContext over a loop state a test sets by hand, a ManualPlan, a plugin loaded with its
// options. They live in libtrainkit, beside that state, so that the testing library needs nothing
// of the core but its public API.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cmath>

#include "api/api.h"
#include "tk/loader.h"
#include "tk/testing.h"

namespace tk::testing {

using detail::ContextAccess;

namespace {

/// The world of a ManualContext or ManualPlan: rank and size as the test set them, never joined
/// (as a dry run's world): each collective combines this rank's values alone.
class LocalWorld final : public World {
 public:
  LocalWorld(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }
  int local_rank() const noexcept override { return rank_; }
  const std::string& backend() const noexcept override { return backend_; }
  bool joined() const noexcept override { return false; }
  std::chrono::milliseconds timeout() const noexcept override { return std::chrono::milliseconds(300000); }
  void all_reduce(at::Tensor&, ReduceOp) override {}
  void broadcast(at::Tensor&, int) override {}
  at::Tensor all_gather(const at::Tensor& t) override { return at::cat(std::vector<at::Tensor>(static_cast<size_t>(size_), t)); }
  at::Tensor reduce_scatter(const at::Tensor& t, ReduceOp) override {
    const int64_t part = t.size(0) / size_;
    return t.slice(0, part * rank_, part * (rank_ + 1)).clone();
  }
  void barrier() override {}
  c10::intrusive_ptr<c10d::ProcessGroup> process_group() override { return {}; }

 private:
  int rank_, size_;
  std::string backend_ = "none";
};

void apply(detail::PlanState* plan, const PlanSettings& p) {
  plan->micro_batch = p.micro_batch;
  plan->accumulation = p.accumulation;
  plan->last_window = p.last_window;
  plan->world_size = p.world_size;
  plan->rank = p.rank;
  plan->reduction = p.reduction;
  plan->device = p.device;
  plan->capabilities = p.capabilities;
  plan->world = new LocalWorld(p.rank, p.world_size);
}

detail::LoopState* new_state(Model& model, torch::optim::Optimizer& optimizer, const PlanSettings& p) {
  auto* s = new detail::LoopState;
  auto* plan = new detail::PlanState;
  apply(plan, p);
  s->plan = plan;
  s->world = plan->world;
  s->model = &model;
  s->optimizer = &optimizer;
  return s;
}

}  // namespace

ManualContext::ManualContext(Model& model, torch::optim::Optimizer& optimizer, const PlanSettings& plan)
    : Context(new_state(model, optimizer, plan)) {}

ManualContext::~ManualContext() {
  detail::LoopState* s = &ContextAccess::state(*this);
  delete s->plan->world;
  delete s->plan;
  delete s;
}

Counters& ManualContext::mutable_counters() noexcept { return ContextAccess::state(*this).counters; }
void ManualContext::set_window(const Window& w) noexcept { ContextAccess::state(*this).window = w; }
void ManualContext::set_batch(const Batch* b) noexcept { ContextAccess::state(*this).batch = b; }
void ManualContext::set_loss_value(double v) noexcept {
  auto& s = ContextAccess::state(*this);
  s.loss_value = v;
  s.loss_read = true;
}
void ManualContext::set_window_loss(double v) noexcept { ContextAccess::state(*this).window_loss = v; }
void ManualContext::set_validation_loss(double v) noexcept { ContextAccess::state(*this).validation_loss = v; }
void ManualContext::set_lr(double v) noexcept { ContextAccess::state(*this).lr = v; }
void ManualContext::set_status(FitStatus st) noexcept { ContextAccess::state(*this).status = st; }
void ManualContext::set_output_dir(std::filesystem::path d) { ContextAccess::state(*this).output_dir = std::move(d); }
void ManualContext::set_log(std::function<void(int, const std::string&)> log) {
  ContextAccess::state(*this).d.log = std::move(log);
}
const std::vector<std::pair<std::string, double>>& ManualContext::metrics() const noexcept {
  return ContextAccess::state(*this).step.metrics;
}
double ManualContext::metric_value(const std::string& name) const {
  for (const auto& [k, v] : metrics())
    if (k == name) return v;
  return std::nan("");
}
const std::string& ManualContext::veto_reason() const noexcept { return ContextAccess::state(*this).step.veto_reason; }
const std::string& ManualContext::vetoed_by() const noexcept { return ContextAccess::state(*this).step.vetoed_by; }
void ManualContext::clear_step() { ContextAccess::state(*this).step.clear(); }

void ManualContext::call(Plugin& p, Event e) {
  auto& s = ContextAccess::state(*this);
  s.d.enter(p.name(), hook_name(e), e);
  try {
    detail::dispatch(p, e, s);
  } catch (...) {
    s.d.leave();
    throw;
  }
  s.d.leave();
  if (e == Event::Boundary) s.read_step_values();
}

struct ManualPlan::Impl {
  detail::Dispatch dispatch;
  detail::PlanState plan;
};

ManualPlan::ManualPlan(const PlanSettings& settings) : impl_(std::make_unique<Impl>()) {
  apply(&impl_->plan, settings);
  impl_->plan.dispatch = &impl_->dispatch;
}
ManualPlan::~ManualPlan() { delete impl_->plan.world; }

void ManualPlan::configure(Plugin& p) {
  impl_->dispatch.enter(p.name(), "configure");
  try {
    p.configure(impl_->plan.view);
  } catch (...) {
    impl_->dispatch.leave();
    throw;
  }
  impl_->dispatch.leave();
  // A plugin that still shapes the window itself (RunPlan::set_window, deprecated): its window is
  // the plan's, as in a run (where [batch] is the place for it).
  auto& plan = impl_->plan;
  if (plan.requested && plan.window_owner == p.name()) {
    const WindowRequest& w = *plan.requested;
    const int64_t per_rank = w.effective_batch / plan.world_size;
    if (w.steps > 0) plan.accumulation = w.steps;
    else if (plan.micro_batch > 0 && per_rank % plan.micro_batch == 0) plan.accumulation = per_rank / plan.micro_batch;
    plan.effective_batch_goal = w.effective_batch;
    plan.last_window = w.last_window;
    plan.ramp = w.ramp;
  }
}

const RunPlan& ManualPlan::plan() const noexcept { return impl_->plan.view; }

std::shared_ptr<Plugin> load_plugin(const std::filesystem::path& file, const std::string& options) {
  auto p = PluginLoader({}).load_plugin(file).plugin;
  detail::configure_options(*p, options);
  return p;
}

}  // namespace tk::testing
