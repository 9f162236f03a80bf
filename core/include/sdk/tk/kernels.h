#pragma once
/// Kernels trainkit takes from LibTorch where the version has them and computes itself where it
/// does not: causal attention, a multiply of a tensor list by a device scalar, the fused AdamW step.
/// Header-only: a plugin may use them (the clip plugin scales its gradients with foreach_mul_).
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include <torch/version.h>

/// Whether the LibTorch these headers are compiled against is `major.minor` or later.
#ifndef TK_TORCH_AT_LEAST
#define TK_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))
#endif

namespace tk::kernels {

/// Causal (masked) scaled dot-product attention over q, k, v [B, H, T, D]. LibTorch 2.0+ has a
/// fused kernel (flash / memory-efficient on CUDA); 1.x gets the same arithmetic written out, with
/// the scale and the mask folded into one batched product (baddbmm adds the -inf of the future
/// positions): no separate passes over the scores for them, forward or backward.
inline at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout) {
#if TK_TORCH_AT_LEAST(2, 0)
  return at::scaled_dot_product_attention(q, k, v, {}, dropout, /*is_causal=*/true);
#else
  const int64_t b = q.size(0), h = q.size(1), t = q.size(2), d = q.size(3);
  auto future = at::full({t, t}, -std::numeric_limits<double>::infinity(), q.options()).triu(1);
  auto scores = at::baddbmm(future.expand({b * h, t, t}), q.reshape({b * h, t, d}),
                            k.reshape({b * h, t, d}).transpose(1, 2), 1.0, 1.0 / std::sqrt(static_cast<double>(d)));
  auto weights = at::softmax(scores, -1);
  if (dropout > 0.0) weights = at::dropout(weights, dropout, /*train=*/true);
  return at::bmm(weights, v.reshape({b * h, t, d})).view({b, h, t, d});
#endif
}

/// Multiplies every tensor of `list` by the one-element tensor `factor` (which stays on its device:
/// nothing is read to the host), as t.mul_(factor) does: the factor cast to each tensor's dtype.
/// LibTorch 2.1+ does it as one foreach operation per dtype.
inline void foreach_mul_(at::TensorList list, const at::Tensor& factor) {
#if TK_TORCH_AT_LEAST(2, 1)
  std::vector<std::vector<at::Tensor>> by_dtype;
  for (const auto& t : list) {
    auto it = std::find_if(by_dtype.begin(), by_dtype.end(),
                           [&](const std::vector<at::Tensor>& g) { return g.front().scalar_type() == t.scalar_type(); });
    if (it == by_dtype.end()) by_dtype.push_back({t});
    else it->push_back(t);
  }
  for (const auto& group : by_dtype) at::_foreach_mul_(group, factor.to(group.front().scalar_type()));
#else
  for (const auto& t : list) t.mul_(factor);
#endif
}

/// Whether this LibTorch has the fused AdamW kernel (at::_fused_adamw_, CPU and CUDA since 2.4).
constexpr bool kHasFusedAdamW = TK_TORCH_AT_LEAST(2, 4);

/// One fused AdamW step over the lists (LibTorch 2.4+; `steps` are float tensors holding each
/// parameter's step count, already advanced). Throws where the kernel does not exist.
inline void fused_adamw_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                         at::TensorList max_exp_avg_sqs, at::TensorList steps, double lr, double beta1, double beta2,
                         double weight_decay, double eps, bool amsgrad) {
#if TK_TORCH_AT_LEAST(2, 4)
  at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, weight_decay, eps,
                    amsgrad, /*maximize=*/false);
#else
  (void)params, (void)grads, (void)exp_avgs, (void)exp_avg_sqs, (void)max_exp_avg_sqs, (void)steps;
  (void)lr, (void)beta1, (void)beta2, (void)weight_decay, (void)eps, (void)amsgrad;
  throw std::runtime_error("LibTorch " TORCH_VERSION " has no fused AdamW (it came with 2.4)");
#endif
}

}  // namespace tk::kernels
