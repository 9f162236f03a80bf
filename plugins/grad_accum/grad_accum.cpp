// Gradient accumulation: k micro-batches of m take exactly the step one batch of k*m would take.
//
// The core shapes the window (this plugin sets its size and last-window policy in configure) and
// keeps the window's totals. Gradients of the micro-batches simply add up in .grad; at the
// boundary, after any gradient sync and before unscaling and clipping, they are divided once by
// the window's true size: its micro-batch count (normalize = "mean", for mean-reduced losses) or
// its sample / token count (normalize = "samples" / "tokens", for sum-reduced losses). The count is
// the window's actual one, so a short last window is normalized correctly.
#include <tk/abi.h>

namespace {

class GradAccum final : public tk::Plugin {
 public:
  tk::OptionSpecs option_specs() const override {
    return {
        tk::opt_int("steps", 1, "micro-batches per optimizer step (k)"),
        tk::opt_string("normalize", "mean",
                       "mean: divide by the window's micro-batches (mean losses); samples / tokens: divide "
                       "by the window's examples / counted tokens (sum losses)",
                       {"mean", "samples", "tokens"}),
        tk::opt_string("last_window", "step",
                       "short window at the end of an epoch: step (normalized by its size), drop, or carry "
                       "into the next epoch",
                       {"step", "drop", "carry"}),
    };
  }

  void init(const tk::Options& o) override {
    steps_ = o.get_int("steps");
    if (steps_ < 1) o.fail("steps", "must be >= 1, got " + std::to_string(steps_));
    normalize_ = o.get_string("normalize");
    const auto& lw = o.get_string("last_window");
    policy_ = lw == "drop" ? tk::LastWindow::Drop : lw == "carry" ? tk::LastWindow::Carry : tk::LastWindow::Step;
  }

  tk::Contract contract() const override {
    tk::Contract c;
    c.provides = {tk::cap::kWindow, tk::cap::kGradsNormalized};
    c.after = {tk::cap::kGradsSynced};
    return c;
  }

  void configure(tk::RunPlan& plan) override {
    const std::string want = normalize_ == "mean" ? "mean" : "sum";
    if (plan.loss_reduction != want)
      fail_option("normalize", "\"" + normalize_ + "\" needs a loss with reduction = \"" + want +
                                     "\", but the recipe's loss uses \"" + plan.loss_reduction + "\"");
    plan.set_window(steps_, policy_, name());
  }

  void on_boundary(tk::Context& ctx) override {
    const tk::WindowTotals& t = ctx.totals();
    const int64_t divisor = normalize_ == "mean" ? t.micro_batches : normalize_ == "samples" ? t.samples : t.tokens;
    if (divisor < 1) {
      ctx.veto_step("the window has no " + normalize_ + " to normalize by");
      return;
    }
    if (divisor != 1) {
      for (auto& group : ctx.optimizer().param_groups())
        for (auto& p : group.params())
          if (p.grad().defined()) p.mutable_grad().div_(divisor);
    }
    ++windows_;
    if (ctx.window().is_short()) ++short_windows_;
    ctx.metric("accum_divisor", static_cast<double>(divisor));
  }

  tk::StateDict state() const override {
    return {{"windows", torch::tensor(windows_)}, {"short_windows", torch::tensor(short_windows_)}};
  }
  void load_state(const tk::StateDict& s) override {
    windows_ = s.at("windows").item<int64_t>();
    short_windows_ = s.at("short_windows").item<int64_t>();
  }

 private:
  int64_t steps_ = 1;
  std::string normalize_ = "mean";
  tk::LastWindow policy_ = tk::LastWindow::Step;
  int64_t windows_ = 0, short_windows_ = 0;
};

}  // namespace

TK_PLUGIN(GradAccum, "grad_accum", "0.1.0")
