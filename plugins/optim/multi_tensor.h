// Multi-tensor (foreach) forms of LibTorch's Adam, AdamW and SGD, and a fused AdamW (trainkit's
// one-pass kernel on the CPU, LibTorch 2.4+'s on CUDA): the same optimizer classes, state and
// checkpoints, with step() done as a few operations over every parameter of a group, or one pass
// over each parameter, instead of a few operations per parameter.
#pragma once

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <memory>
#include <string>
#include <vector>

namespace tk::optim {

/// How an optimizer's step runs over the parameters of a group.
enum class StepForm {
  PerTensor,  ///< LibTorch's own step: a few kernels per parameter
  Foreach,    ///< the same arithmetic through _foreach_* operations: bit-identical to PerTensor on the
              ///< CPU, equal to rounding on CUDA
  Fused,      ///< AdamW only: one pass over each parameter (adamw_cpu.cpp) on the CPU,
              ///< at::_fused_adamw_ (LibTorch 2.4+) on CUDA; equal to PerTensor within rounding
};

/// "per_tensor", "foreach", "fused", or "auto": foreach where the parameters are on a GPU (a launch
/// per parameter saved); on a CPU, fused where the optimizer has it (`fused_on_cpu`: a third of
/// the memory traffic), else per_tensor (a foreach operation is the same loop there).
StepForm step_form(const std::string& name, const std::vector<torch::Tensor>& params, bool fused_on_cpu);
/// Whether the fused AdamW runs on tensors of `device` with this LibTorch.
bool has_fused_adamw(const c10::Device& device);

/// The scalars of an Adam or AdamW step of a parameter whose step count is `step` (already
/// advanced), in double, as LibTorch's step computes them (each kernel rounds them to the
/// parameter's dtype); `decay` is AdamW's decoupled shrink, 1 - lr weight_decay.
struct AdamScalars {
  template <class Opts>
  AdamScalars(const Opts& o, int64_t step)
      : AdamScalars(o.lr(), o.weight_decay(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(), step) {}
  AdamScalars(double lr, double weight_decay, double beta1, double beta2, double eps, int64_t step);
  double decay, beta1, beta2, bc2_sqrt, eps, neg_step_size;
};
/// One AdamW step of CPU parameter `p` (its step count already advanced into `s`), in one pass
/// over p, its gradient `g` and moments `m` and `v` (and `vmax`, defined with AMSGrad), threaded
/// over the elements. A dtype other than float32 or float64, or tensors that are not contiguous
/// alike, take LibTorch's per-tensor operations instead.
void cpu_adamw_step(at::Tensor p, const at::Tensor& g, at::Tensor m, at::Tensor v, at::Tensor vmax,
                    const AdamScalars& s);

std::unique_ptr<torch::optim::Optimizer> make_adam(std::vector<torch::Tensor> params,
                                                   const torch::optim::AdamOptions& o, StepForm form);
std::unique_ptr<torch::optim::Optimizer> make_adamw(std::vector<torch::Tensor> params,
                                                    const torch::optim::AdamWOptions& o, StepForm form);
std::unique_ptr<torch::optim::Optimizer> make_sgd(std::vector<torch::Tensor> params,
                                                  const torch::optim::SGDOptions& o, StepForm form);

}  // namespace tk::optim
