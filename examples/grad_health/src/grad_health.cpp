// grad_health: watches the gradients of every optimizer step.
//
// At each boundary, after gradient sync, normalization and unscaling (its contract says so), it
// computes the L2 norm of every parameter's gradient and writes the largest (`grad_norm_max`) and
// the total over all parameters (`grad_norm_total`) to metrics.jsonl. Every `log_every` steps it
// logs the three parameters with the largest norms. A non-finite gradient vetoes the step, naming
// the first parameter that has one (unless veto_non_finite = false); after `max_consecutive` such
// steps in a row it stops the run. Steps another plugin vetoed first (a loss-scale overflow) are
// that plugin's business and are not counted. It only reads gradients: a run whose gradients stay
// finite trains bit-identically with or without it.
#include <tk/abi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

/// One parameter's gradient norm.
struct GradNorm {
  std::string name;
  double norm;
};

/// "1.234e-05": norms in log lines.
std::string format_norm(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

class GradHealth final : public tk::Plugin {
 public:
  /// Options a recipe may set: log_every, veto_non_finite, max_consecutive.
  void bind(tk::OptionBinder& o) override {
    o.add("log_every", log_every_, "steps between log lines naming the 3 largest gradient norms (0: never)");
    o.add("veto_non_finite", veto_, "skip the optimizer step when a gradient is not finite");
    o.add("max_consecutive", max_consecutive_,
          "stop the run after this many steps in a row with non-finite gradients (0: never)");
  }

  /// Checks the options.
  void init() override {
    if (log_every_ < 0) fail_option(log_every_, "must be >= 0");
    if (max_consecutive_ < 0) fail_option(max_consecutive_, "must be >= 0");
  }

  /// Runs after every plugin that syncs, normalizes or unscales gradients; provides nothing.
  tk::Contract contract() const override {
    tk::Contract c;
    c.after = {tk::cap::kGradsSynced, tk::cap::kGradsNormalized, tk::cap::kGradsUnscaled};
    return c;
  }

  /// Measures the step's gradients, logs them, and vetoes the step when one is not finite.
  void on_boundary(tk::BoundaryContext& ctx) override {
    const std::vector<GradNorm> norms = grad_norms(ctx.model());
    if (norms.empty()) return;
    double sum_sq = 0.0, largest = 0.0;
    const GradNorm* bad = nullptr;
    for (const auto& g : norms) {
      sum_sq += g.norm * g.norm;
      if (!std::isnan(largest) && !(g.norm <= largest)) largest = g.norm;  // a NaN sticks
      if (!bad && !std::isfinite(g.norm)) bad = &g;
    }
    ctx.metric("grad_norm_max", largest);
    ctx.metric("grad_norm_total", std::sqrt(sum_sq));
    const int64_t step = ctx.counters().step + 1;  // as metrics.jsonl numbers it
    if (log_every_ > 0 && step % log_every_ == 0) ctx.info("step " + std::to_string(step) + ": " + top(norms, 3));

    if (!bad) {
      consecutive_ = 0;
      return;
    }
    if (ctx.step_vetoed()) return;
    ++consecutive_;
    const std::string what = "non-finite gradient in '" + bad->name + "' (norm " + format_norm(bad->norm) + ")";
    if (veto_) {
      ctx.veto_step(what);
      ++vetoed_;
    } else {
      ctx.warn(what + "; the step is taken (veto_non_finite = false)");
    }
    if (max_consecutive_ > 0 && consecutive_ >= max_consecutive_)
      throw std::runtime_error(what + ": " + std::to_string(consecutive_) +
                               " steps in a row with non-finite gradients (max_consecutive = " +
                               std::to_string(max_consecutive_) + ")");
  }

  /// Steps vetoed so far ("vetoed") and the current run of non-finite steps ("consecutive").
  tk::StateDict state() const override {
    return {{"vetoed", torch::tensor(vetoed_)}, {"consecutive", torch::tensor(consecutive_)}};
  }

  /// Restores what state() returned.
  void load_state(const tk::StateDict& s) override {
    vetoed_ = s.at("vetoed").item<int64_t>();
    consecutive_ = s.at("consecutive").item<int64_t>();
  }

 private:
  /// The L2 norm of every parameter's gradient, in float64, read back from the device at once.
  static std::vector<GradNorm> grad_norms(tk::Model& model) {
    torch::NoGradGuard no_grad;
    std::vector<GradNorm> out;
    std::vector<torch::Tensor> parts;
    for (const auto& p : model.named_parameters()) {
      const torch::Tensor& g = p.value().grad();
      if (!g.defined()) continue;
      out.push_back({p.key(), 0.0});
      parts.push_back(at::linalg_vector_norm(g, 2, c10::nullopt, false, at::kDouble));
    }
    if (parts.empty()) return out;
    const torch::Tensor values = at::stack(parts).cpu();
    const double* v = values.data_ptr<double>();
    for (size_t i = 0; i < out.size(); ++i) out[i].norm = v[i];
    return out;
  }

  /// "a 1.2, b 0.8, c 0.1": the `n` largest norms, largest first (a NaN counts as largest).
  static std::string top(std::vector<GradNorm> norms, size_t n) {
    auto key = [](const GradNorm& g) { return std::isnan(g.norm) ? INFINITY : g.norm; };
    n = std::min(n, norms.size());
    std::partial_sort(norms.begin(), norms.begin() + static_cast<std::ptrdiff_t>(n), norms.end(),
                      [&](const GradNorm& a, const GradNorm& b) { return key(a) > key(b); });
    std::string text = "largest gradient norms:";
    for (size_t i = 0; i < n; ++i) text += (i ? ", " : " ") + norms[i].name + " " + format_norm(norms[i].norm);
    return text;
  }

  int64_t log_every_ = 0;
  bool veto_ = true;
  int64_t max_consecutive_ = 0;
  int64_t vetoed_ = 0;       ///< steps this plugin vetoed
  int64_t consecutive_ = 0;  ///< steps in a row with non-finite gradients, up to the current one
};

}  // namespace

TK_PLUGIN(GradHealth, "grad_health", "0.2.0",
          "gradient norms of every step; vetoes a step whose gradients are not finite")
