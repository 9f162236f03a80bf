// The views plugins get while they are called (each event's Context, SetupContext, OutputFiles,
// the log) over the core's state. Which event a call belongs to, the context types say at compile
// time; what is refused here is a call made after its hook (setup's) and bad arguments.
#include "tk/context.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "support/support.h"
#include "api/api.h"
#include "tk/error.h"
#include "tk/output.h"
#include "tk/tensor_io.h"

namespace tk {

using detail::ContextAccess;

namespace detail {

void Dispatch::enter(const std::string& p, const char* h, std::optional<Event> e) {
  plugin = p;
  hook = h;
  event = e;
}

void Dispatch::leave() noexcept {
  plugin.clear();
  hook = nullptr;
  event.reset();
}

void Dispatch::require_hook(const char* call, const char* h) const {
  if (hook && std::string(hook) == h) return;
  throw Error((plugin.empty() ? std::string("a plugin") : "plugin '" + plugin + "'") + " called " + call + " in " +
              (hook ? hook : "no hook (outside any call of the core)") + "; it belongs to " + h);
}

void StepVotes::claim_metric(const std::string& name, const std::string& plugin) {
  const auto [it, first] = owners.emplace(name, plugin);
  const bool this_step = !writer_of(name).empty();
  if (!first && it->second != plugin)
    throw Error("plugins '" + it->second + "' and '" + plugin + "' both report metric '" + name + "'" +
                (this_step ? "; a record holds one value a key, and one would be lost"
                           : ", '" + it->second + "' earlier in the run: the records' column '" + name +
                                 "' would hold the values of both") +
                ": name each after its plugin (\"" + plugin + "_" + name + "\")");
  if (!this_step) writers.emplace_back(name, plugin);
}

std::string StepVotes::writer_of(const std::string& name) const {
  for (const auto& [k, by] : writers)
    if (k == name) return by;
  return {};
}

void StepVotes::clear() {
  clear_metrics();
  deferred.clear();
  flagged.clear();
  veto_reason.clear();
  vetoed_by.clear();
  veto_advances_schedule = false;
}

void StepVotes::set_metric(const std::string& name, double value) {
  for (auto& [k, v] : metrics)
    if (k == name) {
      v = value;
      return;
    }
  metrics.emplace_back(name, value);
}

void StepVotes::veto(const std::string& reason, const std::string& plugin, bool advance_schedule) {
  if (!veto_reason.empty()) return;
  veto_reason = reason.empty() ? std::string("(no reason given)") : reason;
  vetoed_by = plugin;
  veto_advances_schedule = advance_schedule;
}

std::vector<double> LoopState::read(const at::Tensor& values) const {
  ++host_reads;
  const at::Tensor host = values.detach().reshape({-1}).to(at::kCPU, at::kDouble).contiguous();
  return {host.data_ptr<double>(), host.data_ptr<double>() + host.numel()};
}

void LoopState::read_step_values() {
  step.flagged.clear();
  if (step.deferred.empty()) {  // the loss alone: one read, nothing to gather
    if (totals.loss.defined()) {
      ++host_reads;
      totals.loss_sum = totals.loss.item<double>();
    }
    return;
  }
  std::vector<at::Tensor> values;
  const at::Device device = totals.loss.defined() ? totals.loss.device() : step.deferred.front().value.device();
  if (totals.loss.defined()) values.push_back(totals.loss.reshape({1}).to(at::kDouble));
  for (const auto& d : step.deferred) values.push_back(d.value.reshape({-1}).slice(0, 0, 1).to(device, at::kDouble));
  const at::Tensor host = at::cat(values).to(at::kCPU);
  ++host_reads;
  const auto v = host.accessor<double, 1>();
  int64_t i = 0;
  if (totals.loss.defined()) totals.loss_sum = v[i++];
  for (const auto& d : step.deferred) {
    const double x = v[i++];
    if (!d.veto) {
      step.set_metric(d.name, x);
      continue;
    }
    if (x == 0.0) continue;
    step.flagged.push_back(d.plugin);
    step.veto(d.name, d.plugin, d.advance_schedule);
  }
  step.deferred.clear();
}

}  // namespace detail

void PluginLog::info(const std::string& msg) const {
  if (dispatch_->log) dispatch_->log(0, dispatch_->plugin.empty() ? msg : dispatch_->plugin + ": " + msg);
}
void PluginLog::warn(const std::string& msg) const {
  if (dispatch_->log) dispatch_->log(1, dispatch_->plugin.empty() ? msg : dispatch_->plugin + ": " + msg);
}

const char* to_string(FitStatus s) noexcept {
  switch (s) {
    case FitStatus::Running: return "running";
    case FitStatus::Completed: return "completed";
    case FitStatus::StoppedByTime: return "max_time";
    case FitStatus::StoppedBySignal: return "signal";
    case FitStatus::Failed: return "failed";
    case FitStatus::Trial: return "trial";
  }
  return "?";
}

// ---- Context --------------------------------------------------------------------------------------

Context::Context(detail::LoopState* state) noexcept : PluginLog(&state->d), s_(state) {}

Model& Context::model() const { return *s_->model; }
const torch::optim::Optimizer& Context::optimizer() const { return *s_->optimizer; }
torch::optim::Optimizer& Context::mutable_optimizer() const { return *s_->optimizer; }
std::vector<at::Tensor> Context::gradients() const {
  std::vector<at::Tensor> grads;
  for (const auto& p : detail::distinct_tensors(s_->model->parameters()))
    if (p.grad().defined()) grads.push_back(p.grad());
  return grads;
}
const RunPlan& Context::plan() const noexcept { return s_->plan->view; }
int Context::rank() const noexcept { return s_->plan->rank; }
int Context::world_size() const noexcept { return s_->plan->world_size; }
World& Context::world() const noexcept { return *s_->world; }
Reduction Context::reduction() const noexcept { return s_->plan->reduction; }
Event Context::event() const noexcept { return s_->d.event.value_or(Event::FitStart); }
const Counters& Context::counters() const noexcept { return s_->counters; }
const Window& Context::window() const noexcept { return s_->window; }
const WindowTotals& Context::totals() const noexcept { return s_->totals; }
WindowTotals& Context::mutable_totals() { return s_->totals; }
const Batch* Context::batch() const noexcept { return s_->batch; }
const at::Tensor& Context::loss() const { return s_->loss; }
void Context::set_loss(at::Tensor loss) {
  if (!loss.defined()) throw Error("plugin '" + s_->d.plugin + "' called ctx.set_loss() with an undefined tensor");
  s_->loss = std::move(loss);
}
double Context::loss_value() const {
  if (!s_->loss_read && s_->loss_item.defined()) {
    s_->loss_value = s_->read(s_->loss_item).front();
    s_->loss_read = true;
  }
  return s_->loss_value;
}
double Context::window_loss() const noexcept { return s_->window_loss; }
double Context::validation_loss() const noexcept { return s_->validation_loss; }
double Context::lr() const noexcept { return s_->lr; }
const std::filesystem::path& Context::output_dir() const noexcept { return s_->output_dir; }
FitStatus Context::status() const noexcept { return s_->status; }
bool Context::trial() const noexcept { return s_->trial; }

namespace {

void check_metric_name(const detail::Dispatch& d, const std::string& name) {
  if (name.empty()) throw Error("plugin '" + d.plugin + "' called ctx.metric() with an empty name");
  for (const MetricKey k : metric::kCoreKeys)
    if (name == k.key())
      throw Error("plugin '" + d.plugin + "' called ctx.metric(\"" + name + "\"): that key is the core's own in each "
                  "record; name the metric after the plugin (\"" + d.plugin + "_" + name + "\")");
}

/// A value left on the device must be one element: the core reads one per deferred value.
void check_one_element(const detail::Dispatch& d, const char* call, const at::Tensor& t) {
  if (!t.defined() || t.numel() != 1)
    throw Error("plugin '" + d.plugin + "' called " + call + " with " +
                (t.defined() ? "a tensor of " + std::to_string(t.numel()) + " elements" : std::string("an undefined tensor")) +
                "; it takes a 1-element tensor");
}

}  // namespace

void Context::metric(const std::string& name, double value) {
  check_metric_name(s_->d, name);
  s_->step.claim_metric(name, s_->d.plugin);
  s_->step.set_metric(name, value);
}

void Context::metric(const std::string& name, const at::Tensor& value) {
  check_metric_name(s_->d, name);
  check_one_element(s_->d, "ctx.metric(name, tensor)", value);
  s_->step.claim_metric(name, s_->d.plugin);
  s_->step.deferred.push_back({name, value.detach(), s_->d.plugin, false, false});
}

void Context::veto_step(const std::string& reason, bool advance_schedule) {
  s_->step.veto(reason, s_->d.plugin, advance_schedule);
}

void Context::veto_step_if(const at::Tensor& flag, const std::string& reason, bool advance_schedule) {
  check_one_element(s_->d, "ctx.veto_step_if()", flag);
  s_->step.deferred.push_back({reason.empty() ? std::string("(no reason given)") : reason, flag.detach(), s_->d.plugin,
                               true, advance_schedule});
}

bool Context::step_vetoed() const {
  return !s_->step.veto_reason.empty();
}

bool Context::flag_was_set() const {
  const auto& f = s_->step.flagged;
  return std::find(f.begin(), f.end(), s_->d.plugin) != f.end();
}

std::vector<double> Context::read(const at::Tensor& values) const { return s_->read(values); }
int64_t Context::host_reads() const noexcept { return s_->host_reads; }

// ---- SetupContext ---------------------------------------------------------------------------------

SetupContext::SetupContext(detail::SetupState* state) noexcept : PluginLog(state->d), s_(state) {}

Model& SetupContext::model() const { return **s_->model; }
ModelPtr SetupContext::model_ptr() const { return *s_->model; }
void SetupContext::set_model(ModelPtr m) {
  if (!m) throw std::invalid_argument("set_model: the model is null");
  *s_->model = std::move(m);
}
const RunPlan& SetupContext::plan() const noexcept { return s_->plan->view; }
World& SetupContext::world() const noexcept { return *s_->world; }
const DataInfo& SetupContext::data() const noexcept { return *s_->data; }
void SetupContext::wrap_optimizer(OptimizerWrap wrap) {
  if (!wrap) throw std::invalid_argument("wrap_optimizer: the wrap is empty");
  s_->d->require_hook("wrap_optimizer", "setup");
  s_->wraps->emplace_back(s_->d->plugin, std::move(wrap));
}

void SetupContext::offer_memory_lever(MemoryLever lever) {
  s_->d->require_hook("offer_memory_lever", "setup");
  const std::string& me = s_->d->plugin;
  if (!lever.set || lever.levels < 1)
    throw std::invalid_argument("offer_memory_lever: a lever needs a set function and at least one level, got " +
                                std::to_string(lever.levels));
  if (!s_->lever->first.empty())
    throw Error("plugins '" + s_->lever->first + "' and '" + me +
                "' both leave a memory lever to the planner; it can weigh one: set one of them by hand");
  if (!s_->plan->micro_batch_auto)
    throw Error("plugin '" + me + "' leaves its " + (lever.what.empty() ? "setting" : lever.what) +
                " to the memory planner, which runs only with [batch] micro_batch = \"auto\" (and effective_batch "
                "and memory_budget); set micro_batch = \"auto\", or choose the setting by hand");
  *s_->lever = {me, std::move(lever)};
}

// ---- OutputFiles ----------------------------------------------------------------------------------

OutputFiles::OutputFiles(detail::FilesState* state) noexcept : PluginLog(state->d), s_(state) {}

Model& OutputFiles::model() const { return *s_->model; }
const RunPlan& OutputFiles::plan() const noexcept { return s_->plan->view; }
const std::filesystem::path& OutputFiles::dir() const noexcept { return s_->dir; }

void OutputFiles::save_tensors(const std::string& file, const NamedTensors& tensors) {
  s_->record(s_->d->plugin, file);
  save_tensor_dict(s_->dir / file, tensors);
}

std::string OutputFiles::name_error(const std::string& file) {
  const std::string why = detail::bad_plugin_file_name(file);
  return why.empty() ? why : "the file name '" + file + "' " + why;
}

void OutputFiles::write_text(const std::string& file, const std::string& text) {
  s_->record(s_->d->plugin, file);
  detail::write_file_atomic(s_->dir / file, text);
}

}  // namespace tk
