// The questions the core asks of any optimizer (tk/components.h): its learning rate, the bytes of
// its state.
#include "tk/components.h"

#include <torch/optim/optimizer.h>

namespace tk {

double get_lr(const torch::optim::Optimizer& opt) { return opt.param_groups().front().options().get_lr(); }
void set_lr(torch::optim::Optimizer& opt, double lr) {
  for (auto& g : opt.param_groups()) g.options().set_lr(lr);
}

int64_t optimizer_state_bytes(const torch::optim::Optimizer& opt) {
  const auto* sized = dynamic_cast<const StateSize*>(&opt);
  return sized ? sized->state_bytes() : -1;
}

}  // namespace tk
