// Why a window's loss is not finite (loop.h), looked for only once it is not.
#include "loop/loop.h"
#include "tk/sharded_state.h"

namespace tk::detail {

std::string non_finite_loss(Run& r, const LoopState& s, const std::vector<at::Tensor>& window_indices) {
  const std::string what = "the loss is " + std::to_string(s.window_loss) + " at step " +
                           std::to_string(s.counters.step + 1) + "; nothing was stepped: ";
  torch::NoGradGuard no_grad;
  // Every rank looks (the window's loss is the world's): parameters sharded between uses are
  // gathered on each.
  WholeParameters whole(r.optimizer.get());
  for (const auto& idx : window_indices) {
    const Batch b = r.fetch(*r.data.train, idx);
    for (const auto* t : {&b.input, &b.target}) {
      if (!at::isFloatingType(t->scalar_type())) continue;
      const at::Tensor bad = t->isfinite().logical_not().reshape({t->size(0), -1}).any(1);
      if (bad.any().item<bool>())
        return what + "training example " + std::to_string(idx[bad.nonzero()[0][0]].item<int64_t>()) + " of data '" +
               r.data_name + "' has a NaN or infinite " + (t == &b.input ? "input" : "target") +
               " (the data check before training reads the first million examples only)";
    }
  }
  for (const auto& p : r.model->named_parameters())
    if (!p.value().isfinite().all().item<bool>())
      return what + "parameter " + p.key() + " is no longer finite: training diverged (lower the learning rate?)";
  for (const auto& idx : window_indices) {
    const Batch b = r.fetch(*r.data.train, idx);
    if (r.model->forward(b.input).isfinite().all().item<bool>()) continue;
    if (s.counters.step == 0)
      return what + model_label(r) + " gives a non-finite output for finite inputs and its initial parameters";
    double largest = 0;
    for (const auto& p : r.model->parameters()) largest = std::max(largest, p.abs().max().item<double>());
    return what + model_label(r) + " gives a non-finite output for finite inputs and parameters (the largest " +
           fmt_loss(largest) + "): training diverged (lower the learning rate?), or the model computes a NaN";
  }
  return what + "the model's outputs are finite, the loss '" + r.loss_name +
         "' of them is not: training diverged (lower the learning rate?)";
}

}  // namespace tk::detail
