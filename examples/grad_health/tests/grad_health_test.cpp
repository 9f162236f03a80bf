// Unit tests of grad_health: single boundaries through a ManualContext (norms, the log line, the
// veto, max_consecutive), then whole runs in process with trainkit::testing (its place after
// normalization, skipped steps, a run stopped by max_consecutive).
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <tk/doctest.h>  // last: it settles the CHECK macros of LibTorch's logging

namespace {

/// An instance of the plugin with options given as TOML, as a [[plugins]] entry would make it.
std::shared_ptr<tk::Plugin> make_plugin(const std::string& options) {
  return tk::testing::load_plugin(TK_PLUGIN_FILE, options);
}

/// A model that is four one-element parameters, whose gradients a test sets by hand.
class FourParams final : public tk::Model {
 public:
  FourParams() {
    for (const char* name : {"alpha", "bravo", "charlie", "delta"})
      register_parameter(name, torch::zeros({1}, torch::kFloat64));
  }
  torch::Tensor forward(const torch::Tensor& x) override { return x; }
};

/// One boundary at a time, as the core would call it, with the gradients chosen by the test.
struct Bench {
  std::shared_ptr<FourParams> model = std::make_shared<FourParams>();
  torch::optim::SGD optimizer{model->parameters(), torch::optim::SGDOptions(0.1)};
  tk::testing::ManualContext ctx{*model, optimizer};
  std::vector<std::string> infos, warnings;

  Bench() {
    ctx.set_log([this](int level, const std::string& m) { (level == 0 ? infos : warnings).push_back(m); });
  }
  /// Sets the gradients of alpha .. delta and calls the boundary hook of 0-based step `step`.
  void boundary(tk::Plugin& p, const std::vector<double>& grads, int64_t step) {
    ctx.clear_step();
    ctx.mutable_counters().step = step;
    size_t i = 0;
    for (auto& t : model->parameters()) t.mutable_grad() = torch::full({1}, grads.at(i++), torch::kFloat64);
    ctx.call(p, tk::Event::Boundary);
  }
};

/// Records every parameter's gradient norm at every boundary, after the same gradient work as
/// grad_health, computed another way.
class NormRecorder final : public tk::Plugin {
 public:
  tk::Contract contract() const override {
    tk::Contract c;
    c.after = {tk::cap::kGradsSynced, tk::cap::kGradsNormalized, tk::cap::kGradsUnscaled};
    return c;
  }
  void on_boundary(tk::BoundaryContext& ctx) override {
    std::vector<double> step;
    for (const auto& p : ctx.model().parameters())
      if (p.grad().defined()) step.push_back(p.grad().to(torch::kFloat64).pow(2).sum().sqrt().item<double>());
    norms.push_back(step);
  }
  std::vector<std::vector<double>> norms;  ///< per step, per parameter
};

/// Sets one gradient element to `value` after the last backward of chosen 0-based steps.
class Inject final : public tk::Plugin {
 public:
  Inject(std::set<int64_t> steps, double value) : steps_(std::move(steps)), value_(value) {}
  void on_backward(tk::BackwardContext& ctx) override {
    if (!steps_.count(ctx.counters().step) || !ctx.window().is_last()) return;
    torch::NoGradGuard no_grad;
    ctx.model().parameters().front().mutable_grad().view({-1})[0].fill_(value_);
  }

 private:
  std::set<int64_t> steps_;
  double value_;
};

/// Whether every parameter is finite.
bool all_finite(const tk::testing::Parameters& params) {
  for (const auto& [name, t] : params)
    if (!torch::isfinite(t).all().item<bool>()) return false;
  return true;
}

}  // namespace

TEST_CASE("the largest and the total gradient norm, and the three largest in the log") {
  auto health = make_plugin("log_every = 2");
  Bench b;
  const std::vector<double> grads = {1.0, -4.0, 3.0, 2.0};
  b.boundary(*health, grads, 0);
  CHECK(b.ctx.metric_value("grad_norm_max") == 4.0);
  CHECK(b.ctx.metric_value("grad_norm_total") == doctest::Approx(std::sqrt(30.0)).epsilon(1e-15));
  CHECK(b.ctx.veto_reason().empty());
  CHECK(b.infos.empty());  // step 1 of metrics.jsonl: not a multiple of log_every

  b.boundary(*health, grads, 1);
  REQUIRE(b.infos.size() == 1);
  const std::string& line = b.infos[0];
  CAPTURE(line);
  CHECK(line.find("grad_health: step 2") == 0);
  CHECK(line.find("bravo") < line.find("charlie"));
  CHECK(line.find("charlie") < line.find("delta"));
  CHECK(line.find("delta") != std::string::npos);
  CHECK(line.find("alpha") == std::string::npos);
}

TEST_CASE("log_every = 0 never logs") {
  auto health = make_plugin("");
  Bench b;
  for (int64_t step = 0; step < 10; ++step) b.boundary(*health, {1.0, 2.0, 3.0, 4.0}, step);
  CHECK(b.infos.empty());
}

TEST_CASE("a non-finite gradient vetoes the step, naming the first parameter that has one") {
  auto health = make_plugin("");
  Bench b;
  b.boundary(*health, {1.0, NAN, INFINITY, 2.0}, 0);
  CHECK(b.ctx.vetoed_by() == "grad_health");
  CHECK(b.ctx.veto_reason().find("'bravo'") != std::string::npos);
  CHECK(b.ctx.metrics().size() == 2);
  CHECK(std::isnan(b.ctx.metric_value("grad_norm_total")));
  CHECK(std::isnan(b.ctx.metric_value("grad_norm_max")));

  b.boundary(*health, {1.0, 1.0, INFINITY, 1.0}, 1);
  CHECK(b.ctx.veto_reason().find("'charlie'") != std::string::npos);
  CHECK(std::isinf(b.ctx.metric_value("grad_norm_total")));

  b.boundary(*health, {1.0, 1.0, 1.0, 1.0}, 2);
  CHECK(b.ctx.veto_reason().empty());
  const tk::StateDict state = health->state();
  CHECK(state.at("vetoed").item<int64_t>() == 2);
  CHECK(state.at("consecutive").item<int64_t>() == 0);
}

TEST_CASE("with veto_non_finite = false a non-finite gradient is only warned about") {
  auto health = make_plugin("veto_non_finite = false");
  Bench b;
  b.boundary(*health, {1.0, NAN, 1.0, 1.0}, 0);
  CHECK(b.ctx.veto_reason().empty());
  REQUIRE(b.warnings.size() == 1);
  CHECK(b.warnings[0].find("'bravo'") != std::string::npos);
  CHECK(health->state().at("vetoed").item<int64_t>() == 0);
}

TEST_CASE("max_consecutive counts non-finite steps in a row; a finite step starts the count over") {
  auto health = make_plugin("max_consecutive = 2");
  Bench b;
  const std::vector<double> bad = {NAN, 1.0, 1.0, 1.0}, good = {1.0, 1.0, 1.0, 1.0};
  b.boundary(*health, bad, 0);
  b.boundary(*health, good, 1);
  b.boundary(*health, bad, 2);
  CHECK_THROWS_WITH_AS(b.boundary(*health, bad, 3), doctest::Contains("2 steps in a row"), std::runtime_error);
}

TEST_CASE("metrics every step, equal to norms recomputed after normalization") {
  auto recorder = std::make_shared<NormRecorder>();
  tk::testing::RunOptions opts;
  // 4 micro-batches per step: the gradients are only right once grad_accum has normalized them.
  opts.libraries = {{TK_PLUGIN_FILE, ""}, {TK_PLUGIN_DIR "/tk_grad_accum.so", ""}};
  opts.overrides = {"batch.accumulation=4"};
  opts.plugins = {{recorder, "norm_recorder"}};
  const auto run = tk::testing::run(tk::testing::kTinyRecipe, opts);
  REQUIRE(run.fit.step_metrics.size() == 6);
  REQUIRE(recorder->norms.size() == 6);
  for (size_t k = 0; k < 6; ++k) {
    CAPTURE(k);
    const auto& m = run.fit.step_metrics[k];
    REQUIRE(m.count("grad_norm_max") == 1);
    REQUIRE(m.count("grad_norm_total") == 1);
    double sum_sq = 0.0, largest = 0.0;
    for (double n : recorder->norms[k]) {
      sum_sq += n * n;
      largest = std::max(largest, n);
    }
    CHECK(m.at("grad_norm_total") == doctest::Approx(std::sqrt(sum_sq)).epsilon(1e-12));
    CHECK(m.at("grad_norm_max") == doctest::Approx(largest).epsilon(1e-12));
    CHECK(m.at("grad_norm_max") > 0.0);
    CHECK(m.at("grad_norm_max") <= m.at("grad_norm_total"));
  }
  CHECK(run.fit.skipped_steps == 0);
}

TEST_CASE("it changes nothing in a run whose gradients stay finite") {
  tk::testing::RunOptions with;
  with.libraries = {{TK_PLUGIN_FILE, "log_every = 1"}};
  const auto a = tk::testing::run(tk::testing::kTinyRecipe, with);
  const auto b = tk::testing::run(tk::testing::kTinyRecipe);
  CHECK(tk::testing::identical(a.parameters, b.parameters));
}

TEST_CASE("an injected NaN gradient skips its step and the weights stay finite") {
  auto health = make_plugin("");
  tk::testing::RunOptions opts;
  opts.plugins = {health, {std::make_shared<Inject>(std::set<int64_t>{2}, NAN), "inject"}};
  const auto run = tk::testing::run(tk::testing::kTinyRecipe, opts);
  CHECK(run.fit.steps == 6);
  CHECK(run.fit.skipped_steps == 1);
  CHECK(all_finite(run.parameters));
  REQUIRE(run.fit.step_metrics.size() == 6);
  CHECK(std::isnan(run.fit.step_metrics[2].at("grad_norm_total")));
  CHECK(std::isfinite(run.fit.step_metrics[3].at("grad_norm_total")));
  CHECK(health->state().at("vetoed").item<int64_t>() == 1);
}

TEST_CASE("with veto_non_finite = false the NaN reaches the weights") {
  tk::testing::RunOptions opts;
  opts.libraries = {{TK_PLUGIN_FILE, "veto_non_finite = false"}};
  opts.plugins = {{std::make_shared<Inject>(std::set<int64_t>{5}, NAN), "inject"}};  // the last step
  const auto run = tk::testing::run(tk::testing::kTinyRecipe, opts);
  CHECK(run.fit.skipped_steps == 0);
  CHECK_FALSE(all_finite(run.parameters));
}

TEST_CASE("max_consecutive = 2 stops a run at its second non-finite step in a row") {
  tk::testing::RunOptions opts;
  opts.libraries = {{TK_PLUGIN_FILE, "max_consecutive = 2"}};
  opts.plugins = {{std::make_shared<Inject>(std::set<int64_t>{2, 3}, NAN), "inject"}};
  CHECK_THROWS_WITH_AS(tk::testing::run(tk::testing::kTinyRecipe, opts),
                       doctest::Contains("tk_grad_health.so) failed in event boundary in step 4: "),
                       tk::PluginRuntimeError);

  opts.plugins = {{std::make_shared<Inject>(std::set<int64_t>{1, 3}, NAN), "inject"}};  // not in a row
  const auto run = tk::testing::run(tk::testing::kTinyRecipe, opts);
  CHECK(run.fit.skipped_steps == 2);
  CHECK(all_finite(run.parameters));
}
