// The questions the core asks of any optimizer (tk/components.h): its learning rate, the bytes of
// its state.
#include "tk/components.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

namespace tk {

double get_lr(const torch::optim::Optimizer& opt) { return opt.param_groups().front().options().get_lr(); }
void set_lr(torch::optim::Optimizer& opt, double lr) {
  for (auto& g : opt.param_groups()) g.options().set_lr(lr);
}

namespace {
int64_t bytes_of(std::initializer_list<const at::Tensor*> tensors) {
  int64_t n = 0;
  for (const at::Tensor* t : tensors)
    if (t->defined()) n += static_cast<int64_t>(t->numel()) * static_cast<int64_t>(t->element_size());
  return n;
}
}  // namespace

int64_t optimizer_state_bytes(const torch::optim::Optimizer& opt) {
  if (const auto* sized = dynamic_cast<const StateSize*>(&opt)) return sized->state_bytes();
  using namespace torch::optim;
  int64_t total = 0;
  for (const auto& [key, state] : opt.state()) {
    const OptimizerParamState* s = state.get();
    if (const auto* a = dynamic_cast<const AdamParamState*>(s))
      total += bytes_of({&a->exp_avg(), &a->exp_avg_sq(), &a->max_exp_avg_sq()});
    else if (const auto* w = dynamic_cast<const AdamWParamState*>(s))
      total += bytes_of({&w->exp_avg(), &w->exp_avg_sq(), &w->max_exp_avg_sq()});
    else if (const auto* g = dynamic_cast<const SGDParamState*>(s))
      total += bytes_of({&g->momentum_buffer()});
    else if (const auto* d = dynamic_cast<const AdagradParamState*>(s))
      total += bytes_of({&d->sum()});
    else if (const auto* m = dynamic_cast<const RMSpropParamState*>(s))
      total += bytes_of({&m->square_avg(), &m->momentum_buffer(), &m->grad_avg()});
    else
      return -1;
  }
  return total;
}

}  // namespace tk
