// Mixed precision and clipping, alone and composed with accumulation.
//
// Clipping is checked against golden values from PyTorch's clip_grad_norm_ / clip_grad_value_
// (tests/golden/make_clip_golden.py). The loss scaler is checked against sequences written out by
// hand from GradScaler's documented rule. fp16 runs where this LibTorch has Half kernels for the
// device (LibTorch 2.x on CPU); everywhere, the same scaler runs under bf16 with
// loss_scale = "dynamic".
#include <tk/tensor_io.h>
#include <tk/testing.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <map>

#include <nlohmann/json.hpp>

#include "support.h"

namespace fs = std::filesystem;
using torch::Tensor;

namespace {

/// A model that is nothing but parameters of given shapes (for applying a plugin to set gradients).
class ParamBag : public tk::Model {
 public:
  explicit ParamBag(const std::vector<Tensor>& shapes_like) {
    for (size_t i = 0; i < shapes_like.size(); ++i)
      register_parameter("p" + std::to_string(i), torch::zeros_like(shapes_like[i]));
  }
  Tensor forward(const Tensor& x) override { return x; }
};

std::shared_ptr<tk::Plugin> load_plugin(const std::string& name, const std::string& options) {
  return tk::testing::load_plugin(tk::PluginLoader({TK_PLUGIN_DIR}).find(name), options);
}

/// Changes one gradient element to `value` after the backward of chosen optimizer steps, and
/// records the parameters after every step.
class Inject : public tk::Plugin {
 public:
  Inject(std::map<int64_t, double> at_steps, int64_t micro_index = -1)
      : at_(std::move(at_steps)), micro_(micro_index) {}
  void on_step_end(tk::StepEndContext& ctx) override { after_step.push_back(tkt::flat_params(ctx.model())); }
  void on_backward(tk::BackwardContext& ctx) override {
    auto it = at_.find(ctx.counters().step);
    const bool here = micro_ < 0 ? ctx.window().is_last() : ctx.window().index == micro_;
    if (it == at_.end() || !here) return;
    torch::NoGradGuard no_grad;
    ctx.model().parameters()[0].mutable_grad().view({-1})[0].fill_(it->second);
  }
  std::vector<Tensor> after_step;

 private:
  std::map<int64_t, double> at_;
  int64_t micro_;
};

const char* kRecipe = R"(
[run]
seed = 4
steps = 6
dtype = "float32"

[model]
name = "mlp"
hidden = [16]

[data]
name = "synthetic-classification"
samples = 512
validation_samples = 0
features = 8
classes = 4

[batch]
micro_batch = 8

[optimizer]
name = "sgd"
lr = 0.05
momentum = 0.9
)";

struct Result {
  Tensor params;
  tk::FitResult fit;
  fs::path dir;
  std::vector<std::string> order, warnings;
};

/// Trains kRecipe + plugins text + overrides; in-process plugins are added after the recipe's.
Result run(const std::string& plugins, const std::vector<std::string>& sets = {},
           std::vector<tk::testing::InProcess> extra = {}, const std::string& tag = "run") {
  std::string text = std::string(kRecipe) + plugins;
  Result r;
  r.dir = tkt::temp_dir(tag);
  auto sets_all = sets;
  sets_all.push_back("run.output=\"" + r.dir.string() + "\"");
  auto recipe = tkt::recipe(sets_all, text.c_str());
  auto opts = tkt::quiet();
  opts.write_outputs = true;
  tk::Trainer t(recipe, opts);
  for (auto& p : extra) t.add_plugin(p.plugin, p.name, p.options, p.hooks);
  r.order = t.plugin_order();
  r.fit = t.fit();
  r.params = tkt::flat_params(t.model());
  r.warnings = t.warnings();
  return r;
}

const std::string kAccum4 = "[[plugins]]\nname = \"grad_accum\"\nsteps = 4\n";
const std::string kClip = "[[plugins]]\nname = \"clip\"\nmax_norm = 0.5\n";
std::string scaler(const std::string& dtype, const std::string& extra = "") {
  return "[[plugins]]\nname = \"mixed_precision\"\ndtype = \"" + dtype +
         "\"\nloss_scale = \"dynamic\"\ninit_scale = 1024.0\ngrowth_interval = 3\n" + extra;
}

/// Why an fp16 case cannot run here.
const char* const kNoHalf = "this LibTorch has no Half kernels on the CPU (they came with LibTorch 2.x)";

bool fp16_available() {
  try {
    auto a = torch::ones({2, 2}, torch::kHalf);
    torch::mm(a, a);
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace

TEST_SUITE("profiler") {
  TEST_CASE("profiler: a Trace Event Format trace of the chosen steps, its ranges nested, operators under them") {
    const Result plain = run(kAccum4, {}, {}, "plain");
    const Result traced = run("[[plugins]]\nname = \"profiler\"\nsteps = [2, 3]\n" + kAccum4, {}, {}, "traced");
    CHECK(torch::equal(traced.params, plain.params));  // tracing changes nothing of the run
    std::ifstream in(traced.dir / "trace.json");
    REQUIRE(in.good());
    const auto trace = nlohmann::json::parse(in);
    REQUIRE(trace.contains("traceEvents"));
    struct Range {
      std::string name, cat;
      double from, to;
      int tid;
    };
    std::vector<Range> ranges;
    for (const auto& e : trace["traceEvents"]) {
      REQUIRE(e.contains("ph"));
      if (e["ph"] == "M") continue;  // metadata: the thread's name
      REQUIRE(e["ph"] == "X");
      for (const char* k : {"name", "cat", "ts", "dur", "pid", "tid"}) REQUIRE(e.contains(k));
      ranges.push_back({e["name"], e["cat"], e["ts"].get<double>(), e["ts"].get<double>() + e["dur"].get<double>(),
                        e["tid"].get<int>()});
    }
    auto named = [&](const std::string& n) {
      return std::count_if(ranges.begin(), ranges.end(), [&](const Range& r) { return r.name == n; });
    };
    CHECK(named("step 2") == 1);
    CHECK(named("step 3") == 1);
    CHECK(named("step 1") == 0);  // not chosen
    CHECK(named("forward") == 8);  // 4 micro-batches in each of the 2 steps
    CHECK(named("backward") == 8);
    CHECK(named("data") == 8);
    CHECK(named("boundary and optimizer step") == 2);
    // A traced step lasts as long as its micro-batches: its range holds time.
    for (const auto& r : ranges)
      if (r.cat == "step") CHECK(r.to - r.from > 0.0);
    // On one thread, ranges nest: two are disjoint or one holds the other (to the microsecond
    // rounding of the stamps).
    constexpr double eps = 1.0;
    for (const auto& a : ranges)
      for (const auto& b : ranges) {
        if (&a == &b || a.tid != b.tid) continue;
        const bool disjoint = a.to <= b.from + eps || b.to <= a.from + eps;
        const bool nested = (a.from >= b.from - eps && a.to <= b.to + eps) || (b.from >= a.from - eps && b.to <= a.to + eps);
        if (!(disjoint || nested)) FAIL_CHECK(a.name << " [" << a.from << ", " << a.to << "] overlaps " << b.name << " [" << b.from << ", " << b.to << "]");
      }
    // Every phase sits inside its step, and LibTorch's operators inside the traced steps, some
    // of them (the linear layers' products) inside a forward.
    auto inside = [&](const Range& r, const std::string& outer_prefix) {
      return std::any_of(ranges.begin(), ranges.end(), [&](const Range& o) {
        return o.name.rfind(outer_prefix, 0) == 0 && r.from >= o.from - eps && r.to <= o.to + eps;
      });
    };
    int ops = 0, ops_in_forward = 0;
    for (const auto& r : ranges) {
      if (r.cat == "phase" || r.cat == "micro-batch") CHECK(inside(r, "step "));
      if (r.cat != "operator") continue;
      ++ops;
      CHECK(inside(r, "step "));
      if (r.name.find("mm") != std::string::npos && inside(r, "forward")) ++ops_in_forward;
    }
    CHECK(ops > 0);
    CHECK(ops_in_forward > 0);
    // Without operators: the phases only.
    const Result phases = run("[[plugins]]\nname = \"profiler\"\nsteps = [1]\noperators = false\n", {}, {}, "phases");
    std::ifstream in2(phases.dir / "trace.json");
    const auto t2 = nlohmann::json::parse(in2);
    for (const auto& e : t2["traceEvents"]) CHECK(e.value("cat", "") != "operator");
    CHECK_THROWS_WITH(run("[[plugins]]\nname = \"profiler\"\nsteps = [0]\n"), doctest::Contains("steps count from 1"));
    // Steps the run never takes are said, not silently left out.
    const Result beyond = run("[[plugins]]\nname = \"profiler\"\nsteps = [1, 99, 100]\noperators = false\n", {}, {},
                              "beyond");
    REQUIRE(beyond.warnings.size() == 1);
    CHECK(beyond.warnings[0].find("profiler: steps 99, 100 are beyond the run's " +
                                  std::to_string(beyond.fit.steps) + " steps: not traced (test.toml:") == 0);
    for (const auto& d : {plain.dir, traced.dir, phases.dir, beyond.dir}) fs::remove_all(d);
  }
}

TEST_SUITE("profiler") {
  TEST_CASE("profiler: a trace.json in the output folder that trainkit did not write is never written over") {
    const fs::path dir = tkt::temp_dir("foreign-trace");
    fs::create_directories(dir);
    const std::string mine = "{\"mine\": 1}";
    std::ofstream(dir / "trace.json") << mine;
    auto recipe = tkt::recipe({"run.output=\"" + dir.string() + "\""},
                              (std::string(kRecipe) + "[[plugins]]\nname = \"profiler\"\nsteps = [1]\n").c_str());
    auto opts = tkt::quiet();
    opts.write_outputs = true;
    tk::Trainer t(recipe, opts);
    CHECK_THROWS_WITH(t.fit(), doctest::Contains("trace.json' is a file trainkit did not write"));
    std::ifstream in(dir / "trace.json");
    CHECK(std::string(std::istreambuf_iterator<char>(in), {}) == mine);
    CHECK(fs::exists(dir / "weights.safetensors"));  // what the run wrote before is kept
    fs::remove_all(dir);
  }
}

TEST_SUITE("clip") {
  TEST_CASE("clip by norm and by value match PyTorch's clip_grad_norm_ / clip_grad_value_") {
    auto golden_list = tk::load_tensor_dict(fs::path(TK_SOURCE_DIR) / "tests/golden/clip_golden.pt");
    std::map<std::string, Tensor> golden(golden_list.begin(), golden_list.end());
    for (std::string name : {"l2_clipped", "l2_untouched", "l1_clipped", "p3_clipped", "inf_clipped", "value"}) {
      CAPTURE(name);
      std::vector<Tensor> in, expect;
      for (int i = 0; golden.count(name + ".in." + std::to_string(i)); ++i) {
        in.push_back(golden.at(name + ".in." + std::to_string(i)));
        expect.push_back(golden.at(name + ".out." + std::to_string(i)));
      }
      REQUIRE(in.size() == 3);
      auto bag = std::make_shared<ParamBag>(in);
      auto params = bag->parameters();
      for (size_t i = 0; i < in.size(); ++i) params[i].mutable_grad() = in[i].clone();
      torch::optim::SGD opt(params, torch::optim::SGDOptions(0.1));
      tk::testing::ManualContext ctx(*bag, opt);
      std::string options;
      if (name == "value") {
        options = "max_value = " + tk::to_toml(golden.at("value.max_value").item<double>());
      } else {
        const double nt = golden.at(name + ".norm_type").item<double>();
        options = "max_norm = " + tk::to_toml(golden.at(name + ".max_norm").item<double>()) +
                  "\nnorm_type = " + (std::isinf(nt) ? std::string("inf") : tk::to_toml(nt));
      }
      auto clip = load_plugin("clip", options);
      ctx.call(*clip, tk::Event::Boundary);
      for (size_t i = 0; i < in.size(); ++i)
        CHECK(tkt::excess(params[i].grad(), expect[i], tkt::tol_for(expect[i].scalar_type())) <= 1.0);
      if (name != "value") {
        CHECK(ctx.metric_value("grad_norm") ==
              doctest::Approx(golden.at(name + ".total_norm").item<double>()).epsilon(1e-12));
        if (name == "l2_untouched")
          for (size_t i = 0; i < in.size(); ++i) CHECK(torch::equal(params[i].grad(), in[i]));
      }
    }
  }

  TEST_CASE("options are checked") {
    std::string text = std::string(kRecipe) + "[[plugins]]\nname = \"clip\"\nmax_norm = 1.0\nmax_value = 0.5\n";
    auto r = tkt::recipe({}, text.c_str());
    CHECK_THROWS_WITH(tk::Trainer(r, tkt::quiet()), doctest::Contains("plugins.clip.max_value: give max_norm or max_value, not both"));
    text = std::string(kRecipe) + "[[plugins]]\nname = \"clip\"\nnorm_type = -1.0\n";
    auto r2 = tkt::recipe({}, text.c_str());
    CHECK_THROWS_WITH(tk::Trainer(r2, tkt::quiet()), doctest::Contains("test.toml:27:13: plugins.clip.norm_type: must be > 0"));
  }

  TEST_CASE("with accumulation it clips once per step, on the whole window's gradient") {
    auto accum = run(kAccum4 + kClip, {"run.trace=true"}, {}, "clip-accum");
    auto big = run(kClip, {"batch.micro_batch=32"}, {}, "clip-big");
    CHECK(tkt::excess(accum.params, big.params, tkt::tol_for(torch::kFloat)) <= 1.0);
    auto na = tkt::metric(accum.dir / "metrics.jsonl", "grad_norm"), nb = tkt::metric(big.dir / "metrics.jsonl", "grad_norm");
    REQUIRE(na.size() == 6);
    REQUIRE(nb.size() == 6);
    for (size_t i = 0; i < na.size(); ++i) CHECK(na[i] == doctest::Approx(nb[i]).epsilon(1e-5));
    CHECK(na[0] > 0.5);  // the clip really acted
    fs::remove_all(accum.dir);
    fs::remove_all(big.dir);
  }
}

TEST_SUITE("mixed precision") {
  TEST_CASE("the loss scaler follows GradScaler's rule: skip and back off on overflow, grow after clean runs") {
    // init 1024, growth_interval 3; inf at step 1, nan at step 2, inf at step 6 (0-based).
    auto inject = std::make_shared<Inject>(std::map<int64_t, double>{{1, INFINITY}, {2, NAN}, {6, INFINITY}});
    auto r = run(kAccum4 + scaler("bf16"), {"run.steps=11"}, {{inject, "inject"}}, "scaler");
    // Written from the rule, step by step: the scale used at each step, and which steps are skipped.
    const std::vector<double> scale = {1024, 1024, 512, 256, 256, 256, 512, 256, 256, 256, 512};
    const std::vector<bool> skip = {false, true, true, false, false, false, true, false, false, false, false};
    CHECK(tkt::metric(r.dir / "metrics.jsonl", "loss_scale") == scale);
    CHECK(tkt::skipped(r.dir / "metrics.jsonl") == skip);
    CHECK(r.fit.skipped_steps == 3);
    CHECK(r.fit.steps == 11);
    CHECK(tkt::metric(r.dir / "metrics.jsonl", "amp_skipped_steps").back() == 3);
    fs::remove_all(r.dir);
  }

  TEST_CASE("a skipped step leaves the parameters and, by default, the LR schedule where they were") {
    const std::vector<std::string> warm = {"schedule.name=warmup_cosine", "schedule.warmup_steps=5", "run.steps=4"};
    auto inject = std::make_shared<Inject>(std::map<int64_t, double>{{1, INFINITY}});
    auto r = run(scaler("bf16"), warm, {{inject, "inject"}}, "hold");
    auto lr = tkt::metric(r.dir / "metrics.jsonl", "lr");
    CHECK(lr == std::vector<double>{0.01, 0.02, 0.02, 0.03});
    auto inject2 = std::make_shared<Inject>(std::map<int64_t, double>{{1, INFINITY}});
    auto r2 = run(scaler("bf16", "advance_schedule_on_skip = true\n"), warm, {{inject2, "inject"}}, "advance");
    CHECK(tkt::metric(r2.dir / "metrics.jsonl", "lr") == std::vector<double>{0.01, 0.02, 0.03, 0.04});
    CHECK(r.fit.skipped_steps == 1);
    REQUIRE(inject->after_step.size() == 4);
    CHECK(torch::equal(inject->after_step[1], inject->after_step[0]));  // the skipped step
    CHECK_FALSE(torch::equal(inject->after_step[2], inject->after_step[1]));
    fs::remove_all(r.dir);
    fs::remove_all(r2.dir);
  }

  TEST_CASE("check_every_micro_batch finds the overflow at its micro-batch; the decisions are the same") {
    auto early = std::make_shared<Inject>(std::map<int64_t, double>{{2, INFINITY}}, 0);
    auto a = run(kAccum4 + scaler("bf16", "check_every_micro_batch = true\n"), {}, {{early, "inject"}}, "each");
    auto late = std::make_shared<Inject>(std::map<int64_t, double>{{2, INFINITY}}, 0);
    auto b = run(kAccum4 + scaler("bf16"), {}, {{late, "inject"}}, "boundary");
    CHECK(tkt::skipped(a.dir / "metrics.jsonl") == tkt::skipped(b.dir / "metrics.jsonl"));
    CHECK(tkt::metric(a.dir / "metrics.jsonl", "loss_scale") == tkt::metric(b.dir / "metrics.jsonl", "loss_scale"));
    CHECK(torch::equal(a.params, b.params));
    CHECK(a.fit.skipped_steps == 1);
    fs::remove_all(a.dir);
    fs::remove_all(b.dir);
  }

  TEST_CASE("autocast over parameters that are not float32 is refused as the run is planned: a dry run too") {
    const std::string text = std::string(tkt::kTinyRecipe) + "[[plugins]]\nname = \"mixed_precision\"\ndtype = \"bf16\"\n";
    tk::Trainer t(tkt::recipe({"run.dtype=\"float64\""}, text.c_str()), tkt::quiet());
    CHECK_THROWS_WITH(t.describe(), doctest::Contains("plugins.mixed_precision.dtype: autocast needs float32 parameters, "
                                                      "and the model's are float64: set run.dtype = \"float32\""));
  }

  TEST_CASE("bf16 says so when a loss scaler is configured for it") {
    const fs::path cpuinfo = tkt::temp_dir("cpuinfo-bf16");
    std::ofstream(cpuinfo) << "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n";
    tkt::EnvGuard env("TK_CPUINFO", cpuinfo.string());  // a CPU with native bf16: no note about it
    // Said as the run is planned: by a dry run too.
    const std::string text = std::string(kRecipe) + "[[plugins]]\nname = \"mixed_precision\"\ndtype = \"bf16\"\n"
                                                    "init_scale = 128.0\n";
    tk::Trainer planned(tkt::recipe({"run.steps=1"}, text.c_str()), tkt::quiet());
    planned.describe();
    REQUIRE(planned.warnings().size() == 1);
    CHECK(planned.warnings()[0].find("mixed_precision: dtype = \"bf16\" needs no loss scaler; ignoring init_scale") == 0);
    auto r = run("[[plugins]]\nname = \"mixed_precision\"\ndtype = \"bf16\"\ninit_scale = 128.0\n", {"run.steps=1"}, {},
                 "bf16-note");
    REQUIRE(r.warnings.size() == 1);
    CHECK(r.warnings[0].find("mixed_precision: dtype = \"bf16\" needs no loss scaler; ignoring init_scale (test.toml:") ==
          0);
    fs::remove_all(r.dir);
    fs::remove(cpuinfo);
  }

  TEST_CASE("bf16 on a CPU without native bf16 instructions warns, naming what it looked for; with them it does not") {
    const fs::path cpuinfo = tkt::temp_dir("cpuinfo");
    const std::string bf16 = "[[plugins]]\nname = \"mixed_precision\"\ndtype = \"bf16\"\n";
    std::ofstream(cpuinfo) << "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\nprocessor\t: 1\nflags\t\t: fpu sse2 avx2 fma\n";
    {
      tkt::EnvGuard env("TK_CPUINFO", cpuinfo.string());
      auto r = run(bf16, {"run.steps=1", "run.device=\"cpu\""}, {}, "bf16-avx2");
      REQUIRE(r.warnings.size() == 1);
      CHECK(r.warnings[0].find("mixed_precision: this CPU has no native bf16 instructions (no AVX512-BF16 or AMX-BF16 in " +
                               cpuinfo.string() + ")") == 0);
      fs::remove_all(r.dir);
    }
    std::ofstream(cpuinfo) << "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n";
    tkt::EnvGuard env("TK_CPUINFO", cpuinfo.string());
    auto r = run(bf16, {"run.steps=1", "run.device=\"cpu\""}, {}, "bf16-amx");
    CHECK(r.warnings.empty());  // it says "native bf16 instructions (AVX512-BF16 and AMX-BF16)" in the log
    fs::remove_all(r.dir);
    fs::remove(cpuinfo);
  }

  /// The quickstart recipe under `dt` autocast trains, and ends within 5% of float32's validation loss.
  void quickstart_close_to_fp32(const std::string& dt) {
    std::ifstream in(fs::path(TK_SOURCE_DIR) / "recipes/quickstart.toml");
    const std::string quickstart((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    auto train = [&](const std::string& extra) {
      auto r = tk::Recipe::from_string(quickstart + extra, "quickstart.toml");
      r.apply_override("run.epochs=2");
      tk::Trainer t(r, tkt::quiet());
      return t.fit();
    };
    const double fp32 = train("").validation_losses.back();
    auto res = train("[[plugins]]\nname = \"mixed_precision\"\ndtype = \"" + dt + "\"\n");
    CHECK(res.window_losses.back() < 0.5 * res.window_losses.front());
    CHECK(std::abs(res.validation_losses.back() - fp32) < 0.05 * fp32);
  }

  TEST_CASE("bf16 runs of the quickstart recipe train and stay close to fp32") { quickstart_close_to_fp32("bf16"); }

  TEST_CASE("fp16 runs of the quickstart recipe train and stay close to fp32 (may skip)") {
    TK_SKIP_IF(!fp16_available(), kNoHalf);
    quickstart_close_to_fp32("fp16");
  }
}

TEST_SUITE("composition") {
  TEST_CASE("every listing order of accumulation, mixed precision and clipping gives bit-identical parameters") {
    std::vector<std::string> parts = {"[[plugins]]\nname = \"grad_accum\"\nsteps = 2\n", scaler("bf16"), kClip};
    std::vector<size_t> perm = {0, 1, 2};
    Tensor first;
    std::vector<std::string> first_order;
    int n = 0;
    do {
      std::string plugins;
      for (size_t i : perm) plugins += parts[i];
      auto inject = std::make_shared<Inject>(std::map<int64_t, double>{{3, INFINITY}});
      auto r = run(plugins, {}, {{inject, "inject"}}, "perm" + std::to_string(n));
      CHECK(r.fit.skipped_steps == 1);
      if (n == 0) {
        first = r.params;
        first_order = r.order;
        CHECK(first_order == std::vector<std::string>{"grad_accum", "mixed_precision", "clip", "inject"});
      } else {
        CHECK(torch::equal(r.params, first));
        CHECK(r.order == first_order);
      }
      fs::remove_all(r.dir);
      ++n;
    } while (std::next_permutation(perm.begin(), perm.end()));
    CHECK(n == 6);
  }

  /// k = 4 with the loss scaler (in `dt`) and clipping against the big batch with them.
  void accumulated_scaler_equals_big_batch(const std::string& dt) {
    // A tolerance for the lower precision: one bf16 ulp is 2^-8, one fp16 ulp 2^-11.
    const double tol = dt == "bf16" ? 2e-2 : 3e-3;
    auto ia = std::make_shared<Inject>(std::map<int64_t, double>{{2, INFINITY}});
    auto ib = std::make_shared<Inject>(std::map<int64_t, double>{{2, INFINITY}});
    auto a = run(kAccum4 + scaler(dt) + kClip, {"run.steps=8"}, {{ia, "inject"}}, "mix-accum-" + dt);
    auto b = run(scaler(dt) + kClip, {"run.steps=8", "batch.micro_batch=32"}, {{ib, "inject"}}, "mix-big-" + dt);
    CHECK(tkt::skipped(a.dir / "metrics.jsonl") == tkt::skipped(b.dir / "metrics.jsonl"));
    CHECK(tkt::metric(a.dir / "metrics.jsonl", "loss_scale") == tkt::metric(b.dir / "metrics.jsonl", "loss_scale"));
    auto na = tkt::metric(a.dir / "metrics.jsonl", "grad_norm"), nb = tkt::metric(b.dir / "metrics.jsonl", "grad_norm");
    REQUIRE(na.size() == nb.size());
    for (size_t i = 0; i < na.size(); ++i) {
      if (std::isnan(nb[i])) {
        CHECK(std::isnan(na[i]));  // the overflowing step: no finite norm in either
        continue;
      }
      CHECK(na[i] == doctest::Approx(nb[i]).epsilon(tol));
    }
    CHECK(tkt::excess(a.params, b.params, tkt::tol_for(dt == "bf16" ? torch::kBFloat16 : torch::kHalf)) <= 1.0);
    fs::remove_all(a.dir);
    fs::remove_all(b.dir);
  }

  TEST_CASE("k = 4 with the loss scaler and clipping equals the big batch with them: same scales, skips and norms (bf16)") {
    accumulated_scaler_equals_big_batch("bf16");
  }

  TEST_CASE("k = 4 with the loss scaler and clipping equals the big batch with them (fp16) (may skip)") {
    TK_SKIP_IF(!fp16_available(), kNoHalf);
    accumulated_scaler_equals_big_batch("fp16");
  }

  /// One host read per step with accumulation, the loss scaler (in `dt`) and clipping.
  void one_read_per_step(const std::string& dt) {
    for (int k : {2, 8})
      for (const std::string hidden : {"[16]", "[64, 64, 64, 64, 64]"}) {
        CAPTURE(dt);
        CAPTURE(k);
        CAPTURE(hidden);
        // An overflow at step 2 too: the skipped step is decided from the same single read.
        auto inject = std::make_shared<Inject>(std::map<int64_t, double>{{2, INFINITY}});
        auto r = run("[[plugins]]\nname = \"grad_accum\"\nsteps = " + std::to_string(k) + "\n" + scaler(dt) + kClip,
                     {"run.steps=5", "model.hidden=" + hidden}, {{inject, "inject"}}, "reads");
        CHECK(tkt::metric(r.dir / "metrics.jsonl", "host_reads") == std::vector<double>(5, 1.0));
        CHECK(tkt::skipped(r.dir / "metrics.jsonl") == std::vector<bool>{false, false, true, false, false});
        fs::remove_all(r.dir);
      }
  }

  TEST_CASE("one host read per optimizer step with accumulation, the loss scaler and clipping, in fp16 (may skip)") {
    TK_SKIP_IF(!fp16_available(), kNoHalf);
    one_read_per_step("fp16");
  }

  TEST_CASE("one host read per optimizer step with accumulation, the loss scaler and clipping, whatever k and the model's size") {
    one_read_per_step("bf16");  // with loss_scale = "dynamic": the scaler's overflow check runs
    // A plugin that asks for a micro-batch's loss on the host pays a read per micro-batch, counted.
    struct Reader : tk::Plugin {
      void on_loss(tk::LossContext& ctx) override { ctx.loss_value(); }
    };
    auto r = run("[[plugins]]\nname = \"grad_accum\"\nsteps = 4\n", {"run.steps=2"}, {{std::make_shared<Reader>(), "reader"}},
                 "reads-loss");
    CHECK(tkt::metric(r.dir / "metrics.jsonl", "host_reads") == std::vector<double>(2, 5.0));
    fs::remove_all(r.dir);
  }

  TEST_CASE("a combination that cannot be correct is refused at load, naming both plugins") {
    auto text = std::string(kRecipe) + kClip + "[[plugins]]\nname = \"fake_clip\"\n";
    auto r = tkt::recipe({}, text.c_str());
    tk::Trainer t(r, tkt::quiet());
    CHECK_THROWS_WITH(t.describe(), "plugins 'clip' and 'fake_clip' both provide 'grads.clipped'; a run can have only "
                                    "one of them");
  }

  TEST_CASE("fp16 where this LibTorch cannot run it is refused before training, with the way out (may skip)") {
    TK_SKIP_IF(fp16_available(), "this LibTorch has Half kernels on the CPU: fp16 runs here");
    auto text = std::string(kRecipe) + "[[plugins]]\nname = \"mixed_precision\"\ndtype = \"fp16\"\n";
    auto r = tkt::recipe({}, text.c_str());
    tk::Trainer t(r, tkt::quiet());
    CHECK_THROWS_WITH(t.describe(), doctest::Contains("test.toml:27:9: plugins.mixed_precision.dtype: fp16 needs Half "
                                                      "kernels on cpu"));
  }
}
