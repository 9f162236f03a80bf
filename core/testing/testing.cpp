// trainkit::testing: in-process runs, fixtures and the plugin contract checks.
#include "tk/testing.h"

#include <unistd.h>

#include <algorithm>

#include "api/api.h"
#include "tk/loader.h"

namespace fs = std::filesystem;

namespace tk::testing {

using detail::ContextAccess;

namespace {

void apply(detail::PlanState* plan, const PlanSettings& p) {
  plan->micro_batch = p.micro_batch;
  plan->accumulation = p.accumulation;
  plan->last_window = p.last_window;
  plan->world_size = p.world_size;
  plan->rank = p.rank;
  plan->reduction = p.reduction;
  plan->device = p.device;
  plan->capabilities = p.capabilities;
}

detail::LoopState* new_state(Model& model, torch::optim::Optimizer& optimizer, const PlanSettings& p) {
  auto* s = new detail::LoopState;
  auto* plan = new detail::PlanState;
  apply(plan, p);
  s->plan = plan;
  s->model = &model;
  s->optimizer = &optimizer;
  return s;
}

}  // namespace

ManualContext::ManualContext(Model& model, torch::optim::Optimizer& optimizer, const PlanSettings& plan)
    : Context(new_state(model, optimizer, plan)) {}

ManualContext::~ManualContext() {
  detail::LoopState* s = &ContextAccess::state(*this);
  delete s->plan;
  delete s;
}

Counters& ManualContext::mutable_counters() noexcept { return ContextAccess::state(*this).counters; }
void ManualContext::set_window(const Window& w) noexcept { ContextAccess::state(*this).window = w; }
void ManualContext::set_batch(const Batch* b) noexcept { ContextAccess::state(*this).batch = b; }
void ManualContext::set_loss_value(double v) noexcept {
  auto& s = ContextAccess::state(*this);
  s.loss_value = v;
  s.loss_read = true;
}
void ManualContext::set_window_loss(double v) noexcept { ContextAccess::state(*this).window_loss = v; }
void ManualContext::set_validation_loss(double v) noexcept { ContextAccess::state(*this).validation_loss = v; }
void ManualContext::set_lr(double v) noexcept { ContextAccess::state(*this).lr = v; }
void ManualContext::set_status(FitStatus st) noexcept { ContextAccess::state(*this).status = st; }
void ManualContext::set_output_dir(std::filesystem::path d) { ContextAccess::state(*this).output_dir = std::move(d); }
void ManualContext::set_log(std::function<void(int, const std::string&)> log) {
  ContextAccess::state(*this).d.log = std::move(log);
}
const std::vector<std::pair<std::string, double>>& ManualContext::metrics() const noexcept {
  return ContextAccess::state(*this).step.metrics;
}
double ManualContext::metric_value(const std::string& name) const {
  for (const auto& [k, v] : metrics())
    if (k == name) return v;
  return std::nan("");
}
const std::string& ManualContext::veto_reason() const noexcept { return ContextAccess::state(*this).step.veto_reason; }
const std::string& ManualContext::vetoed_by() const noexcept { return ContextAccess::state(*this).step.vetoed_by; }
void ManualContext::clear_step() { ContextAccess::state(*this).step.clear(); }

void ManualContext::call(Plugin& p, Event e) {
  auto& s = ContextAccess::state(*this);
  s.d.enter(p.name(), hook_name(e), e);
  try {
    dispatch(p, e, *this);
  } catch (...) {
    s.d.leave();
    throw;
  }
  s.d.leave();
  if (e == Event::Boundary) s.read_step_values();
}

struct ManualPlan::Impl {
  detail::Dispatch dispatch;
  detail::PlanState plan;
};

ManualPlan::ManualPlan(const PlanSettings& settings) : impl_(std::make_unique<Impl>()) {
  apply(&impl_->plan, settings);
  impl_->plan.dispatch = &impl_->dispatch;
}
ManualPlan::~ManualPlan() = default;

void ManualPlan::configure(Plugin& p) {
  impl_->dispatch.enter(p.name(), "configure");
  try {
    p.configure(impl_->plan.view);
  } catch (...) {
    impl_->dispatch.leave();
    throw;
  }
  impl_->dispatch.leave();
}

const RunPlan& ManualPlan::plan() const noexcept { return impl_->plan.view; }

std::shared_ptr<Plugin> load_plugin(const std::filesystem::path& file, const std::string& options) {
  auto p = PluginLoader({}).load_plugin(file).plugin;
  const std::string context = "plugins." + p->name();
  detail::configure_options(*p, [&](const OptionSpecs& specs) { return parse_options(options, specs, context); });
  return p;
}

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
  t.overwrite = opts.overwrite;
  t.allow_changes = opts.allow_changes;
  t.stop_requested = opts.stop_requested;
  Trainer trainer(std::move(recipe), t);
  for (const auto& p : opts.plugins) trainer.add_plugin(p.plugin, p.name, p.options, p.hooks);
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

Contract Capture::contract() const { return after_everything(); }
void Capture::on_micro_batch(Context& ctx) { windows.push_back(ctx.window()); }
void Capture::on_boundary(Context& ctx) {
  grads.push_back(flat_grads(ctx.model()));
  lrs.push_back(ctx.lr());
  window_sizes.push_back(ctx.totals().micro_batches);
}
void Capture::on_step_end(Context& ctx) { window_losses.push_back(ctx.window_loss()); }

VetoAt::VetoAt(std::set<int64_t> steps) : steps_(std::move(steps)) {}
Contract VetoAt::contract() const { return after_everything(); }
void VetoAt::on_boundary(Context& ctx) {
  if (steps_.count(ctx.counters().step)) ctx.veto_step("vetoed by the test");
}

ThrowAt::ThrowAt(int64_t step) : step_(step) {}
void ThrowAt::on_backward(Context& ctx) {
  if (ctx.counters().step == step_) throw std::runtime_error("injected failure");
}

namespace {

/// The contract's checks of one library, each returning "" when it holds, else why not.
class ContractChecks {
 public:
  ContractChecks(const fs::path& file, const ContractOptions& c) : file_(file), c_(c) {}

  std::string loads_and_names_itself() const {
    auto lp = PluginLoader({}).load_plugin(file_);
    if (lp.name.empty()) return "its name is empty";
    if (lp.version.empty()) return "its version is empty";
    if (lp.plugin->name() != lp.name) return "the instance is named '" + lp.plugin->name() + "', not '" + lp.name + "'";
    Registry registry;
    PluginLoader({}).load(file_, registry);
    if (registry.plugins().front().doc.empty()) return "it registers no description (TK_PLUGIN's fourth argument)";
    instance("");  // its defaults are accepted
    return "";
  }

  std::string refuses_bad_options() const {
    const auto specs = fresh_specs();
    try {
      RunOptions o;
      o.libraries = {{file_, "definitely_not_an_option = 1"}};
      run(kTinyRecipe, o);
      return "an unknown option was accepted";
    } catch (const RecipeError& e) {
      const std::string m = e.what();
      if (m.find("unknown key 'definitely_not_an_option'") == std::string::npos) return "unclear error: " + m;
      for (const auto& s : specs)
        if (m.find(s.name) == std::string::npos) return "the error does not list option '" + s.name + "': " + m;
    }
    for (const auto& s : specs) {
      // A list of strings also takes one string (a list of one): a number is mistyped for it.
      const bool stringy = s.type == OptionType::String || s.type == OptionType::Path || s.type == OptionType::StringList;
      const std::string wrong = stringy ? "1" : "\"not a " + std::string(to_string(s.type)) + "\"";
      try {
        instance(s.name + " = " + wrong);
        return "option '" + s.name + "' accepted " + wrong;
      } catch (const RecipeError& e) {
        if (std::string(e.what()).find("expected") == std::string::npos) return "unclear error: " + std::string(e.what());
      }
    }
    return "";
  }

  std::string runs_every_hook() const {
    auto p = instance(c_.options);
    auto r = run_with({p});
    for (int i = 0; i < kEventCount; ++i) {
      const auto e = static_cast<Event>(i);
      if (!p->handles(e)) continue;
      const bool seen = std::any_of(r.trace.begin(), r.trace.end(),
                                    [&](const TraceEntry& t) { return t.event == e && t.plugin == p->name(); });
      if (!seen) return std::string("its ") + hook_name(e) + " hook never ran";
    }
    if (r.fit.steps < 1) return "the run took no step";
    return finite(r);
  }

  std::string round_trips_state() const {
    auto p = instance(c_.options);
    run_with({p});
    auto fresh = instance(c_.options);
    fresh->load_state(p->state());
    return same_state(p->state(), fresh->state(), "after loading it into a fresh instance");
  }

  std::string neutral_is_bit_identical() const {
    auto without = run_with({});
    auto with = run_with({instance(c_.neutral)});
    if (without.fit.steps != with.fit.steps)
      return std::to_string(with.fit.steps) + " steps instead of " + std::to_string(without.fit.steps);
    const double d = max_difference(without.parameters, with.parameters);
    return d == 0.0 ? "" : "the parameters differ by up to " + std::to_string(d);
  }

  std::string resume_equals_uninterrupted() const {
    const fs::path a = scratch("whole"), b = scratch("resumed");
    auto whole_plugin = instance(c_.options);
    RunOptions whole;
    whole.plugins = {whole_plugin};
    whole.output = a;
    auto full = run(kContractRecipe, whole);
    RunOptions first = whole;
    first.plugins = {instance(c_.options)};
    first.output = b;
    int boundaries = 0;
    first.stop_requested = [&boundaries] { return ++boundaries == 3; };
    auto stopped = run(kContractRecipe, first);
    auto resumed_plugin = instance(c_.options);
    RunOptions second = first;
    second.plugins = {resumed_plugin};
    second.stop_requested = nullptr;
    second.resume = "latest";
    auto resumed = run(kContractRecipe, second);
    fs::remove_all(a);
    fs::remove_all(b);
    if (stopped.fit.status != FitStatus::StoppedBySignal) return "the first half did not stop at its third boundary";
    const double d = max_difference(full.parameters, resumed.parameters);
    if (d != 0.0) return "the resumed run's parameters differ by up to " + std::to_string(d);
    return same_state(whole_plugin->state(), resumed_plugin->state(), "at the end of the resumed run");
  }

  std::string survives_a_veto() const {
    auto r = run_with({instance(c_.options), {std::make_shared<VetoAt>(std::set<int64_t>{1}), "veto_at"}});
    if (r.fit.skipped_steps < 1) return "the vetoed step was not skipped";
    return finite(r);
  }

  std::string fit_end_after_failure() const {
    try {
      run_with({instance(c_.options), {std::make_shared<ThrowAt>(2), "throw_at"}});
      return "the run did not fail";
    } catch (const PluginRuntimeError& e) {
      const std::string m = e.what();
      if (m.find("plugin 'throw_at' failed in event backward at step 2") != 0) return "another error stood: " + m;
    }
    return "";
  }

 private:
  /// A new instance with the options given as TOML.
  std::shared_ptr<Plugin> instance(const std::string& toml) const { return load_plugin(file_, toml); }
  OptionSpecs fresh_specs() const {
    auto p = PluginLoader({}).load_plugin(file_).plugin;
    return detail::declared_options(*p);
  }
  RunResult run_with(std::vector<InProcess> plugins) const {
    RunOptions o;
    o.plugins = std::move(plugins);
    return run(kContractRecipe, o);
  }
  static std::string finite(const RunResult& r) {
    for (const auto& [name, t] : r.parameters)
      if (!at::isfinite(t).all().item<bool>()) return "parameter " + name + " is not finite";
    for (double l : r.fit.window_losses)
      if (!std::isfinite(l)) return "a window loss is not finite";
    return "";
  }
  /// "" when two states hold the same entries with the same values.
  static std::string same_state(const StateDict& want, const StateDict& got, const std::string& when) {
    if (got.size() != want.size())
      return "its state has " + std::to_string(got.size()) + " entries " + when + ", expected " + std::to_string(want.size());
    for (const auto& [k, v] : want) {
      auto it = got.find(k);
      if (it == got.end()) return "state entry '" + k + "' is missing " + when;
      const at::Tensor a = v.detach().cpu(), b = it->second.detach().cpu();
      if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes() || !a.equal(b))
        return "state entry '" + k + "' differs " + when;
    }
    return "";
  }

  fs::path file_;
  ContractOptions c_;
};

}  // namespace

std::vector<CheckResult> check_contract(const fs::path& file, const ContractOptions& c) {
  const ContractChecks contract(file, c);
  std::vector<CheckResult> out;
  auto check = [&](const std::string& name, std::string (ContractChecks::*fn)() const) {
    CheckResult r{name, false, false, ""};
    try {
      r.detail = (contract.*fn)();
    } catch (const std::exception& e) {
      r.detail = std::string("threw: ") + e.what();
    }
    r.passed = r.detail.empty();
    out.push_back(std::move(r));
  };
  check("loads, names and describes itself, and accepts its default options", &ContractChecks::loads_and_names_itself);
  if (!out.back().passed) return out;  // nothing else can run
  check("refuses unknown and mistyped options, listing the valid ones", &ContractChecks::refuses_bad_options);
  check("runs every hook it keeps in a run with two epochs and validation", &ContractChecks::runs_every_hook);
  check("round-trips its state into a fresh instance", &ContractChecks::round_trips_state);
  if (c.check_neutral) {
    check("leaves a run bit-identical with neutral options", &ContractChecks::neutral_is_bit_identical);
  } else {
    out.push_back({"leaves a run bit-identical with neutral options", false, true,
                   "--neutral none: the plugin always changes the numerics"});
  }
  check("a run stopped at a checkpoint and resumed equals an uninterrupted one, its state included",
        &ContractChecks::resume_equals_uninterrupted);
  check("survives a vetoed step", &ContractChecks::survives_a_veto);
  check("gets on_fit_end after another plugin fails, and the first error stands", &ContractChecks::fit_end_after_failure);
  return out;
}

}  // namespace tk::testing
