#include "tk/context.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace tk {

void PluginLog::info(const std::string& msg) const {
  if (log_) log_(0, current_plugin_.empty() ? msg : current_plugin_ + ": " + msg);
}
void PluginLog::warn(const std::string& msg) const {
  if (log_) log_(1, current_plugin_.empty() ? msg : current_plugin_ + ": " + msg);
}

void Context::metric(const std::string& name, double value) {
  for (auto& [k, v] : metrics_)
    if (k == name) {
      v = value;
      return;
    }
  metrics_.emplace_back(name, value);
}

void Context::metric(const std::string& name, const at::Tensor& value) {
  deferred_.push_back({name, value.detach(), current_plugin_, false, false});
}

void Context::veto_step_if(const at::Tensor& flag, const std::string& reason, bool advance_schedule) {
  deferred_.push_back({reason.empty() ? std::string("(no reason given)") : reason, flag.detach(), current_plugin_, true,
                       advance_schedule});
}

std::vector<double> Context::read(const at::Tensor& values) const {
  ++host_reads_;
  const at::Tensor host = values.detach().reshape({-1}).to(at::kCPU, at::kDouble).contiguous();
  return {host.data_ptr<double>(), host.data_ptr<double>() + host.numel()};
}

bool Context::flag_was_set() const {
  return std::find(flagged_.begin(), flagged_.end(), current_plugin_) != flagged_.end();
}

double Context::loss_value() const {
  if (!loss_read_ && loss_item_.defined()) {
    loss_value_ = read(loss_item_).front();
    loss_read_ = true;
  }
  return loss_value_;
}

void Context::read_step_values() {
  WindowTotals& t = totals_;
  std::vector<at::Tensor> values;
  const at::Device device = t.loss.defined() ? t.loss.device()
                            : deferred_.empty() ? at::Device(at::kCPU) : deferred_.front().value.device();
  if (t.loss.defined()) values.push_back(t.loss.reshape({1}).to(at::kDouble));
  for (const auto& d : deferred_) values.push_back(d.value.reshape({-1}).slice(0, 0, 1).to(device, at::kDouble));
  flagged_.clear();
  if (values.empty()) return;
  const at::Tensor host = at::cat(values).to(at::kCPU);
  ++host_reads_;
  const auto v = host.accessor<double, 1>();
  int64_t i = 0;
  if (t.loss.defined()) t.loss_sum = v[i++];
  for (const auto& d : deferred_) {
    const double x = v[i++];
    if (!d.veto) {
      metric(d.name, x);
      continue;
    }
    if (x == 0.0) continue;
    flagged_.push_back(d.plugin);
    if (veto_reason_.empty()) {
      veto_reason_ = d.name;
      vetoed_by_ = d.plugin;
      veto_advances_schedule_ = d.advance_schedule;
    }
  }
  deferred_.clear();
}

void Context::veto_step(const std::string& reason, bool advance_schedule) {
  if (!veto_reason_.empty()) return;
  veto_reason_ = reason.empty() ? std::string("(no reason given)") : reason;
  vetoed_by_ = current_plugin_;
  veto_advances_schedule_ = advance_schedule;
}

void SetupContext::set_model(ModelPtr m) {
  if (!m) throw std::invalid_argument("set_model: the model is null");
  *model_ = std::move(m);
}

}  // namespace tk
