// trainkit::testing: in-process runs, fixtures and the plugin contract checks.
#include "tk/testing.h"

#include <unistd.h>

#include <algorithm>

#include "tk/loader.h"

namespace fs = std::filesystem;

namespace tk::testing {

const char* const kTinyRecipe = R"(
[run]
seed = 3
steps = 6
dtype = "float64"

[model]
name = "mlp"
hidden = [16]
activation = "tanh"

[data]
name = "synthetic-classification"
samples = 256
validation_samples = 0
features = 8
classes = 4
micro_batch = 8

[optimizer]
name = "sgd"
lr = 0.1
momentum = 0.9
)";

namespace {

/// Two epochs of a small MLP with validation: every event occurs.
const char* const kContractRecipe = R"(
[run]
seed = 5
epochs = 2
dtype = "float32"

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

Parameters parameters_of(Model& m) {
  Parameters out;
  for (const auto& p : m.named_parameters()) out.emplace(p.key(), p.value().detach().clone());
  return out;
}

at::Tensor flat_grads(Model& m) {
  std::vector<at::Tensor> parts;
  for (const auto& p : m.parameters())
    parts.push_back(p.grad().defined() ? p.grad().detach().reshape({-1}).to(at::kDouble)
                                       : at::zeros({p.numel()}, at::kDouble));
  return at::cat(parts);
}

/// The options of an instance for Trainer::add_plugin: those it was given, else its defaults.
Options options_for(const Plugin& p) {
  return p.options().values().empty() ? defaults_of(p.option_specs()) : p.options();
}

/// A fresh temporary folder for one check.
fs::path scratch(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("tk-contract-" + std::to_string(getpid()) + "-" + name);
  fs::remove_all(d);
  return d;
}

/// A contract that orders a plugin after every gradient plugin.
Contract after_everything() {
  Contract c;
  c.after = {cap::kGradsSynced, cap::kGradsNormalized, cap::kGradsUnscaled, cap::kGradsClipped};
  return c;
}

}  // namespace

RunResult run(const std::string& recipe_toml, const RunOptions& opts) {
  std::string text = recipe_toml;
  for (const auto& [file, options] : opts.libraries)
    text += "\n[[plugins]]\npath = " + to_toml(file.string()) + "\n" + options + "\n";
  Recipe recipe = Recipe::from_string(text, "test-recipe.toml");
  recipe.apply_override("run.trace=true");
  if (!opts.output.empty()) recipe.apply_override("run.output=" + to_toml(opts.output.string()));
  for (const auto& o : opts.overrides) recipe.apply_override(o);
  TrainerOptions t;
  t.write_outputs = !opts.output.empty();
  t.progress = ProgressMode::None;
  std::vector<fs::path> dirs = opts.plugin_dirs;
  for (const auto& d : PluginLoader::default_dirs()) dirs.push_back(d);
  t.plugin_dirs = dirs;
  t.resume = opts.resume;
  t.stop_requested = opts.stop_requested;
  Trainer trainer(std::move(recipe), t);
  for (const auto& p : opts.plugins) trainer.add_plugin(p, options_for(*p));
  RunResult out;
  out.plugin_order = trainer.plugin_order();
  out.fit = trainer.fit();
  out.parameters = parameters_of(trainer.model());
  out.trace = trainer.trace();
  out.warnings = trainer.warnings();
  return out;
}

double max_difference(const Parameters& a, const Parameters& b) {
  if (a.size() != b.size()) return INFINITY;
  double worst = 0.0;
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    if (it == b.end() || it->second.sizes() != t.sizes()) return INFINITY;
    if (t.numel() == 0) continue;
    worst = std::max(worst, (t.to(at::kDouble) - it->second.to(at::kDouble)).abs().max().item<double>());
  }
  return worst;
}

Capture::Capture() { set_name("capture"); }
Contract Capture::contract() const { return after_everything(); }
void Capture::on_micro_batch(Context& ctx) { windows.push_back(ctx.window()); }
void Capture::on_boundary(Context& ctx) {
  grads.push_back(flat_grads(ctx.model()));
  lrs.push_back(ctx.lr());
  window_sizes.push_back(ctx.totals().micro_batches);
}
void Capture::on_step_end(Context& ctx) { window_losses.push_back(ctx.window_loss()); }

VetoAt::VetoAt(std::set<int64_t> steps) : steps_(std::move(steps)) { set_name("veto_at"); }
Contract VetoAt::contract() const { return after_everything(); }
void VetoAt::on_boundary(Context& ctx) {
  if (steps_.count(ctx.counters().step)) ctx.veto_step("vetoed by the test");
}

ThrowAt::ThrowAt(int64_t step) : step_(step) { set_name("throw_at"); }
void ThrowAt::on_backward(Context& ctx) {
  if (ctx.counters().step == step_) throw std::runtime_error("injected failure");
}

std::vector<CheckResult> check_contract(const fs::path& file, const ContractOptions& c) {
  std::vector<CheckResult> out;
  auto check = [&](const std::string& name, const std::function<std::string()>& fn) {
    CheckResult r{name, false, ""};
    try {
      r.detail = fn();
    } catch (const std::exception& e) {
      r.detail = std::string("threw: ") + e.what();
    }
    r.passed = r.detail.empty();
    out.push_back(std::move(r));
  };
  const PluginLoader loader({});
  // A new instance with the options given as TOML.
  auto instance = [&](const std::string& toml) {
    auto p = loader.load_plugin(file).plugin;
    const Options o = parse_options(toml, p->option_specs(), "plugins." + p->name());
    p->set_options(o);
    p->init(o);
    return p;
  };
  auto run_with = [&](std::vector<std::shared_ptr<Plugin>> plugins) {
    RunOptions o;
    o.plugins = std::move(plugins);
    return run(kContractRecipe, o);
  };

  check("loads and names itself", [&]() -> std::string {
    auto lp = loader.load_plugin(file);
    if (lp.name.empty()) return "its name is empty";
    if (lp.version.empty()) return "its version is empty";
    if (lp.plugin->name() != lp.name) return "the instance is named '" + lp.plugin->name() + "', not '" + lp.name + "'";
    return "";
  });
  check("declares well-formed, documented options with accepted defaults", [&]() -> std::string {
    auto p = loader.load_plugin(file).plugin;
    std::set<std::string> names;
    for (const auto& s : p->option_specs()) {
      if (s.name.empty()) return "an option has an empty name";
      if (!names.insert(s.name).second) return "option '" + s.name + "' is declared twice";
      if (s.name == "name" || s.name == "path") return "option '" + s.name + "' is reserved for [[plugins]] entries";
      if (s.doc.empty()) return "option '" + s.name + "' has no doc";
      const size_t index = s.type == OptionType::Path ? 3 : static_cast<size_t>(s.type);
      if (s.default_value.index() != index) return "option '" + s.name + "' has a default of another type";
      if (!s.choices.empty() && std::find(s.choices.begin(), s.choices.end(), std::get<std::string>(s.default_value)) ==
                                    s.choices.end())
        return "option '" + s.name + "': its default is not one of its choices";
    }
    instance("");
    return "";
  });
  check("refuses unknown and mistyped options, listing the valid ones", [&]() -> std::string {
    auto p = loader.load_plugin(file).plugin;
    const auto specs = p->option_specs();
    try {
      RunOptions o;
      o.libraries = {{file, "definitely_not_an_option = 1"}};
      run(kTinyRecipe, o);
      return "an unknown option was accepted";
    } catch (const RecipeError& e) {
      const std::string m = e.what();
      if (m.find("unknown key 'definitely_not_an_option'") == std::string::npos) return "unclear error: " + m;
      for (const auto& s : specs)
        if (m.find(s.name) == std::string::npos) return "the error does not list option '" + s.name + "': " + m;
    }
    for (const auto& s : specs) {
      const bool stringy = s.type == OptionType::String || s.type == OptionType::Path;
      const std::string wrong = stringy ? "1" : "\"not a " + std::string(to_string(s.type)) + "\"";
      try {
        parse_options(s.name + " = " + wrong, specs, "plugins." + p->name());
        return "option '" + s.name + "' accepted " + wrong;
      } catch (const RecipeError& e) {
        if (std::string(e.what()).find("expected") == std::string::npos) return "unclear error: " + std::string(e.what());
      }
    }
    return "";
  });
  check("runs every hook it keeps in a run with two epochs and validation", [&]() -> std::string {
    auto p = instance(c.options);
    auto r = run_with({p});
    for (int i = 0; i < kEventCount; ++i) {
      const auto e = static_cast<Event>(i);
      if (!p->handles(e)) continue;
      const bool seen = std::any_of(r.trace.begin(), r.trace.end(),
                                    [&](const TraceEntry& t) { return t.event == e && t.plugin == p->name(); });
      if (!seen) return std::string("its ") + to_string(e) + " hook never ran";
    }
    if (r.fit.steps < 1) return "the run took no step";
    for (const auto& [name, t] : r.parameters)
      if (!at::isfinite(t).all().item<bool>()) return "parameter " + name + " is not finite";
    for (double l : r.fit.window_losses)
      if (!std::isfinite(l)) return "a window loss is not finite";
    return "";
  });
  check("round-trips its state into a fresh instance", [&]() -> std::string {
    auto p = instance(c.options);
    run_with({p});
    const StateDict saved = p->state();
    auto fresh = instance(c.options);
    fresh->load_state(saved);
    const StateDict again = fresh->state();
    if (again.size() != saved.size()) return "the state has " + std::to_string(again.size()) + " entries after loading " +
                                              std::to_string(saved.size());
    for (const auto& [k, v] : saved) {
      auto it = again.find(k);
      if (it == again.end() || !it->second.equal(v)) return "state entry '" + k + "' did not round-trip";
    }
    return "";
  });
  check("leaves a run bit-identical with neutral options", [&]() -> std::string {
    if (!c.check_neutral) return "";  // declared: it always changes the numerics
    auto without = run_with({});
    auto with = run_with({instance(c.neutral)});
    if (without.fit.steps != with.fit.steps)
      return std::to_string(with.fit.steps) + " steps instead of " + std::to_string(without.fit.steps);
    const double d = max_difference(without.parameters, with.parameters);
    return d == 0.0 ? "" : "the parameters differ by up to " + std::to_string(d);
  });
  check("a run stopped at a checkpoint and resumed equals an uninterrupted one", [&]() -> std::string {
    const fs::path a = scratch("whole"), b = scratch("resumed");
    RunOptions whole;
    whole.plugins = {instance(c.options)};
    whole.output = a;
    auto full = run(kContractRecipe, whole);
    RunOptions first = whole;
    first.plugins = {instance(c.options)};
    first.output = b;
    int boundaries = 0;
    first.stop_requested = [&boundaries] { return ++boundaries == 3; };
    auto stopped = run(kContractRecipe, first);
    RunOptions second = first;
    second.plugins = {instance(c.options)};
    second.stop_requested = nullptr;
    second.resume = "latest";
    auto resumed = run(kContractRecipe, second);
    fs::remove_all(a);
    fs::remove_all(b);
    if (stopped.fit.status != FitStatus::StoppedBySignal) return "the first half did not stop at its third boundary";
    const double d = max_difference(full.parameters, resumed.parameters);
    return d == 0.0 ? "" : "the resumed run's parameters differ by up to " + std::to_string(d);
  });
  check("survives a vetoed step", [&]() -> std::string {
    auto r = run_with({instance(c.options), std::make_shared<VetoAt>(std::set<int64_t>{1})});
    if (r.fit.skipped_steps < 1) return "the vetoed step was not skipped";
    for (const auto& [name, t] : r.parameters)
      if (!at::isfinite(t).all().item<bool>()) return "parameter " + name + " is not finite";
    return "";
  });
  check("gets on_fit_end after another plugin fails, and the first error stands", [&]() -> std::string {
    try {
      run_with({instance(c.options), std::make_shared<ThrowAt>(2)});
      return "the run did not fail";
    } catch (const PluginRuntimeError& e) {
      const std::string m = e.what();
      if (m.find("plugin 'throw_at' failed in event backward at step 2") != 0) return "another error stood: " + m;
    }
    return "";
  });
  return out;
}

}  // namespace tk::testing
