// Multi-tensor (foreach) forms of LibTorch's Adam, AdamW and SGD, and the fused AdamW of LibTorch
// 2.4+: the same optimizer classes, state and checkpoints, with step() done as a few operations
// over every parameter of a group instead of a few operations per parameter.
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
  Fused,      ///< AdamW only: at::_fused_adamw_ (LibTorch 2.4+), one kernel; equal within rounding
};

/// "per_tensor", "foreach", "fused", or "auto": foreach where the parameters are on a GPU (a launch
/// per parameter saved), per_tensor on a CPU (where a foreach operation is the same loop).
StepForm step_form(const std::string& name, const std::vector<torch::Tensor>& params);
/// Whether this LibTorch has the fused AdamW kernel for tensors of `device`.
bool has_fused_adamw(const c10::Device& device);

std::unique_ptr<torch::optim::Optimizer> make_adam(std::vector<torch::Tensor> params,
                                                   const torch::optim::AdamOptions& o, StepForm form);
std::unique_ptr<torch::optim::Optimizer> make_adamw(std::vector<torch::Tensor> params,
                                                    const torch::optim::AdamWOptions& o, StepForm form);
std::unique_ptr<torch::optim::Optimizer> make_sgd(std::vector<torch::Tensor> params,
                                                  const torch::optim::SGDOptions& o, StepForm form);

}  // namespace tk::optim
