// Gradient clipping at the optimizer-step boundary: by total norm (any p, or inf) or by value.
//
// Runs once per optimizer step, after gradient sync, normalization and unscaling (its contract
// says so), never per micro-batch; with accumulation the norm is that of the whole window's
// gradient. The total norm before clipping goes to metrics.jsonl as `grad_norm` every step. No
// value is read to the host: the norm and the factor stay on the device.
// The arithmetic follows torch.nn.utils.clip_grad_norm_ / clip_grad_value_.
#include <tk/abi.h>
#include <tk/kernels.h>
#include <tk/world.h>

#include <cmath>
#include <limits>

namespace {

class Clip final : public tk::Plugin {
 public:
  void bind(tk::OptionBinder& o) override {
    o.add("max_norm", max_norm_, "clip the total gradient norm to this (0: no norm clipping)");
    o.add("norm_type", norm_type_, "p of the p-norm, > 0; inf for the max-norm");
    o.add("max_value", max_value_, "clip each gradient element to [-max_value, max_value] (0: off)");
  }

  void init() override {
    if (max_norm_ < 0 || std::isnan(max_norm_)) fail_option(max_norm_, "must be >= 0");
    if (max_value_ < 0 || std::isnan(max_value_)) fail_option(max_value_, "must be >= 0");
    if (!(norm_type_ > 0)) fail_option(norm_type_, "must be > 0 (or inf)");
    if (max_norm_ > 0 && max_value_ > 0 && option_given(max_norm_))
      fail_option(max_value_, "give max_norm or max_value, not both");
    if (max_value_ > 0) max_norm_ = 0;  // clipping by value replaces the default norm clipping
    if (max_norm_ == 0 && max_value_ == 0) fail_option(max_norm_, "one of max_norm and max_value must be > 0");
  }

  tk::Contract contract() const override {
    tk::Contract c;
    c.provides = {tk::cap::kGradsClipped};
    c.after = {tk::cap::kGradsSynced, tk::cap::kGradsNormalized, tk::cap::kGradsUnscaled};
    return c;
  }

  void configure(tk::RunPlan& plan) override { sharded_ = plan.has(tk::cap::kGradsSharded) && plan.world_size() > 1; }

  void on_boundary(tk::BoundaryContext& ctx) override {
    std::vector<torch::Tensor> grads = ctx.gradients();
    if (grads.empty() && !sharded_) return;
    torch::NoGradGuard no_grad;
    // Everything stays on the device: the norm goes to the record through the core's one read.
    const torch::Tensor norm = sharded_ ? world_norm(ctx.world(), grads) : total_norm(grads);
    ctx.metric("grad_norm", norm);
    if (ctx.step_vetoed()) return;  // the step will not be taken (e.g. an overflow found on the host)
    if (max_value_ > 0) {
      for (auto& g : grads) g.clamp_(-max_value_, max_value_);
      return;
    }
    // clip_grad_norm_'s rule: scale by max_norm / (norm + 1e-6) when that is below 1. A factor of
    // exactly 1 leaves every gradient as it was.
    const torch::Tensor coef = (max_norm_ / (norm + 1e-6)).clamp_max(1.0);
    if (clipped_steps_.device() != coef.device()) clipped_steps_ = clipped_steps_.to(coef.device());
    clipped_steps_ += (coef < 1.0).to(at::kLong);
    tk::kernels::foreach_mul_(grads, coef);
  }

  tk::StateDict state() const override { return {{"clipped_steps", clipped_steps_.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true)}}; }
  void load_state(const tk::StateDict& s) override { clipped_steps_ = s.at("clipped_steps").to(at::kLong).reshape({}); }

 private:
  /// Each gradient's norm in its own dtype (as clip_grad_norm_ takes them), in float64.
  torch::Tensor norms(const std::vector<torch::Tensor>& grads) const {
    return at::stack(at::_foreach_norm(grads, norm_type_)).to(at::kDouble);
  }

  /// The total norm of the gradients, a float64 scalar on their device.
  torch::Tensor total_norm(const std::vector<torch::Tensor>& grads) const {
    const auto all = norms(grads);
    return std::isinf(norm_type_) ? all.max() : at::linalg_vector_norm(all, norm_type_);
  }

  /// The same over gradients sharded across the world: each rank's part (its max, or its sum of
  /// p-th powers) reduced over the ranks, on every rank. A rank that holds no gradient adds 0.
  torch::Tensor world_norm(tk::World& world, const std::vector<torch::Tensor>& grads) const {
    const bool inf = std::isinf(norm_type_);
    torch::Tensor part = grads.empty() ? torch::zeros({1}, at::kDouble)
                         : inf        ? norms(grads).max().reshape({1})
                                      : norms(grads).pow(norm_type_).sum().reshape({1});
    world.all_reduce(part, inf ? tk::ReduceOp::Max : tk::ReduceOp::Sum);
    return inf ? part.reshape({}) : part.pow(1.0 / norm_type_).reshape({});
  }

  double max_norm_ = 1.0, norm_type_ = 2.0, max_value_ = 0.0;
  bool sharded_ = false;  // each rank holds its share of the gradients: the norm is reduced over the world
  torch::Tensor clipped_steps_ = torch::zeros({}, at::kLong);  // steps whose gradients were scaled down
};

}  // namespace

TK_PLUGIN(Clip, "clip", "0.2.0", "gradient clipping at the optimizer-step boundary, by total norm or by value")
