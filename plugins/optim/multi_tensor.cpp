// The multi-tensor steps of Adam, AdamW and SGD. Each subclasses LibTorch's optimizer and
// replaces only step(): the options, the per-parameter state (its types and keys), save() and
// load() are LibTorch's, so a checkpoint written with one form resumes with another.
//
// A foreach step does, over all parameters of a group at once, exactly the operations LibTorch's
// step does one parameter at a time, in the same order for each parameter and with the same
// scalars. On the CPU, where a foreach operation runs the per-tensor kernel on each tensor, it is
// bit-identical (tested). CUDA's foreach kernels associate addcmul's products differently and
// divide where the per-tensor kernel multiplies by a reciprocal: equal there to rounding (checked
// by tools/gpu-check.sh). It holds the group's denominators at once: one extra parameter-sized
// buffer during the step, as PyTorch's foreach optimizers do.
#include "multi_tensor.h"

#include <tk/compat.h>
#include <tk/kernels.h>
#include <tk/components.h>

#include <cmath>
#include <stdexcept>

namespace tk::optim {
namespace {

using torch::optim::Optimizer;

int64_t bytes_of(std::initializer_list<const at::Tensor*> tensors) {
  int64_t n = 0;
  for (const at::Tensor* t : tensors)
    if (t->defined()) n += static_cast<int64_t>(t->numel()) * static_cast<int64_t>(t->element_size());
  return n;
}
int64_t state_bytes_of(const torch::optim::AdamParamState& s) {
  return bytes_of({&s.exp_avg(), &s.exp_avg_sq(), &s.max_exp_avg_sq()});
}
int64_t state_bytes_of(const torch::optim::AdamWParamState& s) {
  return bytes_of({&s.exp_avg(), &s.exp_avg_sq(), &s.max_exp_avg_sq()});
}
int64_t state_bytes_of(const torch::optim::SGDParamState& s) { return bytes_of({&s.momentum_buffer()}); }

/// LibTorch's optimizer `Base`, telling the core the bytes of the per-parameter state (of type
/// `State`) it holds (tk::StateSize: metrics.jsonl's optimizer_state_mib, the memory planner).
template <class Base, class State>
class Sized : public Base, public tk::StateSize {
 public:
  using Base::Base;
  int64_t state_bytes() const override {
    int64_t n = 0;
    for (const auto& entry : this->state()) n += state_bytes_of(static_cast<const State&>(*entry.second));
    return n;
  }
};
using SizedAdam = Sized<torch::optim::Adam, torch::optim::AdamParamState>;
using SizedAdamW = Sized<torch::optim::AdamW, torch::optim::AdamWParamState>;
using SizedSgd = Sized<torch::optim::SGD, torch::optim::SGDParamState>;

template <class State, class Base>
State* find_state(Base& opt, const at::Tensor& p) {
  auto& map = opt.state();
  auto it = map.find(compat::optimizer_state_key(map, p));
  return it == map.end() ? nullptr : static_cast<State*>(it->second.get());
}

template <class State, class Base>
State& new_state(Base& opt, const at::Tensor& p) {
  auto& map = opt.state();
  auto s = std::make_unique<State>();
  State& ref = *s;
  map[compat::optimizer_state_key(map, p)] = std::move(s);
  return ref;
}

/// The parameters of a group that have gradients, with their Adam state (made as LibTorch makes
/// it on a parameter's first step) advanced by one step.
template <class Opts, class State, class Base>
struct AdamLists {
  std::vector<at::Tensor> params, grads, avgs, sqs, maxes;
  std::vector<int64_t> steps;

  AdamLists(Base& opt, torch::optim::OptimizerParamGroup& group, const char* name) {
    const auto& o = static_cast<const Opts&>(group.options());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      if (p.grad().is_sparse()) throw std::runtime_error(std::string(name) + " does not support sparse gradients");
      State* s = find_state<State>(opt, p);
      if (!s) {
        s = &new_state<State>(opt, p);
        s->step(0);
        s->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
        s->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        if (o.amsgrad()) s->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
      }
      s->step(s->step() + 1);
      params.push_back(p);
      grads.push_back(p.grad());
      avgs.push_back(s->exp_avg());
      sqs.push_back(s->exp_avg_sq());
      if (o.amsgrad()) maxes.push_back(s->max_exp_avg_sq());
      steps.push_back(s->step());
    }
  }
};

/// LibTorch's Adam step (kDecoupled false: the decay added to the gradient) or AdamW step
/// (true: the parameter shrunk by lr * weight_decay first), over a whole group at once.
template <class Opts, class State, bool kDecoupled, class Base>
void foreach_adam_group(Base& opt, torch::optim::OptimizerParamGroup& group, const char* name) {
  AdamLists<Opts, State, Base> l(opt, group, name);
  if (l.params.empty()) return;
  const auto& o = static_cast<const Opts&>(group.options());
  const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
  std::vector<at::Scalar> bc2_sqrt, neg_step;
  for (int64_t step : l.steps) {
    const AdamScalars s(o, step);
    bc2_sqrt.emplace_back(s.bc2_sqrt);
    neg_step.emplace_back(s.neg_step_size);
  }
  std::vector<at::Tensor> grads = l.grads;
  if (o.weight_decay() != 0) {
    if (kDecoupled) at::_foreach_mul_(l.params, 1 - o.lr() * o.weight_decay());
    else grads = at::_foreach_add(l.grads, l.params, o.weight_decay());
  }
  at::_foreach_mul_(l.avgs, beta1);
  at::_foreach_add_(l.avgs, grads, 1 - beta1);
  at::_foreach_mul_(l.sqs, beta2);
  at::_foreach_addcmul_(l.sqs, grads, grads, 1 - beta2);
  if (o.amsgrad())
    for (size_t i = 0; i < l.maxes.size(); ++i) at::max_out(l.maxes[i], l.sqs[i], l.maxes[i]);
  std::vector<at::Tensor> denom = at::_foreach_sqrt(o.amsgrad() ? l.maxes : l.sqs);
  at::_foreach_div_(denom, bc2_sqrt);
  at::_foreach_add_(denom, o.eps());
  at::_foreach_addcdiv_(l.params, l.avgs, denom, neg_step);
}

/// AdamW in one pass over each parameter: trainkit's kernel for CPU parameters (every LibTorch),
/// at::_fused_adamw_ for the rest (LibTorch 2.4+: one kernel per device and dtype of the group's
/// parameters, as that kernel needs). Its arithmetic is AdamW's, rounded its own way: it agrees
/// with the per-tensor step to rounding, not to the bit.
void fused_adamw_group(torch::optim::AdamW& opt, torch::optim::OptimizerParamGroup& group) {
  using L = AdamLists<torch::optim::AdamWOptions, torch::optim::AdamWParamState, torch::optim::AdamW>;
  L l(opt, group, "AdamW");
  const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
  std::vector<bool> done(l.params.size(), false);
  for (size_t i = 0; i < l.params.size(); ++i)
    if (l.params[i].device().is_cpu()) {
      done[i] = true;
      cpu_adamw_step(l.params[i], l.grads[i], l.avgs[i], l.sqs[i], o.amsgrad() ? l.maxes[i] : at::Tensor(),
                     AdamScalars(o, l.steps[i]));
    }
  for (size_t first = 0; first < l.params.size(); ++first) {
    if (done[first]) continue;
    const at::Tensor& like = l.params[first];
    std::vector<at::Tensor> params, grads, avgs, sqs, maxes;
    std::vector<double> steps;
    for (size_t i = first; i < l.params.size(); ++i) {
      if (done[i] || l.params[i].device() != like.device() || l.params[i].scalar_type() != like.scalar_type()) continue;
      done[i] = true;
      params.push_back(l.params[i]);
      grads.push_back(l.grads[i]);
      avgs.push_back(l.avgs[i]);
      sqs.push_back(l.sqs[i]);
      if (o.amsgrad()) maxes.push_back(l.maxes[i]);
      steps.push_back(static_cast<double>(l.steps[i]));
    }
    // The kernel reads each step count from a float tensor on the parameters' device: one transfer.
    auto counts = at::tensor(steps, at::TensorOptions().dtype(at::kFloat)).to(like.device());
    std::vector<at::Tensor> step_tensors = counts.unbind(0);
    kernels::fused_adamw_(params, grads, avgs, sqs, maxes, step_tensors, o.lr(), std::get<0>(o.betas()),
                         std::get<1>(o.betas()), o.weight_decay(), o.eps(), o.amsgrad());
  }
}

template <class Base, class Fn>
at::Tensor step_groups(Base& opt, const Optimizer::LossClosure& closure, Fn&& each_group) {
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : opt.param_groups()) each_group(group);
  return loss;
}

class ForeachAdam final : public SizedAdam {
 public:
  using SizedAdam::SizedAdam;
  at::Tensor step(LossClosure closure = nullptr) override {
    return step_groups(*this, closure, [this](auto& g) {
      foreach_adam_group<torch::optim::AdamOptions, torch::optim::AdamParamState, false>(*this, g, "Adam");
    });
  }
};

class ForeachAdamW final : public SizedAdamW {
 public:
  ForeachAdamW(std::vector<at::Tensor> params, const torch::optim::AdamWOptions& o, bool fused)
      : SizedAdamW(std::move(params), o), fused_(fused) {}
  at::Tensor step(LossClosure closure = nullptr) override {
    return step_groups(*this, closure, [this](auto& g) {
      if (fused_) fused_adamw_group(*this, g);
      else foreach_adam_group<torch::optim::AdamWOptions, torch::optim::AdamWParamState, true>(*this, g, "AdamW");
    });
  }

 private:
  bool fused_;
};

/// LibTorch's SGD step over a group at once: weight decay added to the gradient, the momentum
/// buffer started as a copy of it and then decayed and added to, Nesterov's look-ahead.
class ForeachSgd final : public SizedSgd {
 public:
  using SizedSgd::SizedSgd;
  at::Tensor step(LossClosure closure = nullptr) override {
    return step_groups(*this, closure, [this](auto& g) { step_group(g); });
  }

 private:
  void step_group(torch::optim::OptimizerParamGroup& group) {
    const auto& o = static_cast<const torch::optim::SGDOptions&>(group.options());
    std::vector<at::Tensor> params, grads;
    for (auto& p : group.params())
      if (p.grad().defined()) {
        params.push_back(p);
        grads.push_back(p.grad().data());
      }
    if (params.empty()) return;
    std::vector<at::Tensor> d = o.weight_decay() != 0 ? at::_foreach_add(grads, params, o.weight_decay()) : grads;
    if (o.momentum() != 0) {
      std::vector<at::Tensor> bufs(params.size()), old_bufs, old_d;
      for (size_t i = 0; i < params.size(); ++i) {
        auto* s = find_state<torch::optim::SGDParamState>(*this, params[i]);
        if (!s) {
          bufs[i] = d[i].detach().clone();
          new_state<torch::optim::SGDParamState>(*this, params[i]).momentum_buffer(bufs[i]);
        } else {
          bufs[i] = s->momentum_buffer();
          old_bufs.push_back(bufs[i]);
          old_d.push_back(d[i]);
        }
      }
      if (!old_bufs.empty()) {
        at::_foreach_mul_(old_bufs, o.momentum());
        at::_foreach_add_(old_bufs, old_d, 1 - o.dampening());
      }
      d = o.nesterov() ? at::_foreach_add(d, bufs, o.momentum()) : bufs;
    }
    std::vector<at::Tensor> data;
    data.reserve(params.size());
    for (auto& p : params) data.push_back(p.data());
    at::_foreach_add_(data, d, -1 * o.lr());
  }
};

}  // namespace

bool has_fused_adamw(const c10::Device& device) {
  return device.is_cpu() || (kernels::kHasFusedAdamW && device.is_cuda());
}

StepForm step_form(const std::string& name, const std::vector<torch::Tensor>& params, bool fused_on_cpu) {
  if (name == "per_tensor") return StepForm::PerTensor;
  if (name == "foreach") return StepForm::Foreach;
  if (name == "fused") return StepForm::Fused;
  if (!params.empty() && params.front().is_cuda()) return StepForm::Foreach;
  return fused_on_cpu ? StepForm::Fused : StepForm::PerTensor;
}

std::unique_ptr<Optimizer> make_adam(std::vector<torch::Tensor> params, const torch::optim::AdamOptions& o,
                                     StepForm form) {
  if (form == StepForm::PerTensor) return std::make_unique<SizedAdam>(std::move(params), o);
  return std::make_unique<ForeachAdam>(std::move(params), o);
}

std::unique_ptr<Optimizer> make_adamw(std::vector<torch::Tensor> params, const torch::optim::AdamWOptions& o,
                                      StepForm form) {
  if (form == StepForm::PerTensor) return std::make_unique<SizedAdamW>(std::move(params), o);
  return std::make_unique<ForeachAdamW>(std::move(params), o, form == StepForm::Fused);
}

std::unique_ptr<Optimizer> make_sgd(std::vector<torch::Tensor> params, const torch::optim::SGDOptions& o,
                                    StepForm form) {
  if (form == StepForm::PerTensor) return std::make_unique<SizedSgd>(std::move(params), o);
  return std::make_unique<ForeachSgd>(std::move(params), o);
}

}  // namespace tk::optim
