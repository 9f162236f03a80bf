// Recipes: parsing, validation errors with positions, overrides, the resolved copy.
#include "support.h"

using tk::Recipe;
using tk::RecipeError;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

std::string build_error(const std::string& text, const std::vector<std::string>& sets = {}) {
  return error_of([&] {
    auto r = tkt::recipe(sets, text.c_str());
    tk::Trainer t(r, tkt::quiet());
    t.describe();
  });
}

const std::string kMinimal = R"([model]
name = "mlp"
[data]
name = "synthetic-classification"
samples = 64
[optimizer]
name = "sgd"
)";

}  // namespace

TEST_SUITE("recipe") {
  TEST_CASE("a minimal recipe fills in defaults and resolves them") {
    auto r = tkt::recipe({}, kMinimal.c_str());
    tk::Trainer t(r, tkt::quiet());
    CHECK(t.plan().micro_batch() == 32);
    CHECK(t.plan().accumulation() == 1);
    const std::string resolved = t.resolved_recipe();
    CHECK(resolved.find("[optimizer]\nname = \"sgd\"") != std::string::npos);
    CHECK(resolved.find("momentum = 0.0") != std::string::npos);
    CHECK(resolved.find("micro_batch = 32") != std::string::npos);
    // The resolved recipe is itself a valid recipe that resolves to the same text.
    auto again = tk::Recipe::from_string(resolved, "resolved.toml");
    tk::Trainer t2(again, tkt::quiet());
    const std::string twice = t2.resolved_recipe();
    CHECK(twice.substr(twice.find('\n')) == resolved.substr(resolved.find('\n')));
  }

  TEST_CASE("an unknown key names file, line, column and the valid keys") {
    std::string e = build_error(kMinimal + "lr = 0.1\nmomentun = 0.9\n");
    CHECK(e.find("test.toml:9:1: unknown key 'momentun' in [optimizer]; valid keys: name, lr, momentum") == 0);
  }

  TEST_CASE("a wrong type says what was expected and what was found") {
    std::string e = build_error(kMinimal + "lr = \"fast\"\n");
    CHECK(e == "test.toml:8:6: optimizer.lr: expected float, got string");
    e = build_error(kMinimal, {"model.hidden=[16, 2.5]"});
    CHECK(e == "--set model.hidden=[16, 2.5]: model.hidden: expected array of integers, got an element of type float");
    e = build_error(std::string(tkt::kTinyRecipe) + "[[plugins]]\nname = \"grad_accum\"\n", {"plugins.0.steps=0"});
    CHECK(e == "--set plugins.0.steps=0: plugins.grad_accum.steps: must be >= 1 (or 0 with effective_batch: inferred), got 0");
  }

  TEST_CASE("a string outside its choices lists them") {
    std::string e = build_error(kMinimal, {"model.activation=swish"});
    CHECK(e.find("model.activation: expected one of relu, gelu, tanh, got \"swish\"") != std::string::npos);
  }

  TEST_CASE("unknown components and sections list the known names") {
    CHECK(build_error(kMinimal, {"optimizer.name=lamb"}).find("unknown optimizer 'lamb'; known: sgd, adam, adamw") !=
          std::string::npos);
    CHECK(build_error(kMinimal + "[optimiser]\nlr = 1\n").find("test.toml:8:2: unknown section [optimiser]") == 0);
    CHECK(build_error("[data]\nname = \"synthetic-classification\"\n[optimizer]\nname = \"sgd\"\n")
              .find("missing section [model] (its name is one of: mlp, cnn, gpt, torchscript)") != std::string::npos);
  }

  TEST_CASE("TOML syntax errors carry their position") {
    std::string e = build_error("[model]\nname = \"mlp\n");
    CHECK(e.find("test.toml:2:") == 0);
    CHECK(e.find("TOML syntax error") != std::string::npos);
  }

  TEST_CASE("semantic errors point at the offending value") {
    CHECK(build_error(kMinimal + "lr = -1.0\n") == "test.toml:8:6: optimizer.lr: must be > 0 and finite, got -1.0");
    CHECK(build_error(kMinimal, {"run.epochs=2", "run.steps=5"}).find("run.steps: give either epochs or steps") !=
          std::string::npos);
    CHECK(build_error(kMinimal, {"batch.micro_batch=0"}).find("batch.micro_batch: must be >= 1") != std::string::npos);
  }

  TEST_CASE("--set overrides values, creates sections and addresses plugins") {
    auto r = tkt::recipe({"optimizer.lr=0.5", "run.name=renamed", "schedule.name=warmup_cosine"});
    tk::Trainer t(r, tkt::quiet());
    CHECK(tk::get_lr(t.optimizer()) == doctest::Approx(0.5));
    CHECK(t.resolved_recipe().find("name = \"renamed\"") != std::string::npos);
    CHECK(t.resolved_recipe().find("[schedule]\nname = \"warmup_cosine\"") != std::string::npos);

    auto with_plugin = std::string(tkt::kTinyRecipe) + "[[plugins]]\nname = \"grad_accum\"\nsteps = 2\n";
    auto r2 = tkt::recipe({"plugins.grad_accum.steps=4"}, with_plugin.c_str());
    tk::Trainer t2(r2, tkt::quiet());
    CHECK(t2.plan().accumulation() == 4);
    auto r3 = tkt::recipe({"plugins.0.steps=5"}, with_plugin.c_str());
    tk::Trainer t3(r3, tkt::quiet());
    CHECK(t3.plan().accumulation() == 5);
    CHECK(error_of([&] { tkt::recipe({"plugins.clip.max_norm=1"}, with_plugin.c_str()); })
              .find("the recipe has no plugin 'clip'") != std::string::npos);
    CHECK(error_of([&] { tkt::recipe({"optimizer.lr"}); }).find("expected key=value") != std::string::npos);
  }

  TEST_CASE("plugin options are validated against the plugin's declaration") {
    auto text = std::string(tkt::kTinyRecipe) + "[[plugins]]\nname = \"grad_accum\"\nstep = 2\n";
    std::string e = build_error(text);
    CHECK(e.find("test.toml:28:1: unknown key 'step' in [plugins.grad_accum]; valid keys: name, path, steps, "
                 "effective_batch, memory_budget, ramp_from, ramp_steps, ramp_samples, normalize, last_window") == 0);
    e = build_error(std::string(tkt::kTinyRecipe) + "[[plugins]]\nname = \"grad_accum\"\nsteps = \"four\"\n");
    CHECK(e.find("plugins.grad_accum.steps: expected integer, got string") != std::string::npos);
    e = build_error(std::string(tkt::kTinyRecipe) + "[[plugins]]\nname = \"grad_accum\"\nsteps = 0\n");
    CHECK(e.find("test.toml:28:9: plugins.grad_accum.steps: must be >= 1 (or 0 with effective_batch: inferred), got 0") == 0);
    e = build_error(std::string(tkt::kTinyRecipe) + "[[plugins]]\nsteps = 2\n");
    CHECK(e.find("test.toml:26:1: a [[plugins]] entry needs a name") == 0);
  }

  TEST_CASE("an option LibTorch's optimizer refuses is refused at its key, or at the optimizer section") {
    const std::string text = "[model]\nname = \"mlp\"\n[data]\nname = \"synthetic-classification\"\nsamples = 64\n"
                             "[optimizer]\nname = \"adamw\"\nweight_decay = -0.5\n";
    const std::string e = build_error(text);
    INFO(e);
    CHECK(e.find("test.toml:8:16: optimizer 'adamw' refused its options: Invalid weight_decay value: -0.5") == 0);
  }

  TEST_CASE("normalize modes are checked against the loss reduction before training") {
    auto text = std::string(tkt::kTinyRecipe) + "[[plugins]]\nname = \"grad_accum\"\nnormalize = \"tokens\"\n";
    std::string e = build_error(text);
    CHECK(e.find("test.toml:28:13: plugins.grad_accum.normalize: \"tokens\" needs a loss with reduction = \"sum\", but the loss's "
                 "reduction is \"mean\": set [loss] reduction = \"sum\", or normalize = \"mean\"") == 0);
  }

  TEST_CASE("option values print back as TOML") {
    CHECK(tk::to_toml(tk::OptionValue{0.1}) == "0.1");
    CHECK(tk::to_toml(tk::OptionValue{1.0}) == "1.0");
    CHECK(tk::to_toml(tk::OptionValue{1e-8}) == "1e-08");
    CHECK(tk::to_toml(tk::OptionValue{std::string("a\"b")}) == "\"a\\\"b\"");
    CHECK(tk::to_toml(tk::OptionValue{std::vector<int64_t>{1, 2}}) == "[1, 2]");
    // The shortest that reads back (a run's identity compares these: their form does not change).
    CHECK(tk::to_toml(tk::OptionValue{10000.0}) == "1e+04");
    // Control characters escaped: a document separator of "\n%\n" reads back as itself.
    const std::string sep = "\n%\n\t\x01";
    CHECK(tk::to_toml(tk::OptionValue{sep}) == "\"\\n%\\n\\t\\u0001\"");
    const tk::OptionSpecs specs{{"separator", tk::OptionType::String, std::string(), "a separator"}};
    CHECK(tk::parse_options("separator = " + tk::to_toml(tk::OptionValue{sep}), specs).get_string("separator") == sep);
  }
}
