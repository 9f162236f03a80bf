// Extending trainkit from outside: libraries that add a model and a data set, name clashes,
// plugins that change the model in setup, hooks and their dispatch, how a run ended, capability
// names, and relative paths.
#include <tk/abi.h>
#include <tk/compat.h>
#include <tk/components.h>

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>

#include "support.h"

namespace fs = std::filesystem;

namespace {

const fs::path kFixtures = TK_TEST_PLUGIN_DIR;

const char* kToyRecipe = R"(
[run]
seed = 11
steps = 150
dtype = "float64"

[model]
name = "toy_net"
hidden = 12

[data]
name = "toy_sine"
samples = 200

[batch]
micro_batch = 16

[optimizer]
name = "adam"
lr = 0.02
)";

std::string with_library(const char* recipe, const fs::path& lib) {
  return std::string(recipe) + "\n[[plugins]]\npath = \"" + lib.string() + "\"\n";
}

/// Records how the run ended and which hooks ran; overrides three hooks and no others.
class StatusProbe : public tk::Plugin {
 public:
  void on_fit_start(tk::FitStartContext& ctx) override { ++fit_starts; }
  void on_boundary(tk::BoundaryContext& ctx) override { ++boundaries; }
  void on_fit_end(tk::FitEndContext& ctx) override { end_status = ctx.status(); }
  tk::FitStatus end_status = tk::FitStatus::Running;
  int fit_starts = 0, boundaries = 0;
};

/// Declares an ordering on a capability name; `requires_` too when asked.
class Orders : public tk::Plugin {
 public:
  Orders(tk::Capability after, bool require) {
    contract_.after = {std::move(after)};
    if (require) contract_.requires_ = contract_.after;
  }
  tk::Contract contract() const override { return contract_; }

 private:
  tk::Contract contract_;
};

/// Makes the run's optimizer through SetupContext::wrap_optimizer, passing the parameters on to
/// the optimizer it wraps (less the last one when `drop_last`), or failing when `fail`; logs each
/// call as "tag:count".
class WrapsOptimizer : public tk::Plugin {
 public:
  WrapsOptimizer(std::vector<std::string>* log, std::string tag, bool drop_last = false, bool fail = false)
      : log_(log), tag_(std::move(tag)), drop_last_(drop_last), fail_(fail) {}
  void setup(tk::SetupContext& setup) override {
    setup.wrap_optimizer([this](std::vector<at::Tensor> trainable,
                                const tk::OptimizerFactory& inner) -> std::unique_ptr<torch::optim::Optimizer> {
      log_->push_back(tag_ + ":" + std::to_string(trainable.size()));
      if (fail_) throw std::runtime_error("no optimizer today");
      if (drop_last_) trainable.pop_back();
      return inner(std::move(trainable));
    });
  }

 private:
  std::vector<std::string>* log_;
  std::string tag_;
  bool drop_last_, fail_;
};

/// Opens a region in each event that starts one and closes it in its closing event, logging
/// "open tag event" and "close tag event".
class Region : public tk::Plugin {
 public:
  Region(std::vector<std::string>* log, std::string tag) : log_(log), tag_(std::move(tag)) {}
  void on_fit_start(tk::FitStartContext&) override { open("fit"); }
  void on_epoch_start(tk::EpochStartContext&) override { open("epoch"); }
  void on_micro_batch(tk::MicroBatchContext&) override { open("forward"); }
  void on_loss(tk::LossContext&) override { close("forward"); }
  void on_boundary(tk::BoundaryContext&) override { open("step"); }
  void on_step_end(tk::StepEndContext&) override { close("step"); }
  void on_epoch_end(tk::EpochEndContext&) override { close("epoch"); }
  void on_validation_start(tk::ValidationStartContext&) override { open("validation"); }
  void on_validation_end(tk::ValidationEndContext&) override { close("validation"); }
  void on_fit_end(tk::FitEndContext&) override { close("fit"); }

 private:
  void open(const std::string& what) { log_->push_back("open " + tag_ + " " + what); }
  void close(const std::string& what) { log_->push_back("close " + tag_ + " " + what); }
  std::vector<std::string>* log_;
  std::string tag_;
};

}  // namespace

TEST_SUITE("extension") {
  TEST_CASE("a library adds a C++ model and a data set, which a recipe trains like built-in ones") {
    // Without the library, neither name exists.
    CHECK_THROWS_WITH_AS(tk::Trainer(tkt::recipe({}, kToyRecipe), tkt::quiet()),
                         doctest::Contains("unknown data 'toy_sine'; known: synthetic-classification"),
                         tk::RecipeError);
    const fs::path lib = kFixtures / "tk_toy_components.so";
    tk::Trainer t(tkt::recipe({}, with_library(kToyRecipe, lib).c_str()), tkt::quiet());
    const auto* model = tk::find_component(t.registry().models(), "toy_net");
    REQUIRE(model != nullptr);
    CHECK(model->library == fs::weakly_canonical(lib).string());
    CHECK(tk::find_component(t.registry().models(), "mlp")->library.find("tk_models.so") != std::string::npos);
    CHECK(t.plugin_order().empty());  // a library of components adds nothing to dispatch
    auto r = t.fit();
    REQUIRE(r.window_losses.size() == 150);
    CHECK(r.validation_losses.back() < 0.2 * r.window_losses.front());
    CHECK(t.model().named_parameters().contains("first.weight"));
  }

  TEST_CASE("a library named in [[plugins]] is found on the plugin path like a strategy") {
    std::string text = std::string(kToyRecipe) + "\n[[plugins]]\nname = \"toy_components\"\n";
    tk::Trainer t(tkt::recipe({}, text.c_str()), tkt::quiet());
    CHECK(t.describe().find("libraries     toy_components 1.0.0") != std::string::npos);
  }

  TEST_CASE("two libraries that register one name are refused, naming both files") {
    std::string text = with_library(with_library(tkt::kTinyRecipe, kFixtures / "tk_twin_a.so").c_str(),
                                    kFixtures / "tk_twin_b.so");
    try {
      tk::Trainer t(tkt::recipe({}, text.c_str()), tkt::quiet());
      FAIL("two libraries registered model 'twin'");
    } catch (const tk::PluginLoadError& e) {
      const std::string m = e.what();
      CHECK(m.find("model 'twin' is registered twice: by " + fs::weakly_canonical(kFixtures / "tk_twin_a.so").string() +
                   " and by " + fs::weakly_canonical(kFixtures / "tk_twin_b.so").string()) != std::string::npos);
      CHECK(m.find("test.toml:") == 0);  // the [[plugins]] entry that brought in the second one
    }
  }

  TEST_CASE("an event that closes a region goes to the plugins in reverse order: regions nest, inner first") {
    std::vector<std::string> log;
    tk::Trainer t(tkt::recipe({"run.steps=0", "run.epochs=1", "data.validation_samples=8", "run.validate_every=2"}),
                  tkt::quiet());
    t.add_plugin(std::make_shared<Region>(&log, "outer"), "outer");
    t.add_plugin(std::make_shared<Region>(&log, "inner"), "inner");
    t.fit();
    REQUIRE(t.plugin_order() == std::vector<std::string>{"outer", "inner"});
    // Every region opened by outer then inner is closed by inner then outer.
    std::vector<std::string> open;
    size_t closes = 0;
    for (const auto& line : log) {
      const std::string what = line.substr(line.rfind(' ') + 1);
      if (line.rfind("open ", 0) == 0) {
        open.push_back(line.substr(5));
        continue;
      }
      INFO(line);
      REQUIRE_FALSE(open.empty());
      CHECK(open.back() == line.substr(6));  // the innermost open region is the one closed
      open.pop_back();
      ++closes;
    }
    CHECK(open.empty());
    CHECK(closes >= 10);  // fit, epoch, forward, step and validation, for both plugins
    CHECK(std::find(log.begin(), log.end(), "close inner validation") < std::find(log.begin(), log.end(), "close outer validation"));
  }

  TEST_CASE("a section that names no component gets the default a library declared; one default per kind") {
    tk::Registry reg;
    CHECK(reg.default_of(tk::Kind::Schedule).empty());
    reg.set_default(tk::Kind::Schedule, "halving").set_default(tk::Kind::Schedule, "halving");  // the same again
    CHECK(reg.default_of(tk::Kind::Schedule) == "halving");
    CHECK_THROWS_WITH_AS(reg.set_default(tk::Kind::Schedule, "steady"),
                         "the default schedule is set twice: to 'halving' by (in-process) and to 'steady' by "
                         "(in-process); remove one of the libraries from the run",
                         tk::PluginLoadError);
    // A default no library registers is named, with what a recipe may name instead.
    const tk::Recipe recipe = tk::Recipe::from_string("[run]\nseed = 1\n", "r.toml");
    CHECK_THROWS_WITH_AS(recipe.component("schedule", "halving", {"constant", "warmup_cosine"}),
                         "r.toml: [schedule] names no schedule, and its default 'halving' is registered by no library "
                         "loaded; name one of: constant, warmup_cosine",
                         tk::RecipeError);
    CHECK(recipe.component("schedule", "constant", {"constant", "warmup_cosine"}) == "constant");
    // trainkit's optim library declares "constant": a recipe without [schedule] trains with it.
    tk::Trainer t(tkt::recipe(), tkt::quiet());
    CHECK(t.registry().default_of(tk::Kind::Schedule) == "constant");
    CHECK(t.resolved_recipe().find("[schedule]\nname = \"constant\"\n") != std::string::npos);
  }

  TEST_CASE("setup may freeze parameters: they stay bit-identical and the optimizer never holds them") {
    auto fresh = tk::Trainer(tkt::recipe(), tkt::quiet());
    const auto initial = fresh.model().named_parameters();
    std::string text = std::string(tkt::kTinyRecipe) + "\n[[plugins]]\npath = \"" +
                       (kFixtures / "tk_freeze.so").string() + "\"\nprefix = \"layers.0.\"\n";
    tk::Trainer t(tkt::recipe({}, text.c_str()), tkt::quiet());
    t.fit();
    const auto params = t.model().named_parameters();
    CHECK(torch::equal(params["layers.0.weight"], initial["layers.0.weight"]));
    CHECK(torch::equal(params["layers.0.bias"], initial["layers.0.bias"]));
    CHECK_FALSE(torch::equal(params["head.weight"], initial["head.weight"]));
    size_t held = 0;
    for (const auto& g : t.optimizer().param_groups())
      for (const auto& p : g.params()) {
        ++held;
        CHECK(p.requires_grad());
      }
    CHECK(held == 2);  // head.weight and head.bias
    const auto& state = t.optimizer().state();
    CHECK_FALSE(state.count(tk::compat::optimizer_state_key(state, params["layers.0.weight"])));
    CHECK_FALSE(state.count(tk::compat::optimizer_state_key(state, params["layers.0.bias"])));
    CHECK(state.count(tk::compat::optimizer_state_key(state, params["head.weight"])));
    CHECK(t.optimizer().state().size() == 2);  // momentum buffers of the trained ones only
    CHECK(t.describe().find("parameters, 68 trainable") != std::string::npos);

    auto bad = tkt::recipe({"plugins.freeze.prefix=\"nothing.\""}, text.c_str());
    CHECK_THROWS_WITH(tk::Trainer(bad, tkt::quiet()).describe(),
                      doctest::Contains("plugins.freeze.prefix: matches no parameter of the model"));
  }

  TEST_CASE("setup may wrap the optimizer: wraps compose in dispatch order, and must cover every parameter") {
    tk::Trainer plain(tkt::recipe(), tkt::quiet());
    plain.fit();
    // 212 parameters of float64 (8-16-4), one momentum buffer each.
    CHECK(tk::optimizer_state_bytes(plain.optimizer()) == 212 * 8);
    std::vector<std::string> log;
    tk::Trainer t(tkt::recipe(), tkt::quiet());
    t.add_plugin(std::make_shared<WrapsOptimizer>(&log, "a"), "a");
    t.add_plugin(std::make_shared<WrapsOptimizer>(&log, "b"), "b");
    t.fit();
    // b's wrap is the outer one: its factory goes through a's.
    CHECK(log == std::vector<std::string>{"b:4", "a:4"});
    for (const auto& p : plain.model().named_parameters())
      CHECK(torch::equal(t.model().named_parameters()[p.key()], p.value()));

    // An optimizer that leaves a trainable parameter out is refused, naming the plugin and it.
    tk::Trainer dropped(tkt::recipe(), tkt::quiet());
    dropped.add_plugin(std::make_shared<WrapsOptimizer>(&log, "c", /*drop_last=*/true), "c");
    CHECK_THROWS_WITH(dropped.fit(), doctest::Contains("the optimizer made through the wrap_optimizer of plugin 'c' "
                                                       "does not list trainable parameter '"));
    tk::Trainer failed(tkt::recipe(), tkt::quiet());
    failed.add_plugin(std::make_shared<WrapsOptimizer>(&log, "d", false, /*fail=*/true), "d");
    CHECK_THROWS_WITH(failed.fit(), doctest::Contains("plugin 'd' could not make the optimizer: no optimizer today"));
  }

  TEST_CASE("setup may wrap the model: the wrapper's parameter trains, the start is unchanged") {
    tk::Trainer plain(tkt::recipe(), tkt::quiet());
    auto base = plain.fit();
    std::string text = with_library(tkt::kTinyRecipe, kFixtures / "tk_wrap_gain.so");
    tk::Trainer t(tkt::recipe({}, text.c_str()), tkt::quiet());
    auto r = t.fit();
    CHECK(r.window_losses.front() == base.window_losses.front());  // gain starts at 1
    const auto params = t.model().named_parameters();
    REQUIRE(params.contains("gain"));
    REQUIRE(params.contains("inner.head.weight"));
    CHECK(params["gain"].item<double>() != 1.0);
    size_t held = 0;
    for (const auto& g : t.optimizer().param_groups()) held += g.params().size();
    CHECK(held == 5);
  }

  TEST_CASE("hooks: only overridden ones are dispatched, and fit_end says how the run ended") {
    auto probe = std::make_shared<StatusProbe>();
    auto opts = tkt::quiet();
    tk::Trainer t(tkt::recipe({"run.trace=true"}), opts);
    t.add_plugin(probe, "status_probe");
    t.fit();
    CHECK(probe->fit_starts == 1);
    CHECK(probe->end_status == tk::FitStatus::Completed);
    CHECK(probe->boundaries == 6);
    CHECK(probe->handles(tk::Event::Boundary));
    CHECK_FALSE(probe->handles(tk::Event::MicroBatch));  // its class does not override on_micro_batch
    int micro = 0, boundary = 0;
    for (const auto& e : t.trace()) {
      micro += e.event == tk::Event::MicroBatch;
      boundary += e.event == tk::Event::Boundary;
    }
    CHECK(micro == 0);
    CHECK(boundary == 6);

    auto timed = std::make_shared<StatusProbe>();
    tk::Trainer t2(tkt::recipe({"run.max_time=\"0s\""}), tkt::quiet());
    t2.add_plugin(timed, "status_probe");
    CHECK(t2.fit().status == tk::FitStatus::StoppedByTime);
    CHECK(timed->end_status == tk::FitStatus::StoppedByTime);

    auto failed = std::make_shared<StatusProbe>();
    std::string text = std::string(tkt::kTinyRecipe) + "\n[[plugins]]\nname = \"probe\"\nthrow_at_step = 2\n";
    tk::Trainer t3(tkt::recipe({}, text.c_str()), tkt::quiet());
    t3.add_plugin(failed, "status_probe");
    CHECK_THROWS_AS(t3.fit(), tk::PluginRuntimeError);
    CHECK(failed->end_status == tk::FitStatus::Failed);
  }

  TEST_CASE("a capability name that nothing provides and nobody knows is reported") {
    tk::Trainer t(tkt::recipe(), tkt::quiet());
    t.add_plugin(std::make_shared<Orders>(tk::Capability{"grads.normalised"}, false), "orders");
    t.plan();
    REQUIRE(t.warnings().size() == 1);
    CHECK(t.warnings()[0] == "plugin 'orders' orders itself after 'grads.normalised', which no plugin of this run "
                             "provides (not a known capability name; did you mean 'grads.normalized'?): that "
                             "ordering has no effect");
    // A known name that this run happens not to provide is fine.
    tk::Trainer quiet_one(tkt::recipe(), tkt::quiet());
    quiet_one.add_plugin(std::make_shared<Orders>(tk::cap::kGradsSynced, false), "orders");
    quiet_one.plan();
    CHECK(quiet_one.warnings().empty());
    tk::Trainer strict(tkt::recipe(), tkt::quiet());
    strict.add_plugin(std::make_shared<Orders>(tk::Capability{"grads.cliped"}, true), "orders");
    CHECK_THROWS_WITH(strict.plan(), "plugins.orders: plugin 'orders' requires 'grads.cliped', which no plugin in this run provides "
                                     "(not a known capability name; did you mean 'grads.clipped'?)");
  }

  TEST_CASE("relative paths are resolved against the recipe's folder, or the working directory for --set") {
    const fs::path dir = tkt::temp_dir("paths");
    fs::create_directories(dir / "data");
    std::ofstream(dir / "data/corpus.txt") << std::string(2000, 'a') + std::string(2000, 'b');
    std::ofstream(dir / "recipe.toml") << "[run]\nsteps = 2\n[model]\nname = \"gpt\"\nlayers = 1\nwidth = 16\nheads = 2\n"
                                          "[data]\nname = \"text\"\npath = \"data/corpus.txt\"\nseq_len = 16\n"
                                          "[optimizer]\nname = \"adamw\"\n";
    const fs::path old = fs::current_path();
    fs::current_path(fs::temp_directory_path());
    tk::Trainer from_file(tk::Recipe::from_file(dir / "recipe.toml"), tkt::quiet());
    CHECK_NOTHROW(from_file.describe());
    CHECK(from_file.resolved_recipe().find("path = \"" + (dir / "data/corpus.txt").string() + "\"") != std::string::npos);
    // A --set value is relative to where the command runs.
    fs::current_path(dir / "data");
    auto overridden = tk::Recipe::from_file(dir / "recipe.toml");
    overridden.apply_override("data.path=corpus.txt");
    CHECK_NOTHROW(tk::Trainer(overridden, tkt::quiet()));
    fs::current_path(old);
    fs::remove_all(dir);
  }

  TEST_CASE("a loss is checked against the data's targets, and two instances of one plugin are refused") {
    CHECK_THROWS_WITH_AS(tk::Trainer(tkt::recipe({"loss.name=mse"}), tkt::quiet()),
                         "test.toml: loss 'mse' takes real-valued targets, but data 'synthetic-classification' "
                         "gives class labels; use cross_entropy",
                         tk::RecipeError);
    std::string twice = std::string(tkt::kTinyRecipe) + "\n[[plugins]]\nname = \"grad_accum\"\n" +
                        "\n[[plugins]]\nname = \"grad_accum\"\nsteps = 2\n";
    CHECK_THROWS_WITH_AS(tk::Trainer(tkt::recipe({}, twice.c_str()), tkt::quiet()),
                         doctest::Contains("plugin 'grad_accum' is already in this run"), tk::PluginLoadError);
  }

  TEST_CASE("validation hooks run in eval mode without grad; fit_end runs once when it fails itself") {
    struct Checks : tk::Plugin {
      void on_validation_start(tk::ValidationStartContext& ctx) override { seen.push_back(!ctx.model().is_training() && !at::GradMode::is_enabled()); }
      void on_validation_end(tk::ValidationEndContext& ctx) override { seen.push_back(!ctx.model().is_training() && !at::GradMode::is_enabled()); }
      void on_fit_end(tk::FitEndContext&) override {
        ++fit_ends;
        throw std::runtime_error("cleanup failed");
      }
      std::vector<bool> seen;
      int fit_ends = 0;
    };
    auto checks = std::make_shared<Checks>();
    tk::Trainer t(tkt::recipe({"data.validation_samples=16"}), tkt::quiet());
    t.add_plugin(checks, "checks");
    CHECK_THROWS_WITH(t.fit(), doctest::Contains("plugin 'checks' (in-process) failed in event fit_end after step "));
    CHECK(checks->seen == std::vector<bool>{true, true});
    CHECK(checks->fit_ends == 1);
  }

  TEST_CASE("a Trainer keeps its own copy of the recipe") {
    std::unique_ptr<tk::Trainer> t;
    {
      auto r = tkt::recipe();
      t = std::make_unique<tk::Trainer>(r, tkt::quiet());
    }
    CHECK(t->describe().find("recipe        test.toml") == 0);
    CHECK(t->fit().steps == 6);
  }
  TEST_CASE("run.threads sets the threads of LibTorch and of the OpenBLAS it multiplies with") {
    using Get = int (*)();
    auto blas_threads = reinterpret_cast<Get>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
    auto set_blas = reinterpret_cast<void (*)(int)>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
    const int torch_before = at::get_num_threads(), blas_before = blas_threads ? blas_threads() : 0;
    for (int n : {1, 2}) {
      tk::Trainer t(tkt::recipe({"run.threads=" + std::to_string(n)}), tkt::quiet());
      CHECK(at::get_num_threads() == n);
      if (blas_threads) CHECK(blas_threads() == n);  // LibTorch's setter alone leaves OpenBLAS at one per core
    }
    if (!blas_threads) MESSAGE("this LibTorch's BLAS is not OpenBLAS: only LibTorch's threads checked");
    at::set_num_threads(torch_before);
    if (set_blas) set_blas(blas_before);
  }

  TEST_CASE("gradients are released after each step and made afresh: the steps of kept ones to the bit, every parameter stepped") {
    // Hard-routed experts in micro-batches of 2, windows of 2: most windows leave an expert unused.
    struct Grads : tk::Plugin {
      explicit Grads(bool keep) : keep(keep) {}
      void configure(tk::RunPlan& plan) override {
        if (keep) plan.keep_gradients();
        kept = plan.gradients_kept();
      }
      void on_micro_batch(tk::MicroBatchContext& ctx) override {
        if (!ctx.window().is_first()) return;
        for (const auto& p : ctx.model().parameters())  // kept: zeroed in place; released: none
          as_expected &= keep ? p.grad().defined() && p.grad().count_nonzero().item<int64_t>() == 0 : !p.grad().defined();
      }
      void on_backward(tk::BackwardContext& ctx) override {
        if (ctx.window().is_last()) missing = std::max(missing, ctx.model().parameters().size() - ctx.gradients().size());
      }
      void on_boundary(tk::BoundaryContext& ctx) override {
        every_one &= ctx.gradients().size() == ctx.model().parameters().size();
      }
      bool keep, kept = false, as_expected = true, every_one = true;
      size_t missing = 0;
    };
    const std::string text = with_library(R"(
[run]
seed = 3
steps = 12
dtype = "float64"
[model]
name = "toy_experts"
hidden = 8
experts = 4
[data]
name = "synthetic-classification"
samples = 256
validation_samples = 0
features = 8
classes = 4
[batch]
micro_batch = 2
accumulation = 2
[optimizer]
name = "adamw"
lr = 0.01
weight_decay = 0.1
[[plugins]]
name = "grad_accum"
)", kFixtures / "tk_toy_components.so");
    tk::testing::Parameters weights[2];
    for (int keep = 0; keep < 2; ++keep) {
      CAPTURE(keep);
      auto grads = std::make_shared<Grads>(keep == 1);
      tk::Trainer t(tkt::recipe({}, text.c_str()), tkt::quiet());
      t.add_plugin(grads, "grads");
      t.fit();
      CHECK(grads->kept == (keep == 1));
      CHECK(grads->as_expected);
      CHECK(grads->every_one);  // a zero gradient for each parameter no micro-batch reached
      if (keep) CHECK(grads->missing == 0);
      else CHECK(grads->missing > 0);  // so the zero gradients were given
      for (const auto& p : t.model().named_parameters()) weights[keep][p.key()] = p.value().detach().clone();
    }
    for (const auto& [name, w] : weights[0]) {
      CAPTURE(name);
      CHECK(torch::equal(w, weights[1].at(name)));
    }
    // Outside configure the plan cannot be asked.
    tk::Trainer t(tkt::recipe({}), tkt::quiet());
    CHECK_THROWS_WITH(const_cast<tk::RunPlan&>(t.plan()).keep_gradients(), doctest::Contains("configure"));
  }

  TEST_CASE("run.phase_times: each record says where its step's time went") {
    const fs::path dir = tkt::temp_dir("phases");
    std::string text = with_library(kToyRecipe, kFixtures / "tk_toy_components.so") +
                       "[[plugins]]\nname = \"grad_accum\"\nsteps = 3\n";
    auto opts = tkt::quiet();
    opts.write_outputs = true;
    // Each get() of the training data sleeps 5 ms: made in place (no prefetch), a window of 3
    // micro-batches spends at least 15 ms on data.
    tk::Trainer t(tkt::recipe({"run.phase_times=true", "run.prefetch=\"off\"", "run.steps=5", "data.prepare_ms=5",
                               "run.validate_every=5", "run.output=\"" + dir.string() + "\""},
                              text.c_str()),
                  opts);
    t.fit();
    const fs::path m = dir / "metrics.jsonl";
    const auto data = tkt::metric(m, "data_ms"), walls = tkt::metric(m, "wall_time");
    REQUIRE(data.size() == 5);
    const auto micro = tkt::metric(m, "micro_batches");
    for (size_t i = 0; i < data.size(); ++i) CHECK(data[i] >= 5.0 * micro[i]);
    for (const char* k : {"forward_ms", "backward_ms", "boundary_ms", "optimizer_ms"}) {
      CAPTURE(k);
      const auto v = tkt::metric(m, k);
      REQUIRE(v.size() == 5);
      for (double x : v) CHECK(x > 0.0);  // each phase had work, and its time was added to it
    }
    // The phases are parts of the step: together no longer than the time between two records.
    const auto fwd = tkt::metric(m, "forward_ms"), bwd = tkt::metric(m, "backward_ms"),
               bnd = tkt::metric(m, "boundary_ms"), opt = tkt::metric(m, "optimizer_ms");
    for (size_t i = 1; i < data.size(); ++i)
      CHECK(data[i] + fwd[i] + bwd[i] + bnd[i] + opt[i] <= 1000.0 * (walls[i] - walls[i - 1]) + 1.0);
    const auto val = tkt::metric(m, "validation_ms");  // NaN where a record has no such key
    CHECK(std::count_if(val.begin(), val.end(), [](double v) { return !std::isnan(v); }) == 1);  // step 5's
    // Every record has its throughput; the toy model does not count its FLOPs, so no rate of them.
    for (double v : tkt::metric(m, "examples_per_s")) CHECK(v > 0.0);
    for (double v : tkt::metric(m, "gflops")) CHECK(std::isnan(v));
    // Off by default: no phase in the records.
    tk::Trainer plain(tkt::recipe({"run.steps=2", "run.output=\"" + (dir / "plain").string() + "\""}, text.c_str()),
                      opts);
    plain.fit();
    const auto none = tkt::metric(dir / "plain" / "metrics.jsonl", "data_ms");
    REQUIRE(none.size() == 2);
    CHECK(std::all_of(none.begin(), none.end(), [](double v) { return std::isnan(v); }));
    fs::remove_all(dir);
  }

  TEST_CASE("prefetch: the next micro-batch is made on one other thread, across epochs; the run is bit-identical; errors come at their micro-batch") {
    const fs::path dir = tkt::temp_dir("prefetch");
    fs::create_directories(dir);
    struct Ran {
      torch::Tensor params;
      std::vector<double> losses;
      std::vector<std::string> threads;
    };
    auto run = [&](const std::string& mode, const std::vector<std::string>& sets = {}) {
      const fs::path calls = dir / ("calls-" + mode + ".txt");
      fs::remove(calls);
      std::string text = with_library(kToyRecipe, kFixtures / "tk_toy_components.so") +
                         "[[plugins]]\nname = \"grad_accum\"\nsteps = 3\n";
      tk::Trainer t(tkt::recipe(sets + std::vector<std::string>{"run.prefetch=\"" + mode + "\"", "run.steps=40",
                                                                 "data.calls_file=\"" + calls.string() + "\""},
                                text.c_str()),
                    tkt::quiet());
      Ran out;
      out.losses = t.fit().window_losses;
      out.params = tkt::flat_params(t.model());
      std::ifstream in(calls);
      for (std::string line; std::getline(in, line);) out.threads.push_back(line);
      return out;
    };
    auto count = [](const std::vector<std::string>& v, const std::string& what) {
      return std::count_if(v.begin(), v.end(), [&](const std::string& s) { return s.rfind(what, 0) == 0; });
    };
    const Ran off = run("off"), on = run("on");
    // Before training, the data check reads the split and one micro-batch (2 calls). 150 examples
    // in micro-batches of 16: 10 per epoch, in steps of 3, 3, 3 and 1: 40 steps in 10 epochs.
    REQUIRE(off.threads.size() == 2 + 100);
    CHECK(count(off.threads, "main") == 2 + 100);
    CHECK(on.threads.size() == 2 + 100);  // nothing made ahead after the last step
    // Only the very first micro-batch is made in place: each epoch's first is made during the
    // previous epoch's last, by the same long-lived thread as every other.
    CHECK(count(on.threads, "main") == 2 + 1);
    const std::set<std::string> workers(on.threads.begin() + 3, on.threads.end());
    CHECK(workers.size() == 1);
    CHECK(workers.begin()->rfind("background ", 0) == 0);
    CHECK(torch::equal(on.params, off.params));
    CHECK(on.losses == off.losses);

    // auto on the CPU: on once preparing data is a noticeable share of each micro-batch.
    const Ran slow = run("auto", {"data.prepare_ms=4"});
    CHECK(torch::equal(slow.params, off.params));
    CHECK(count(slow.threads, "background") > 80);
    // It decided after timing 9 micro-batches made in place.
    CHECK(std::find_if(slow.threads.begin(), slow.threads.end(),
                       [](const std::string& s) { return s.rfind("background", 0) == 0; }) -
              slow.threads.begin() ==
          2 + 9);

    // The data set's error ends the run at the micro-batch that needs it, with the same steps
    // taken as without prefetch.
    for (const char* mode : {"off", "on"}) {
      CAPTURE(mode);
      std::string text = with_library(kToyRecipe, kFixtures / "tk_toy_components.so");
      tk::Trainer t(tkt::recipe({std::string("run.prefetch=\"") + mode + "\"", "data.fail_at_get=8"}, text.c_str()),
                    tkt::quiet());
      auto probe = std::make_shared<StatusProbe>();
      t.add_plugin(probe, "status_probe");
      CHECK_THROWS_WITH(t.fit(), doctest::Contains("injected data failure at get 8"));  // micro-batch 6
      CHECK(probe->boundaries == 5);
    }
  }
}
