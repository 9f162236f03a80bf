// Gradient accumulation: k micro-batches of m take exactly the step one batch of k*m would take.
//
// The recipe's [batch] section gives the window (k, or the effective batch it follows from, a
// ramp, the last window's policy) and the core runs it and keeps the window's totals. Gradients of
// the micro-batches simply add up in .grad; at the boundary, after any gradient sync and before
// unscaling and clipping, this plugin divides them once by the window's true size: its
// micro-batch count (normalize = "mean", for mean-reduced losses) or its sample / token count
// (normalize = "samples" / "tokens", for sum-reduced losses). The count is the window's actual
// one, so a short last window is normalized correctly.
//
// Its options steps, effective_batch, memory_budget, last_window and ramp_* are deprecated: given,
// they shape the window as before (RunPlan::set_window), and the core says what [batch] lines to
// write instead.
#include <tk/abi.h>

namespace {

/// What the window's gradient is divided by.
enum class Normalize { Mean, Samples, Tokens };

class GradAccum final : public tk::Plugin {
 public:
  void bind(tk::OptionBinder& o) override {
    o.add("steps", steps_, "deprecated: [batch] accumulation").moved_to("batch.accumulation");
    o.add("effective_batch", effective_, "deprecated: [batch] effective_batch").moved_to("batch.effective_batch");
    o.add("memory_budget", memory_budget_, "deprecated: [batch] memory_budget").moved_to("batch.memory_budget");
    o.add("ramp_from", ramp_from_, "deprecated: [batch] ramp_from").moved_to("batch.ramp_from");
    o.add("ramp_steps", ramp_steps_, "deprecated: [batch] ramp_steps").moved_to("batch.ramp_steps");
    o.add("ramp_samples", ramp_samples_, "deprecated: [batch] ramp_samples").moved_to("batch.ramp_samples");
    o.choice("normalize", normalize_,
             "mean: divide by the window's micro-batches (mean losses); samples / tokens: divide by the window's examples "
             "/ counted tokens (sum losses)",
             {{"mean", Normalize::Mean}, {"samples", Normalize::Samples}, {"tokens", Normalize::Tokens}});
    o.choice("last_window", last_window_, "deprecated: [batch] last_window",
             {{"step", tk::LastWindow::Step}, {"drop", tk::LastWindow::Drop}, {"carry", tk::LastWindow::Carry}})
        .moved_to("batch.last_window");
  }

  void init() override {
    if (effective_ < 0) fail_option(effective_, "must be >= 1 (or 0: not given), got " + std::to_string(effective_));
    if (steps_ < 0 || (steps_ == 0 && effective_ == 0))
      fail_option(steps_, "must be >= 1 (or 0 with effective_batch: inferred), got " + std::to_string(steps_));
    // Given steps with an effective batch: the micro-batch is inferred (or checked).
    infer_steps_ = effective_ > 0 && (steps_ == 0 || !option_given(steps_));
    if (!memory_budget_.empty()) {
      const auto bytes = tk::parse_bytes(memory_budget_);
      if (!bytes) fail_option(memory_budget_, tk::bytes_expected(memory_budget_));
      budget_ = *bytes;
    }
    init_ramp();
  }

  tk::Contract contract() const override {
    tk::Contract c;
    c.provides = {tk::cap::kWindow, tk::cap::kGradsNormalized};
    c.after = {tk::cap::kGradsSynced};
    return c;
  }

  void configure(tk::RunPlan& plan) override {
    const tk::Reduction want = normalize_ == Normalize::Mean ? tk::Reduction::Mean : tk::Reduction::Sum;
    if (plan.reduction() != want)
      fail_option(normalize_, "\"" + what(normalize_) + "\" needs a loss with reduction = \"" + tk::to_string(want) +
                                  "\", but the loss's reduction is \"" + tk::to_string(plan.reduction()) + "\": set [loss] " +
                                  "reduction = \"" + tk::to_string(want) + "\", or normalize = \"" +
                                  (want == tk::Reduction::Mean ? "samples\" (or \"tokens\", for sequences)" : "mean\""));
    if (!shapes_window()) return;  // the batch's shape is [batch]'s
    if (budget_ > 0 && !plan.micro_batch_auto())
      fail_option(memory_budget_, "applies to a micro-batch picked by memory: set [batch] micro_batch = \"auto\"");
    tk::WindowRequest w;
    w.steps = infer_steps_ ? 0 : steps_;
    w.last_window = last_window_;
    w.effective_batch = effective_;
    w.memory_budget = budget_;
    w.ramp = ramp_;
    plan.set_window(w);
  }

  void on_boundary(tk::BoundaryContext& ctx) override {
    const tk::WindowTotals& t = ctx.totals();
    const int64_t divisor = normalize_ == Normalize::Mean      ? t.micro_batches
                            : normalize_ == Normalize::Samples ? t.samples
                                                               : t.tokens;
    if (divisor < 1) {
      ctx.veto_step("the window has no " + what(normalize_) + " to normalize by");
      return;
    }
    if (divisor != 1) {
      std::vector<torch::Tensor> grads = ctx.gradients();
      if (!grads.empty()) at::_foreach_div_(grads, static_cast<double>(divisor));
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
  /// Whether the recipe shaped the window in this plugin's options (deprecated).
  bool shapes_window() const {
    return option_given(steps_) || option_given(effective_) || option_given(memory_budget_) ||
           option_given(last_window_) || option_given(ramp_from_) || option_given(ramp_steps_) ||
           option_given(ramp_samples_);
  }

  static std::string what(Normalize n) { return n == Normalize::Mean ? "mean" : n == Normalize::Samples ? "samples" : "tokens"; }

  void init_ramp() {
    ramp_.from = ramp_from_;
    if (ramp_from_ < 0) fail_option(ramp_from_, "must be >= 1 (or 0: no ramp)");
    if (ramp_steps_ < 0) fail_option(ramp_steps_, "must be >= 0");
    if (ramp_samples_ < 0) fail_option(ramp_samples_, "must be >= 0");
    if (ramp_steps_ > 0 && ramp_samples_ > 0)
      fail_option(ramp_samples_, "give the ramp's length in ramp_steps or ramp_samples, not both");
    if (ramp_from_ > 0) {
      if (effective_ == 0) fail_option(ramp_from_, "a ramp goes up to effective_batch: set effective_batch too");
      if (ramp_from_ >= effective_)
        fail_option(ramp_from_, "is " + std::to_string(ramp_from_) + ", not below effective_batch = " +
                                    std::to_string(effective_));
      if (ramp_steps_ == 0 && ramp_samples_ == 0) fail_option(ramp_from_, "give the ramp's length: ramp_steps or ramp_samples");
      ramp_.over = ramp_steps_ > 0 ? ramp_steps_ : ramp_samples_;
      ramp_.by_samples = ramp_samples_ > 0;
    } else if (ramp_steps_ > 0) {
      fail_option(ramp_steps_, "a ramp needs ramp_from, the effective batch it starts at");
    } else if (ramp_samples_ > 0) {
      fail_option(ramp_samples_, "a ramp needs ramp_from, the effective batch it starts at");
    }
  }

  // Options, with their defaults.
  int64_t steps_ = 1, effective_ = 0, ramp_from_ = 0, ramp_steps_ = 0, ramp_samples_ = 0;
  std::string memory_budget_;
  Normalize normalize_ = Normalize::Mean;
  tk::LastWindow last_window_ = tk::LastWindow::Step;
  // Derived from them.
  bool infer_steps_ = false;
  double budget_ = 0;
  tk::BatchRamp ramp_;
  // State.
  int64_t windows_ = 0, short_windows_ = 0;
};

}  // namespace

TK_PLUGIN(GradAccum, "grad_accum", "0.3.0",
          "gradient accumulation: k micro-batches take exactly the step of one batch of k x m")
