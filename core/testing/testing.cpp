// trainkit::testing: in-process runs, fixtures and the plugin contract checks.
#include "tk/testing.h"

#include <algorithm>
#include <cmath>

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

[batch]
micro_batch = 8

[optimizer]
name = "sgd"
lr = 0.1
momentum = 0.9
)";

namespace {

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
void Capture::on_micro_batch(MicroBatchContext& ctx) {
  if (!ctx.trial()) windows.push_back(ctx.window());
}
void Capture::on_boundary(BoundaryContext& ctx) {
  if (ctx.trial()) return;  // what it records is the run's steps
  grads.push_back(flat_grads(ctx.model()));
  lrs.push_back(ctx.lr());
  window_sizes.push_back(ctx.totals().micro_batches);
}
void Capture::on_step_end(StepEndContext& ctx) {
  if (!ctx.trial()) window_losses.push_back(ctx.window_loss());
}

VetoAt::VetoAt(std::set<int64_t> steps) : steps_(std::move(steps)) {}
Contract VetoAt::contract() const { return after_everything(); }
void VetoAt::on_boundary(BoundaryContext& ctx) {
  if (!ctx.trial() && steps_.count(ctx.counters().step)) ctx.veto_step("vetoed by the test");
}

ThrowAt::ThrowAt(int64_t step) : step_(step) {}
void ThrowAt::on_backward(BackwardContext& ctx) {
  if (!ctx.trial() && ctx.counters().step == step_) throw std::runtime_error("injected failure");
}

}  // namespace tk::testing
