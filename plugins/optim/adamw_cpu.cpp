// AdamW on the CPU in one pass over memory: each element of a parameter is read and written once,
// with its gradient and both moments (7 values moved per element, 8 with AMSGrad), where
// LibTorch's per-tensor step makes about ten passes (some 22 values moved per element) and
// allocates a parameter-sized denominator. The step is memory-bound, so the pass count is the time.
//
// The arithmetic is LibTorch's AdamW per element, in the parameter's dtype, with its scalars
// rounded to that dtype as LibTorch's kernels round them, operation for operation:
//   p = p * (1 - lr wd);  m = m b1 + (1 - b1) g;  v = v b2 + ((1 - b2) g) g;  [vmax = max(vmax, v)]
//   p = p + (-lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps)
// This file is compiled without floating-point contraction, so the vectorized body and the scalar
// tail round alike and an element's result does not depend on where it lies (a shard of a
// parameter steps as the whole would). LibTorch's own vectorized kernels fuse some multiplies and
// adds: the two agree to rounding, not to the bit.
#include "multi_tensor.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/maximum.h>

#include <cmath>

namespace tk::optim {
namespace {

template <class T>
struct Coefficients {
  T decay, beta1, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size;
};

template <class T, bool kAmsgrad>
void step_span(T* __restrict p, const T* __restrict g, T* __restrict m, T* __restrict v, T* __restrict vmax,
               int64_t n, const Coefficients<T> c) {
  for (int64_t i = 0; i < n; ++i) {
    const T gi = g[i];
    const T mi = m[i] * c.beta1 + c.one_minus_beta1 * gi;
    const T vi = v[i] * c.beta2 + c.one_minus_beta2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    T used = vi;
    if constexpr (kAmsgrad) {
      used = (vi > vmax[i] || vi != vi) ? vi : vmax[i];  // NaN propagates, as at::maximum does
      vmax[i] = used;
    }
    p[i] = p[i] * c.decay + c.neg_step_size * mi / (std::sqrt(used) / c.bc2_sqrt + c.eps);
  }
}

/// Whether the kernel can run over `t`'s memory as one flat array laid out like `like`'s.
bool flat_like(const at::Tensor& t, const at::Tensor& like) {
  return t.defined() && t.device().is_cpu() && t.scalar_type() == like.scalar_type() && t.is_contiguous() &&
         t.numel() == like.numel();
}

/// LibTorch's per-tensor AdamW arithmetic for a parameter the kernel cannot take (a dtype other
/// than float32 and float64, or a layout that is not contiguous).
void step_with_ops(at::Tensor& p, const at::Tensor& g, at::Tensor& m, at::Tensor& v, at::Tensor& vmax,
                   const AdamScalars& s) {
  if (s.decay != 1.0) p.mul_(s.decay);
  m.mul_(s.beta1).add_(g, 1 - s.beta1);
  v.mul_(s.beta2).addcmul_(g, g, 1 - s.beta2);
  if (vmax.defined()) vmax.copy_(at::maximum(vmax, v));
  const at::Tensor denom = ((vmax.defined() ? vmax : v).sqrt() / s.bc2_sqrt).add_(s.eps);
  p.addcdiv_(m, denom, s.neg_step_size);
}

}  // namespace

AdamScalars::AdamScalars(double lr, double weight_decay, double beta1, double beta2, double eps, int64_t step)
    : decay(1 - lr * weight_decay),
      beta1(beta1),
      beta2(beta2),
      bc2_sqrt(std::sqrt(1 - std::pow(beta2, static_cast<double>(step)))),
      eps(eps),
      neg_step_size(-(lr / (1 - std::pow(beta1, static_cast<double>(step))))) {}

void cpu_adamw_step(at::Tensor p, const at::Tensor& g, at::Tensor m, at::Tensor v, at::Tensor vmax,
                    const AdamScalars& s) {
  const bool amsgrad = vmax.defined();
  const bool flat = (p.scalar_type() == at::kFloat || p.scalar_type() == at::kDouble) && p.is_contiguous() &&
                    flat_like(g, p) && flat_like(m, p) && flat_like(v, p) && (!amsgrad || flat_like(vmax, p));
  if (!flat) return step_with_ops(p, g, m, v, vmax, s);
  AT_DISPATCH_FLOATING_TYPES(p.scalar_type(), "tk_adamw_cpu", [&] {
    using T = scalar_t;
    const Coefficients<T> c{static_cast<T>(s.decay), static_cast<T>(s.beta1), static_cast<T>(1 - s.beta1),
                            static_cast<T>(s.beta2), static_cast<T>(1 - s.beta2), static_cast<T>(s.bc2_sqrt),
                            static_cast<T>(s.eps),   static_cast<T>(s.neg_step_size)};
    T* pp = p.data_ptr<T>();
    const T* gp = g.data_ptr<T>();
    T* mp = m.data_ptr<T>();
    T* vp = v.data_ptr<T>();
    T* xp = amsgrad ? vmax.data_ptr<T>() : nullptr;
    // Chunks of 64 KiB of float32 or more per thread: small parameters stay on the calling thread.
    at::parallel_for(0, p.numel(), 16384, [&](int64_t begin, int64_t end) {
      if (amsgrad) step_span<T, true>(pp + begin, gp + begin, mp + begin, vp + begin, xp + begin, end - begin, c);
      else step_span<T, false>(pp + begin, gp + begin, mp + begin, vp + begin, nullptr, end - begin, c);
    });
  });
}

}  // namespace tk::optim
