// The Trainer: a run in process, from a recipe to its result.
#include "tk/trainer.h"

#include <c10/util/Exception.h>

#include "assemble/assemble.h"
#include "loop/loop.h"
#include "persist/persist.h"
#include "planning/planning.h"
#include "world/world.h"

namespace tk {
namespace {

/// Rethrows the exception in flight as an object made here, in libtrainkit. An exception object
/// made in a plugin library has its vtable there; the library may be unloaded while the exception
/// propagates (a Trainer destroyed during unwinding releases its libraries).
[[noreturn]] void rethrow_from_core() {
  try {
    throw;
  } catch (const RecipeError& e) {
    throw RecipeError(e);
  } catch (const PluginLoadError& e) {
    throw PluginLoadError(e.what());
  } catch (const RunRefused& e) {
    throw RunRefused(e.what());
  } catch (const PluginRuntimeError& e) {
    throw PluginRuntimeError(e.what());
  } catch (const Error& e) {
    throw Error(e.what());
  } catch (const std::exception& e) {  // LibTorch's among them: one line, no C++ stack
    throw Error(message_of(e));
  }
}

/// The embedder's on_failure, called once however many layers see the same failure (the loop's,
/// before plugins clean up; the Trainer's, for a failure before training).
std::function<void()> once(std::function<void()> f) {
  if (!f) return f;
  auto told = std::make_shared<bool>(false);
  return [f = std::move(f), told] {
    if (*told) return;
    *told = true;
    f();
  };
}

/// A failure of the run: told to the embedder while the run (its world among it) is still whole,
/// then rethrown from libtrainkit. A launcher tells the rank that failed first by that moment:
/// a peer that loses this rank's connections when it exits fails after it.
[[noreturn]] void fail(const TrainerOptions& opts) {
  if (opts.on_failure) opts.on_failure();
  rethrow_from_core();
}

}  // namespace

std::set<std::string> plugin_capabilities(const Recipe& recipe, const TrainerOptions& opts) {
  try {
    return detail::provided_capabilities(recipe, opts);
  } catch (...) {
    rethrow_from_core();
  }
}

double rendezvous_timeout_s(const Recipe& recipe) {
  try {
    return detail::world_waits(recipe.options("world", detail::world_specs())).rendezvous;
  } catch (...) {
    rethrow_from_core();
  }
}

int launch_rank() {
  try {
    return detail::placement_from_environment().rank;
  } catch (const std::exception&) {  // a placement the run itself refuses, by name
    return 0;
  }
}

struct Trainer::Impl {
  Recipe recipe;
  TrainerOptions options;
  detail::Run run;
  std::vector<TraceEntry> trace;
  bool fitted = false;
};

Trainer::Trainer(Recipe recipe, TrainerOptions opts) : impl_(new Impl{std::move(recipe), std::move(opts), {}, {}, false}) {
  impl_->options.on_failure = once(std::move(impl_->options.on_failure));
  try {
    detail::assemble(impl_->run, impl_->recipe, impl_->options);
  } catch (...) {
    fail(impl_->options);
  }
}
Trainer::~Trainer() = default;

void Trainer::add_plugin(std::shared_ptr<Plugin> plugin, const std::string& name, const std::string& options,
                         uint32_t hooks) {
  try {
    detail::add_plugin(impl_->run, std::move(plugin), name, options, hooks);
  } catch (...) {
    rethrow_from_core();
  }
}

std::string Trainer::describe() {
  try {
    std::string plan = detail::describe(impl_->run, impl_->recipe);
    // A dry run (which never resumes) says what the resume would continue, refused as fit() would.
    if (impl_->options.resume && !impl_->run.may_join_world)
      plan += "resume        " + detail::resume_plan(impl_->run, *impl_->options.resume, impl_->options.allow_changes) + "\n";
    return plan;
  } catch (...) {
    fail(impl_->options);
  }
}

/// run.allocator: the CPU block cache holds while the run plans and trains.
static bool block_cache_on(const detail::Run& run) { return run.run.get_string("allocator") == "caching"; }

FitResult Trainer::fit() {
  if (impl_->fitted) throw Error("fit() can run once per Trainer");
  impl_->fitted = true;
  try {
    const detail::CpuBlockCache cache(block_cache_on(impl_->run));
    detail::plan_run(impl_->run);
    return detail::train(impl_->run, impl_->recipe, impl_->options, impl_->trace);
  } catch (...) {
    fail(impl_->options);
  }
}

AccumulationCheck Trainer::verify_accumulation() {
  try {
    const detail::CpuBlockCache cache(block_cache_on(impl_->run));
    detail::plan_run(impl_->run);
    return detail::verify_accumulation(impl_->run);
  } catch (...) {
    fail(impl_->options);
  }
}

Model& Trainer::model() { return *impl_->run.model; }
/// Plans the run (once), a failure told as fail() tells it.
static void plan_or_fail(detail::Run& run, const TrainerOptions& opts) {
  try {
    detail::plan_run(run);
  } catch (...) {
    fail(opts);
  }
}

torch::optim::Optimizer& Trainer::optimizer() {
  plan_or_fail(impl_->run, impl_->options);
  return *impl_->run.optimizer;
}
const RunPlan& Trainer::plan() {
  plan_or_fail(impl_->run, impl_->options);
  return impl_->run.plan.view;
}
const DataSplits& Trainer::data() const { return impl_->run.data; }
const Recipe& Trainer::recipe() const { return impl_->recipe; }
std::string Trainer::resolved_recipe() const { return impl_->run.resolved.toml(impl_->recipe.source()); }
std::filesystem::path Trainer::output_dir() const {
  return impl_->options.write_outputs ? detail::output_dir_of(impl_->run) : std::filesystem::path();
}
const Registry& Trainer::registry() const { return impl_->run.registry; }
const std::vector<TraceEntry>& Trainer::trace() const { return impl_->trace; }
const std::vector<std::string>& Trainer::warnings() const { return impl_->run.warnings; }
std::vector<std::string> Trainer::plugin_order() {
  plan_or_fail(impl_->run, impl_->options);
  std::vector<std::string> out;
  for (size_t i : impl_->run.order) out.push_back(impl_->run.slots[i].name);
  return out;
}

}  // namespace tk
