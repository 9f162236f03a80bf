// Recomputation: every step with it equals the step without it, bit for bit, alone and with
// accumulation, autocast, clipping and the loss scaler, on the GPT with dropout, the MLP and CNN
// with BatchNorm and a user's model; it keeps less memory; the memory planner weighs it; what it
// cannot do is refused, saying why.
#include <tk/blocks.h>
#include <tk/tensor_io.h>
#include <torch/nn/modules/linear.h>
#include <tk/testing.h>

#include <filesystem>
#include <fstream>

#include "support.h"

namespace fs = std::filesystem;
using torch::Tensor;

namespace {

const char* kGpt = R"(
[run]
seed = 11
steps = 4
dtype = "float32"

[model]
name = "gpt"
layers = 4
width = 32
heads = 2
dropout = 0.1

[data]
name = "text"
seq_len = 24
document_separator = "\n%\n"
validation_fraction = 0.0

[batch]
micro_batch = 4

[loss]
name = "cross_entropy"
reduction = "sum"

[optimizer]
name = "adamw"
lr = 0.01
)";

/// Documents of 1 to 40 letters, so that batches carry padding.
const fs::path& corpus() {
  static const fs::path file = [] {
    const fs::path dir = tkt::temp_dir("recompute-corpus");
    fs::create_directories(dir);
    tkt::write_documents(dir / "corpus.txt", 80);
    return dir / "corpus.txt";
  }();
  return file;
}

struct Run {
  Tensor params, buffers;
  tk::FitResult fit;
};

Tensor flat_buffers(tk::Model& m) {
  std::vector<Tensor> parts;
  for (const auto& b : m.buffers()) parts.push_back(b.detach().reshape({-1}).to(torch::kDouble));
  return parts.empty() ? torch::zeros({0}, torch::kDouble) : torch::cat(parts);
}

Run train(const char* recipe, const std::string& plugins, const std::vector<std::string>& sets = {}) {
  const std::string text = std::string(recipe) + plugins;
  tk::Trainer t(tkt::recipe(sets, text.c_str()), tkt::quiet());
  Run r;
  r.fit = t.fit();
  r.params = tkt::flat_params(t.model());
  r.buffers = flat_buffers(t.model());
  return r;
}

std::vector<std::string> gpt_sets(const std::vector<std::string>& more = {}) {
  return std::vector<std::string>{"data.path=\"" + corpus().string() + "\""} + more;
}

std::string recompute(const std::string& options = "") { return "[[plugins]]\nname = \"recompute\"\n" + options; }

const std::string kAccum4 = "[[plugins]]\nname = \"grad_accum\"\nsteps = 4\nnormalize = \"tokens\"\n";
const std::string kBf16 = "[[plugins]]\nname = \"mixed_precision\"\ndtype = \"bf16\"\n";
const std::string kScaler =
    "[[plugins]]\nname = \"mixed_precision\"\ndtype = \"bf16\"\nloss_scale = \"dynamic\"\ninit_scale = 1024.0\n";
const std::string kClip = "[[plugins]]\nname = \"clip\"\nmax_norm = 0.5\n";

void check_same(const Run& a, const Run& b) {
  CHECK(torch::equal(a.params, b.params));
  CHECK(torch::equal(a.buffers, b.buffers));
  CHECK(a.fit.window_losses == b.fit.window_losses);
  CHECK(a.fit.skipped_steps == b.fit.skipped_steps);
}

double recomputed_blocks(const Run& r) {
  REQUIRE(!r.fit.step_metrics.empty());
  return r.fit.step_metrics.back().at("recompute_blocks");
}

/// The plan of `recipe` with micro_batch = "auto" over an effective batch of `effective`, and a
/// budget of `budget` bytes: the micro-batch picked, its peaks, the lever's level.
struct Plan {
  int64_t micro_batch = 0, level = -1;
  std::vector<std::pair<int64_t, double>> peaks;
};
std::vector<std::string> auto_sets(int64_t effective, double budget) {
  return gpt_sets({"batch.micro_batch=\"auto\"", "plugins.grad_accum.effective_batch=" + std::to_string(effective),
                   "plugins.grad_accum.memory_budget=\"" + std::to_string(static_cast<int64_t>(budget)) + "\""});
}
const std::string kAutoAccum = "[[plugins]]\nname = \"grad_accum\"\nsteps = 0\nnormalize = \"tokens\"\n";
Plan plan(const std::string& plugins, int64_t effective, double budget) {
  const std::string text = std::string(kGpt) + kAutoAccum + plugins;
  tk::Trainer t(tkt::recipe(auto_sets(effective, budget), text.c_str()), tkt::quiet());
  const tk::RunPlan& p = t.plan();
  return {p.micro_batch(), p.memory_level(), p.measured_peaks()};
}
double peak_at(const Plan& p, int64_t m) {
  for (const auto& [mb, bytes] : p.peaks)
    if (mb == m) return bytes;
  FAIL("no peak measured at micro-batch " << m);
  return 0;
}

}  // namespace

TEST_SUITE("recompute") {
  TEST_CASE("every step equals the step without recomputation, bit for bit: GPT with dropout, alone and composed") {
    struct Combo {
      const char* name;
      std::string plugins;
      bool f64;
    };
    const std::vector<Combo> combos = {{"alone", "", true},          {"grad_accum k = 4", kAccum4, true},
                                       {"bf16 autocast", kBf16, false}, {"clipping", kClip, true},
                                       {"dynamic loss scaler", kScaler, false},
                                       {"k = 4, bf16, scaler, clipping", kAccum4 + kScaler + kClip, false}};
    const std::vector<std::pair<std::string, double>> selections = {
        {"", 4}, {"every = 2\n", 2}, {"modules = [\"blocks.3\", \"blocks.1\"]\n", 2}, {"modules = \"blocks.0\"\n", 1}};
    for (const auto& dtype : {"float32", "float64"})
      for (const auto& c : combos) {
        if (std::string(dtype) == "float64" && !c.f64) continue;  // autocast takes float32 parameters
        CAPTURE(dtype);
        CAPTURE(c.name);
        const auto sets = gpt_sets({std::string("run.dtype=\"") + dtype + "\""});
        const Run plain = train(kGpt, c.plugins, sets);
        for (const auto& [options, blocks] : selections) {
          CAPTURE(options);
          const Run with = train(kGpt, c.plugins + recompute(options), sets);
          check_same(plain, with);
          CHECK(recomputed_blocks(with) == blocks);
        }
      }
  }

  TEST_CASE("the MLP and the CNN with BatchNorm: the same steps and the same running statistics") {
    std::string mlp = tk::testing::kTinyRecipe;
    const auto mlp_sets = std::vector<std::string>{"model.hidden=[16, 16, 8]", "model.batchnorm=true"};
    check_same(train(mlp.c_str(), "", mlp_sets), train(mlp.c_str(), recompute(), mlp_sets));
    check_same(train(mlp.c_str(), kAccum4.substr(0, kAccum4.find("normalize")), mlp_sets),
               train(mlp.c_str(), kAccum4.substr(0, kAccum4.find("normalize")) + recompute("every = 2\n"), mlp_sets));

    const fs::path dir = tkt::temp_dir("recompute-images");
    fs::create_directories(dir);
    torch::manual_seed(3);
    tk::save_tensor_dict(dir / "images.pt", {{"inputs", torch::randn({48, 1, 8, 8})}, {"targets", torch::randint(0, 3, {48})}});
    const std::string cnn = std::string(tk::testing::kTinyRecipe)
                                .replace(std::string(tk::testing::kTinyRecipe).find("[model]"), std::string::npos,
                                         "[model]\nname = \"cnn\"\nchannels = [4, 6]\nhidden = 8\nbatchnorm = true\ndropout = 0.2\n"
                                         "[data]\nname = \"tensors\"\npath = \"" + (dir / "images.pt").string() +
                                         "\"\n[batch]\nmicro_batch = 8\n[optimizer]\nname = \"sgd\"\nlr = 0.05\nmomentum = 0.9\n");
    const Run plain = train(cnn.c_str(), "");
    CHECK(plain.buffers.numel() > 0);
    const Run with = train(cnn.c_str(), recompute("modules = \"convs.*\"\n"));
    check_same(plain, with);
    CHECK(recomputed_blocks(with) == 2);
  }

  TEST_CASE("a user's model with tk::Blocks: the same steps; a block that uses a parameter it does not list is refused") {
    const std::string lib = "[[plugins]]\npath = \"" + (fs::path(TK_TEST_PLUGIN_DIR) / "tk_toy_components.so").string() + "\"\n";
    std::string toy = tk::testing::kTinyRecipe;
    toy.replace(toy.find("name = \"mlp\""), 12, "name = \"toy_blocks\"");
    toy.replace(toy.find("hidden = [16]"), 13, "layers = 3");
    toy.replace(toy.find("activation = \"tanh\""), 19, "");
    check_same(train(toy.c_str(), lib), train(toy.c_str(), lib + recompute("modules = [\"layer?\"]\n")));
    CHECK_THROWS_WITH_AS(train(toy.c_str(), lib + recompute(), {"model.leaky=true"}),
                         doctest::Contains("block 'layer2' uses a trainable tensor of shape [16] that is not a parameter of "
                                           "the modules the model lists for it"),
                         std::exception);
    // A model that lists no blocks, and a pattern that selects none, are refused at the recipe.
    std::string net = toy;
    net.replace(net.find("name = \"toy_blocks\""), 19, "name = \"toy_net\"");
    net.replace(net.find("layers = 3"), 10, "");
    CHECK_THROWS_WITH_AS(train(net.c_str(), lib + recompute()),
                         doctest::Contains("plugins.recompute.modules: the model lists no blocks to recompute: it does not "
                                           "implement tk::ModelWithBlocks (tk/blocks.h)"),
                         tk::RecipeError);
    CHECK_THROWS_WITH_AS(train(kGpt, recompute("modules = [\"blocks.*\", \"ln_f\"]\n"), gpt_sets()),
                         doctest::Contains("test.toml:32:11: plugins.recompute.modules: \"ln_f\" selects no block of the "
                                           "model (it names modules inside or outside blocks: ln_f); its blocks are "
                                           "blocks.0, blocks.1, blocks.2, blocks.3; its modules: wte, wpe, blocks,"),
                         tk::RecipeError);
    CHECK_THROWS_WITH_AS(train(kGpt, recompute("every = 0\n"), gpt_sets()),
                         doctest::Contains("plugins.recompute.every: must be >= 1, got 0"), tk::RecipeError);
    CHECK_THROWS_WITH_AS(train(kGpt, recompute("modules = \"auto\"\n"), gpt_sets()),
                         doctest::Contains("plugins.recompute.modules: \"auto\" leaves the number of recomputed blocks to "
                                           "the memory planner, which runs with [batch] micro_batch = \"auto\""),
                         tk::RecipeError);
  }

  TEST_CASE("tk::Blocks: the around runner wraps the compute runner, set in either order; each setter keeps the other") {
    tk::Blocks blocks;
    std::vector<std::string> log;
    for (int i = 0; i < 3; ++i) {
      auto layer = std::make_shared<torch::nn::LinearImpl>(2, 2);
      blocks.add("layer" + std::to_string(i), {layer}, [i, &log](const Tensor& x) {
        log.push_back("fn" + std::to_string(i));
        return x + 1;
      });
    }
    const auto compute = [&log](size_t i, const Tensor& x, const tk::BlockFn& fn) {
      log.push_back("compute" + std::to_string(i));
      return fn(x);
    };
    const auto around = [&log](size_t i, const Tensor& x, const tk::BlockFn& fn) {
      log.push_back("around" + std::to_string(i) + "(");
      Tensor y = fn(x);
      log.push_back(")");
      return y;
    };
    const auto run_all = [&] {
      log.clear();
      Tensor x = torch::zeros({1});
      for (size_t i = 0; i < blocks.size(); ++i) x = blocks.run(i, x);
      CHECK(x.item<float>() == 3);
      std::string s;
      for (const auto& e : log) s += e + " ";
      return s;
    };
    blocks.set_runner(compute, {true, false, true});
    CHECK(run_all() == "compute0 fn0 fn1 compute2 fn2 ");
    blocks.set_around(around);
    CHECK(run_all() == "around0( compute0 fn0 ) around1( fn1 ) around2( compute2 fn2 ) ");
    CHECK(blocks.runs_through_runner(1));
    blocks.set_runner(compute, {false, true, false});  // a new selection keeps the around runner
    CHECK(run_all() == "around0( fn0 ) around1( compute1 fn1 ) around2( fn2 ) ");
    blocks.set_runner(nullptr, {});
    CHECK(run_all() == "around0( fn0 ) around1( fn1 ) around2( fn2 ) ");
    blocks.set_runner(compute, {true, true, false});
    blocks.set_around(nullptr);  // the compute runner stays, with its selection
    CHECK(run_all() == "compute0 fn0 compute1 fn1 fn2 ");
    CHECK(!blocks.runs_through_runner(2));
    blocks.set_around(around);  // around first, then the compute runner
    blocks.set_runner(nullptr, {});
    blocks.set_runner(compute, {false, false, true});
    CHECK(run_all() == "around0( fn0 ) around1( fn1 ) around2( compute2 fn2 ) ");
    CHECK_THROWS_WITH_AS(blocks.set_runner(compute, {true}), doctest::Contains("set_runner: 1 selections for 3 blocks"),
                         std::exception);
  }

  TEST_CASE("validation and no-grad forwards run the blocks directly; the plan says what is recomputed") {
    const Run r = train(kGpt, recompute("every = 2\n"), gpt_sets({"data.validation_fraction=0.2", "run.validate_every=2"}));
    CHECK(r.fit.validation_losses.size() == 2);
    const Run plain = train(kGpt, "", gpt_sets({"data.validation_fraction=0.2", "run.validate_every=2"}));
    CHECK(r.fit.validation_losses == plain.fit.validation_losses);
    check_same(plain, r);
  }

  TEST_CASE("recomputing every block keeps less memory in a step than recomputing none") {
    const double huge = 64.0 * (1 << 30);
    const Plan none = plan("", 16, huge);
    const Plan all = plan(recompute(), 16, huge);
    REQUIRE(none.micro_batch == 16);
    REQUIRE(all.micro_batch == 16);
    CHECK(none.level == -1);  // no plugin offered a lever
    // The activations of 4 blocks at 16 x 24 tokens dominate this small model's step.
    CHECK(peak_at(all, 16) < 0.75 * peak_at(none, 16));
    CHECK(peak_at(all, 8) < peak_at(none, 8));
  }

  TEST_CASE("the memory planner picks a larger micro-batch with recomputation, under the budget, as set by hand") {
    const double huge = 64.0 * (1 << 30);
    const Plan none = plan("", 16, huge), all = plan(recompute(), 16, huge);
    // A budget that fits micro-batch 8 without recomputation, and 16 only with it.
    const double budget = 1.1 * 1.02 * std::max(peak_at(none, 8), peak_at(all, 16));
    REQUIRE(budget < 1.1 * peak_at(none, 16));
    const Plan without = plan("", 16, budget);
    CHECK(without.micro_batch == 8);
    const Plan picked = plan(recompute("modules = \"auto\"\n"), 16, budget);
    CHECK(picked.micro_batch == 16);
    CHECK(picked.level >= 1);
    CHECK(picked.level <= 4);
    CHECK(peak_at(picked, 16) * 1.1 <= budget);

    // The run: its steps are those of the same choice set by hand, and it stays under the budget.
    const std::string text = std::string(kGpt) + kAutoAccum + recompute("modules = \"auto\"\n");
    const fs::path dir = tkt::temp_dir("recompute-auto");
    tk::TrainerOptions opts = tkt::quiet();
    opts.write_outputs = true;
    tk::Trainer t(tkt::recipe(auto_sets(16, budget) + std::vector<std::string>{"run.output=\"" + dir.string() + "\"",
                                                                       "run.measure_memory=true"},
                              text.c_str()),
                  opts);
    const tk::FitResult fit = t.fit();
    const Tensor params = tkt::flat_params(t.model());
    const fs::path metrics = dir / "metrics.jsonl";
    for (double m : tkt::metric(metrics, "micro_batch")) CHECK(m == 16);
    for (double n : tkt::metric(metrics, "recompute_blocks")) CHECK(n == picked.level);
    const auto peaks = tkt::metric(metrics, "step_peak_mib");
    CHECK(peaks.size() == 4);
    for (double mib : peaks) CHECK(mib * 1024 * 1024 <= budget);
    CHECK(t.describe().find("with " + std::to_string(picked.level) + " recomputed blocks, picked with it by plugin "
                            "'recompute'") != std::string::npos);
    fs::remove_all(dir);
    std::string first;
    for (int64_t i = 0; i < picked.level; ++i) first += (i ? ", \"blocks." : "\"blocks.") + std::to_string(i) + "\"";
    const Run by_hand = train(kGpt, "[[plugins]]\nname = \"grad_accum\"\nsteps = 1\nnormalize = \"tokens\"\n" +
                                        recompute("modules = [" + first + "]\n"),
                              gpt_sets({"batch.micro_batch=16"}));
    CHECK(torch::equal(params, by_hand.params));
    CHECK(fit.window_losses == by_hand.fit.window_losses);
  }

  TEST_CASE("with bf16 autocast and recomputation, the trials measure the run's own step: its measured peak is the trial's") {
    // The trials run the recipe's plugins (autocast, the recomputed blocks) through the run's own
    // engine: the peak the planner measured for the micro-batch and level it picked is the peak
    // each training step then takes. Trials that left autocast out measured float32 activations.
    const double huge = 64.0 * (1 << 30);
    const Plan roomy = plan(kBf16 + recompute("modules = \"auto\"\n"), 16, huge);
    REQUIRE(roomy.micro_batch == 16);
    // A budget that 8 fits at the lever's top level and 16 does not: the planner must weigh both.
    const double budget = 1.1 * 1.01 * peak_at(roomy, 8);
    const std::string text = std::string(kGpt) + kAutoAccum + kBf16 + recompute("modules = \"auto\"\n");
    const fs::path dir = tkt::temp_dir("recompute-auto-bf16");
    tk::TrainerOptions opts = tkt::quiet();
    opts.write_outputs = true;
    tk::Trainer t(tkt::recipe(auto_sets(16, budget) + std::vector<std::string>{"run.output=\"" + dir.string() + "\"",
                                                                       "run.measure_memory=true"},
                              text.c_str()),
                  opts);
    const tk::RunPlan& p = t.plan();
    const int64_t m = p.micro_batch();
    double trial = 0;
    for (const auto& [mb, bytes] : p.measured_peaks())
      if (mb == m) trial = bytes;
    REQUIRE(trial > 0);
    CHECK(trial * 1.1 <= budget);
    t.fit();
    const auto peaks = tkt::metric(dir / "metrics.jsonl", "step_peak_mib");
    REQUIRE(peaks.size() >= 2);
    for (size_t i = 1; i < peaks.size(); ++i) {  // the first step makes the optimizer's state
      CAPTURE(i);
      const double run = peaks[i] * 1024 * 1024;
      CHECK(run <= budget);
      CHECK(std::abs(run - trial) <= 0.03 * trial);
    }
    fs::remove_all(dir);
  }
}
