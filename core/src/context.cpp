#include "tk/context.h"

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
