// The checks before training (and in a dry run): every example of the data up to a million, then
// one micro-batch through the model and the loss, in eval mode without gradients (no random draws,
// no statistics updated), so that data or a model that cannot train is refused naming its place.
#include "assemble/assemble.h"
#include "planning/planning.h"

namespace tk::detail {
namespace {

/// Checks a split's every example (up to a million) before training: inputs finite, targets of
/// the kind the loss takes and, for classes, in range. Says which split and example is wrong.
void check_split(Run& r, const Dataset& ds, const std::string& split) {
  const DataInfo& info = r.data.info;
  const std::string where = "data '" + r.data_name + "', " + split + " split";
  const int64_t n = std::min<int64_t>(ds.size(), 1000000), chunk = 4096;
  int64_t counted = 0;
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t end = std::min(n, start + chunk);
    const Batch b = ds.get(at::arange(start, end, at::kLong));
    counted += b.tokens;
    auto first_bad = [&](const at::Tensor& bad) {
      const auto rows = bad.reshape({bad.size(0), -1}).any(1);
      return start + rows.nonzero().min().item<int64_t>();
    };
    if (at::isFloatingType(b.input.scalar_type())) {
      const auto bad = b.input.isfinite().logical_not();
      if (bad.any().item<bool>())
        throw RecipeError(r.data_opts.section_loc(), where + ": example " + std::to_string(first_bad(bad)) +
                                                         " has NaN or infinite inputs");
    }
    const at::Tensor& y = b.target;
    if (info.classification) {
      if (at::isFloatingType(y.scalar_type()))
        throw RecipeError(r.data_opts.section_loc(), where + ": the targets are floating point (" +
                                                         std::string(c10::toString(y.scalar_type())) +
                                                         "), but class targets must be integer class indices");
      auto counts = info.ignore_index ? y != *info.ignore_index : at::ones_like(y, at::kBool);
      const auto bad = counts.logical_and(y.lt(0).logical_or(y.ge(info.output_dim)));
      if (bad.any().item<bool>()) {
        const int64_t i = first_bad(bad);
        const int64_t v = y.reshape({y.size(0), -1})[i - start].masked_select(bad.reshape({y.size(0), -1})[i - start])[0].item<int64_t>();
        throw RecipeError(r.data_opts.section_loc(), where + ": example " + std::to_string(i) + " has target " +
                                                         std::to_string(v) + ", outside the " +
                                                         std::to_string(info.output_dim) + " classes [0, " +
                                                         std::to_string(info.output_dim - 1) + "]");
      }
    } else if (at::isFloatingType(y.scalar_type())) {
      const auto bad = y.isfinite().logical_not();
      if (bad.any().item<bool>())
        throw RecipeError(r.data_opts.section_loc(), where + ": example " + std::to_string(first_bad(bad)) +
                                                         " has a NaN or infinite target");
    }
  }
  if (counted == 0 && n > 0) r.warn(where + ": no target counts (every one is masked out): it trains on nothing");
}

}  // namespace

void check_data_and_model(Run& r) {
  check_split(r, *r.data.train, "training");
  if (r.data.validation) check_split(r, *r.data.validation, "validation");
  const int64_t m = std::min<int64_t>(r.plan.micro_batch, r.data.train->size());
  const Batch b = r.fetch(*r.data.train, at::arange(m, at::kLong));
  const std::string what = "model '" + r.model_name + "' on data '" + r.data_name + "' (" + r.data.info.describe() + ")";
  torch::NoGradGuard no_grad;
  const bool training = r.model->is_training();
  r.model->eval();
  try {
    const at::Tensor out = r.model->forward(b.input);
    if (!at::isFloatingType(out.scalar_type()))
      throw Error("its output is " + std::string(c10::toString(out.scalar_type())) + ", not floating point");
    const DataInfo& info = r.data.info;
    if (info.classification && out.dim() < 2)
      throw Error("its output " + c10::str(out.sizes()) + " has no class dimension (expected [N, " +
                  std::to_string(info.output_dim) + "] or [N, T, " + std::to_string(info.output_dim) + "])");
    if (info.classification && out.dim() >= 2 && out.size(-1) != info.output_dim)
      throw Error("it gives " + std::to_string(out.size(-1)) + " scores per prediction (output " + c10::str(out.sizes()) +
                  "), the data has " + std::to_string(info.output_dim) + " classes");
    const at::Tensor loss = (*r.loss)(out, b);
    if (loss.numel() != 1) throw Error("loss '" + r.loss_name + "' gave " + c10::str(loss.sizes()) + ", not one value");
  } catch (const std::exception& e) {
    r.model->train(training);
    throw RecipeError(r.model_opts.section_loc(), what + ": one micro-batch of input " + c10::str(b.input.sizes()) +
                                                      " does not go through the model and loss '" + r.loss_name +
                                                      "': " + message_of(e));
  }
  r.model->train(training);
}

}  // namespace tk::detail
