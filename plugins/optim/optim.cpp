// trainkit's losses, optimizers and LR schedules, registered by name like any user's.
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/mse_loss.h>
#include <tk/abi.h>
#include <tk/kernels.h>

#include "multi_tensor.h"

#include <cmath>

namespace tk::optim {
namespace {

// ---------------------------------------------------------------- losses

Reduction reduction_of(const Options& o) {
  return o.get_string("reduction") == "sum" ? Reduction::Sum : Reduction::Mean;
}
int64_t at_reduction(Reduction r) { return r == Reduction::Sum ? at::Reduction::Sum : at::Reduction::Mean; }

class CrossEntropy : public LossFn {
 public:
  explicit CrossEntropy(const Options& o)
      : LossFn(reduction_of(o), Targets::Classes),
        ignore_(o.get_int("ignore_index")),
        smoothing_(o.get_float("label_smoothing")) {}
  torch::Tensor operator()(const torch::Tensor& out, const Batch& b) const override {
    // Sequences flatten to rows; a classifier's [N, C] and [N] are already rows (no view to make).
    const at::Tensor rows = out.dim() == 2 ? out : out.reshape({-1, out.size(-1)});
    const at::Tensor targets = b.target.dim() == 1 ? b.target : b.target.reshape({-1});
    return at::cross_entropy_loss(rows, targets, {}, at_reduction(reduction()), ignore_, smoothing_);
  }

 private:
  int64_t ignore_;
  double smoothing_;
};

class Mse : public LossFn {
 public:
  explicit Mse(const Options& o) : LossFn(reduction_of(o), Targets::Reals) {}
  torch::Tensor operator()(const torch::Tensor& out, const Batch& b) const override {
    return at::mse_loss(out, b.target.reshape(out.sizes()), at_reduction(reduction()));
  }
};

// ---------------------------------------------------------------- schedules

class ConstantLr : public LrSchedule {
 public:
  explicit ConstantLr(double lr) : lr_(lr) {}
  double lr(int64_t, int64_t) const override { return lr_; }

 private:
  double lr_;
};

class WarmupCosine : public LrSchedule {
 public:
  WarmupCosine(double base, int64_t warmup, double min_lr) : base_(base), min_(min_lr), warmup_(warmup) {}
  double lr(int64_t step, int64_t total) const override {
    if (step < warmup_) return base_ * static_cast<double>(step + 1) / static_cast<double>(warmup_);
    const double span = static_cast<double>(std::max<int64_t>(1, total - warmup_));
    const double t = std::min(1.0, static_cast<double>(step - warmup_) / span);
    return min_ + 0.5 * (base_ - min_) * (1.0 + std::cos(M_PI * t));
  }

 private:
  double base_, min_;
  int64_t warmup_;
};

void check_lr(const Options& o) {
  const double lr = o.get_float("lr");
  if (!(lr > 0.0 && std::isfinite(lr))) o.fail("lr", "must be > 0 and finite, got " + to_toml(lr));
}

std::tuple<double, double> betas_of(const Options& o) {
  const auto& b = o.get_floats("betas");
  if (b.size() != 2) o.fail("betas", "expected 2 values, got " + std::to_string(b.size()));
  for (double v : b)
    if (v < 0.0 || v >= 1.0) o.fail("betas", "each must be in [0, 1), got " + to_toml(v));
  return {b[0], b[1]};
}

OptionSpec implementation_spec(bool fused) {
  std::vector<std::string> forms = {"auto", "per_tensor", "foreach"};
  if (fused) forms.push_back("fused");
  OptionSpec spec = opt_string("implementation", "auto",
                    std::string("per_tensor (LibTorch's step), foreach (the same arithmetic over all parameters at "
                                "once: bit-identical on the CPU, equal to rounding on CUDA), ") +
                        (fused ? "fused (one pass over each parameter: trainkit's kernel on the CPU, LibTorch 2.4+'s "
                                 "on CUDA; equal to rounding), or auto (fused on a CPU, foreach on a GPU)"
                               : "or auto (foreach on a GPU, per_tensor on a CPU)"),
                    forms);
  // The same arithmetic to the bit on the CPU, so not part of what a run is there; fused (and
  // auto, where auto means fused) rounds its own way.
  spec.same_on_cpu = fused ? std::vector<std::string>{"per_tensor", "foreach"}
                           : std::vector<std::string>{"auto", "per_tensor", "foreach"};
  return spec;
}

OptionSpecs adam_specs(double weight_decay, bool fused) {
  return {opt_float("lr", 1e-3, "learning rate (the schedule's base)"),
          opt_floats("betas", {0.9, 0.999}, "coefficients of the running averages"),
          opt_float("eps", 1e-8, "added to the denominator"),
          opt_float("weight_decay", weight_decay, "weight decay"),
          opt_bool("amsgrad", false, "use the AMSGrad variant"), implementation_spec(fused)};
}

/// The step form the recipe asks for (`fused`: whether the optimizer has a fused form), refused
/// where this build or device cannot run it.
StepForm form_of(const Options& o, const std::vector<torch::Tensor>& params, bool fused) {
  const StepForm form = step_form(o.get_string("implementation"), params, fused);
  if (form == StepForm::Fused && !params.empty() && !has_fused_adamw(params.front().device())) {
    const c10::Device device = params.front().device();
    if (device.is_cuda())
      o.fail("implementation", "\"fused\" on CUDA needs LibTorch 2.4 or later (its at::_fused_adamw_); this build "
                               "has " + std::string(TORCH_VERSION) + ": use \"foreach\"");
    o.fail("implementation", "\"fused\" runs on CPU and CUDA, not on " + device.str());
  }
  return form;
}

/// Adam or AdamW (`Opts`, whose options are the same) from the recipe's options, in its step form.
template <class Opts, class Make>
std::unique_ptr<torch::optim::Optimizer> make_adam_like(const Options& o, std::vector<torch::Tensor> params, Make make,
                                                        bool fused) {
  check_lr(o);
  const StepForm form = form_of(o, params, fused);
  return make(std::move(params),
              Opts(o.get_float("lr")).betas(betas_of(o)).eps(o.get_float("eps")).weight_decay(o.get_float("weight_decay"))
                  .amsgrad(o.get_bool("amsgrad")),
              form);
}

template <class Maker>
struct Entry {
  std::string name, doc;
  OptionSpecs specs;
  Maker make;
};

template <class Maker>
void add_all(Registry& r, Registry& (Registry::*add)(std::string, std::string, OptionSpecs, Maker),
             std::vector<Entry<Maker>> list) {
  for (auto& c : list) (r.*add)(std::move(c.name), std::move(c.doc), std::move(c.specs), std::move(c.make));
}

void register_optim(Registry& r) {
  using torch::optim::Optimizer;
  add_all<LossMaker>(r, &Registry::add_loss, {
      {"cross_entropy", "cross-entropy over the last dimension; targets equal to ignore_index do not count",
       {opt_string("reduction", "mean", "mean or sum over counted items", {"mean", "sum"}),
        opt_int("ignore_index", -100, "target value that does not count"),
        opt_float("label_smoothing", 0.0, "label smoothing in [0, 1)")},
       [](const Options& o) -> std::unique_ptr<LossFn> {
         double ls = o.get_float("label_smoothing");
         if (ls < 0.0 || ls >= 1.0) o.fail("label_smoothing", "must be in [0, 1), got " + to_toml(ls));
         return std::make_unique<CrossEntropy>(o);
       }},
      {"mse", "mean squared error",
       {opt_string("reduction", "mean", "mean or sum over elements", {"mean", "sum"})},
       [](const Options& o) -> std::unique_ptr<LossFn> { return std::make_unique<Mse>(o); }},
  });
  add_all<OptimizerMaker>(r, &Registry::add_optimizer, {
      {"sgd", "stochastic gradient descent with optional momentum and Nesterov",
       {opt_float("lr", 0.01, "learning rate (the schedule's base)"),
        opt_float("momentum", 0.0, "momentum factor"), opt_float("dampening", 0.0, "dampening for momentum"),
        opt_float("weight_decay", 0.0, "L2 penalty added to the gradient"),
        opt_bool("nesterov", false, "Nesterov momentum (needs momentum > 0 and dampening = 0)"),
        implementation_spec(false)},
       [](const Options& o, std::vector<torch::Tensor> params) -> std::unique_ptr<Optimizer> {
         check_lr(o);
         if (o.get_bool("nesterov") && (o.get_float("momentum") <= 0.0 || o.get_float("dampening") != 0.0))
           o.fail("nesterov", "needs momentum > 0 and dampening = 0");
         const StepForm form = form_of(o, params, false);
         return make_sgd(std::move(params), torch::optim::SGDOptions(o.get_float("lr"))
                                                .momentum(o.get_float("momentum"))
                                                .dampening(o.get_float("dampening"))
                                                .weight_decay(o.get_float("weight_decay"))
                                                .nesterov(o.get_bool("nesterov")),
                         form);
       }},
      {"adam", "Adam", adam_specs(0.0, false),
       [](const Options& o, std::vector<torch::Tensor> params) -> std::unique_ptr<Optimizer> {
         return make_adam_like<torch::optim::AdamOptions>(o, std::move(params), make_adam, false);
       }},
      {"adamw", "Adam with decoupled weight decay", adam_specs(0.01, true),
       [](const Options& o, std::vector<torch::Tensor> params) -> std::unique_ptr<Optimizer> {
         return make_adam_like<torch::optim::AdamWOptions>(o, std::move(params), make_adamw, true);
       }},
  });
  add_all<ScheduleMaker>(r, &Registry::add_schedule, {
      {"constant", "the optimizer's lr throughout", {},
       [](const Options&, double base) -> std::unique_ptr<LrSchedule> { return std::make_unique<ConstantLr>(base); }},
      {"warmup_cosine", "linear warmup to the optimizer's lr, then cosine decay to min_lr; counts optimizer steps",
       {opt_int("warmup_steps", 0, "optimizer steps of linear warmup"),
        opt_float("min_lr", 0.0, "learning rate at the last step")},
       [](const Options& o, double base) -> std::unique_ptr<LrSchedule> {
         if (o.get_int("warmup_steps") < 0) o.fail("warmup_steps", "must be >= 0");
         const double min_lr = o.get_float("min_lr");
         if (!(min_lr >= 0.0 && min_lr <= base))  // a negative rate climbs the loss; one above lr is no decay
           o.fail("min_lr", "must be >= 0 and at most the optimizer's lr (" + to_toml(base) +
                                "), which the cosine decays from; got " + to_toml(min_lr));
         return std::make_unique<WarmupCosine>(base, o.get_int("warmup_steps"), o.get_float("min_lr"));
       }},
  });
  r.set_default(Kind::Schedule, "constant");  // a recipe without [schedule] keeps the optimizer's lr
}

}  // namespace
}  // namespace tk::optim

TK_LIBRARY("optim", "0.3.0", tk::optim::register_optim)
