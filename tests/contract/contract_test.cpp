// tk-plugin-contract: the contract every trainkit plugin must meet, run against one plugin library.
//
//   tk-plugin-contract path/to/tk_name.so [--options TOML] [--neutral TOML|none] [doctest options]
//
// --options  the plugin options the behavioural checks use (default: the plugin's defaults)
// --neutral  options with which the plugin must leave a run bit-identical (default: its defaults);
//            "none" for a plugin that always changes the numerics (mixed precision, say)
#include <tk/abi.h>

#include <cmath>
#include <cstring>

#include "support.h"

namespace {

std::string g_plugin;
std::string g_options;
std::string g_neutral;
bool g_check_neutral = true;

tk::LoadedPlugin load() {
  tk::PluginLoader loader({});
  return loader.load_plugin(g_plugin);
}

const char* kContractRecipe = R"(
[run]
seed = 5
epochs = 2
dtype = "float32"
trace = true

[model]
name = "mlp"
hidden = [8]

[data]
name = "synthetic-classification"
samples = 60
validation_samples = 16
features = 6
classes = 3
micro_batch = 8

[optimizer]
name = "sgd"
lr = 0.05
momentum = 0.9
)";

struct ContractRun {
  std::shared_ptr<tk::Plugin> plugin;
  torch::Tensor params;
  std::vector<tk::TraceEntry> trace;
  tk::FitResult result;
};

/// Trains the contract recipe, with the plugin (options as TOML) or without it.
ContractRun run_with(const std::string* options) {
  auto r = tkt::recipe({}, kContractRecipe);
  tk::Trainer t(r, tkt::quiet());
  ContractRun out;
  if (options) {
    auto lp = load();
    out.plugin = lp.plugin;
    t.add_plugin(lp.plugin, tk::parse_options(*options, lp.plugin->option_specs(), "plugins." + lp.name));
  }
  out.result = t.fit();
  out.params = tkt::flat_params(t.model());
  out.trace = t.trace();
  return out;
}

size_t variant_index(tk::OptionType t) { return static_cast<size_t>(t); }

}  // namespace

TEST_SUITE("plugin contract") {
  TEST_CASE("loads and reports its name and version") {
    auto lp = load();
    CHECK_FALSE(lp.name.empty());
    CHECK_FALSE(lp.version.empty());
    CHECK(lp.plugin->name() == lp.name);
    CHECK(lp.file.filename() == tk::PluginLoader::file_name(lp.name));
  }

  TEST_CASE("declares well-formed, documented options") {
    auto lp = load();
    std::set<std::string> names;
    for (const auto& s : lp.plugin->option_specs()) {
      CAPTURE(s.name);
      CHECK_FALSE(s.name.empty());
      CHECK(names.insert(s.name).second);
      CHECK(s.name != "name");
      CHECK(s.name != "path");
      CHECK_FALSE(s.doc.empty());
      CHECK(s.default_value.index() == variant_index(s.type));
      if (!s.choices.empty())
        CHECK(std::find(s.choices.begin(), s.choices.end(), std::get<std::string>(s.default_value)) != s.choices.end());
    }
    // Its defaults are accepted as they are.
    CHECK_NOTHROW(lp.plugin->init(tk::defaults_of(lp.plugin->option_specs())));
  }

  TEST_CASE("refuses unknown and mistyped options, listing the valid ones") {
    auto lp = load();
    const auto specs = lp.plugin->option_specs();
    std::string text = std::string(tkt::kTinyRecipe) + "[[plugins]]\npath = \"" + g_plugin +
                       "\"\ndefinitely_not_an_option = 1\n";
    try {
      auto r = tk::Recipe::from_string(text, "contract.toml");
      tk::Trainer t(r, tkt::quiet());
      FAIL("an unknown option was accepted");
    } catch (const tk::RecipeError& e) {
      std::string m = e.what();
      CHECK(m.find("unknown key 'definitely_not_an_option'") != std::string::npos);
      for (const auto& s : specs) CHECK(m.find(s.name) != std::string::npos);
    }
    for (const auto& s : specs) {
      CAPTURE(s.name);
      const std::string wrong = s.type == tk::OptionType::String ? "1" : "\"not a " + std::string(tk::to_string(s.type)) + "\"";
      CHECK_THROWS_WITH_AS(tk::parse_options(s.name + " = " + wrong, specs, "plugins." + lp.name),
                           doctest::Contains("expected"), tk::RecipeError);
    }
  }

  TEST_CASE("survives every event of a tiny run, with validation and two epochs") {
    auto run = run_with(&g_options);
    // Every event occurs in this run; each hook the plugin kept (did not decline) must have run.
    for (int i = 0; i < tk::kEventCount; ++i) {
      auto e = static_cast<tk::Event>(i);
      if (!run.plugin->handles(e)) continue;
      CAPTURE(tk::to_string(e));
      bool seen = std::any_of(run.trace.begin(), run.trace.end(),
                              [&](const tk::TraceEntry& t) { return t.event == e && t.plugin == run.plugin->name(); });
      CHECK(seen);
    }
    CHECK(run.result.steps > 0);
    CHECK(torch::isfinite(run.params).all().item<bool>());
    for (double l : run.result.window_losses) CHECK(std::isfinite(l));
  }

  TEST_CASE("round-trips its state into a fresh instance") {
    auto run = run_with(&g_options);
    tk::StateDict saved = run.plugin->state();
    auto fresh = load();
    const auto opts = tk::parse_options(g_options, fresh.plugin->option_specs(), "plugins." + fresh.name);
    fresh.plugin->set_options(opts);
    fresh.plugin->init(opts);
    fresh.plugin->load_state(saved);
    tk::StateDict again = fresh.plugin->state();
    REQUIRE(again.size() == saved.size());
    for (const auto& [k, v] : saved) {
      CAPTURE(k);
      REQUIRE(again.count(k) == 1);
      CHECK(torch::equal(again.at(k), v));
    }
  }

  TEST_CASE("with neutral options it does not change the result of a run") {
    if (!g_check_neutral) {
      MESSAGE("skipped: the plugin declares that it always changes the numerics (--neutral none)");
      return;
    }
    auto without = run_with(nullptr);
    auto with = run_with(&g_neutral);
    CHECK(torch::equal(without.params, with.params));
    CHECK(without.result.steps == with.result.steps);
  }
}

int main(int argc, char** argv) {
  std::vector<char*> rest = {argv[0]};
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--options") == 0 && i + 1 < argc) {
      g_options = argv[++i];
    } else if (std::strcmp(argv[i], "--neutral") == 0 && i + 1 < argc) {
      g_neutral = argv[++i];
      g_check_neutral = g_neutral != "none";
    } else if (argv[i][0] != '-' && g_plugin.empty()) {
      g_plugin = argv[i];
    } else {
      rest.push_back(argv[i]);
    }
  }
  if (g_plugin.empty()) {
    std::fprintf(stderr, "usage: tk-plugin-contract PLUGIN.so [--options TOML] [--neutral TOML|none]\n");
    return 2;
  }
  std::fprintf(stderr, "contract suite for %s\n", g_plugin.c_str());
  doctest::Context ctx;
  ctx.applyCommandLine(static_cast<int>(rest.size()), rest.data());
  return ctx.run();
}
