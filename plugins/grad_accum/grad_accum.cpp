// Gradient accumulation: k micro-batches of m take exactly the step one batch of k*m would take.
//
// The core shapes the window (this plugin sets its size and last-window policy in configure) and
// keeps the window's totals. Gradients of the micro-batches simply add up in .grad; at the
// boundary, after any gradient sync and before unscaling and clipping, they are divided once by
// the window's true size: its micro-batch count (normalize = "mean", for mean-reduced losses) or
// its sample / token count (normalize = "samples" / "tokens", for sum-reduced losses). The count is
// the window's actual one, so a short last window is normalized correctly.
//
// The window may also be given as an effective batch (examples per optimizer step over all
// ranks): the core infers k, or with [data] micro_batch = "auto" picks the micro-batch that fits
// memory_budget; and it may ramp from a smaller effective batch at the start.
#include <tk/abi.h>

namespace {

class GradAccum final : public tk::Plugin {
 public:
  tk::OptionSpecs option_specs() const override {
    return {
        tk::opt_int("steps", 1, "micro-batches per optimizer step (k); inferred when effective_batch is given instead (or steps = 0)"),
        tk::opt_int("effective_batch", 0,
                    "examples per optimizer step over all ranks (0: steps x micro_batch x world size); give two of "
                    "steps, [data] micro_batch and this, and the third is inferred"),
        tk::opt_string("memory_budget", "",
                       "with [data] micro_batch = \"auto\": the memory one training step may use, e.g. \"1.5GiB\" "
                       "(\"\": the GPU's free memory; required on the CPU)"),
        tk::opt_int("ramp_from", 0, "effective batch of the first step, ramping linearly up to effective_batch (0: no ramp)"),
        tk::opt_int("ramp_steps", 0, "length of the ramp in optimizer steps"),
        tk::opt_int("ramp_samples", 0, "length of the ramp in examples (over all ranks)"),
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
    effective_ = o.get_int("effective_batch");
    if (effective_ < 0) o.fail("effective_batch", "must be >= 1 (or 0: not given), got " + std::to_string(effective_));
    if (steps_ < 0 || (steps_ == 0 && effective_ == 0))
      o.fail("steps", "must be >= 1 (or 0 with effective_batch: inferred), got " + std::to_string(steps_));
    // Given steps with an effective batch: the micro-batch is inferred (or checked).
    infer_steps_ = effective_ > 0 && (steps_ == 0 || !o.is_set("steps"));
    if (!o.get_string("memory_budget").empty()) budget_ = tk::parse_bytes(o, "memory_budget");
    ramp_.from = o.get_int("ramp_from");
    const int64_t by_steps = o.get_int("ramp_steps"), by_samples = o.get_int("ramp_samples");
    if (ramp_.from < 0) o.fail("ramp_from", "must be >= 1 (or 0: no ramp)");
    if (by_steps < 0 || by_samples < 0) o.fail(by_steps < 0 ? "ramp_steps" : "ramp_samples", "must be >= 0");
    if (by_steps > 0 && by_samples > 0) o.fail("ramp_samples", "give the ramp's length in ramp_steps or ramp_samples, not both");
    if (ramp_.from > 0) {
      if (effective_ == 0) o.fail("ramp_from", "a ramp goes up to effective_batch: set effective_batch too");
      if (ramp_.from >= effective_)
        o.fail("ramp_from", "is " + std::to_string(ramp_.from) + ", not below effective_batch = " + std::to_string(effective_));
      if (by_steps == 0 && by_samples == 0) o.fail("ramp_from", "give the ramp's length: ramp_steps or ramp_samples");
      ramp_.over = by_steps > 0 ? by_steps : by_samples;
      ramp_.by_samples = by_samples > 0;
    } else if (by_steps > 0 || by_samples > 0) {
      o.fail(by_steps > 0 ? "ramp_steps" : "ramp_samples", "a ramp needs ramp_from, the effective batch it starts at");
    }
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
    if (budget_ > 0 && !plan.micro_batch_auto)
      fail_option("memory_budget", "applies to a micro-batch picked by memory: set [data] micro_batch = \"auto\"");
    plan.effective_batch_goal = effective_;
    plan.memory_budget = budget_;
    plan.ramp = ramp_;
    plan.set_window(infer_steps_ ? 0 : steps_, policy_, name());
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
  int64_t steps_ = 1, effective_ = 0;
  bool infer_steps_ = false;
  double budget_ = 0;
  tk::BatchRamp ramp_;
  std::string normalize_ = "mean";
  tk::LastWindow policy_ = tk::LastWindow::Step;
  int64_t windows_ = 0, short_windows_ = 0;
};

}  // namespace

TK_PLUGIN(GradAccum, "grad_accum", "0.2.0")
