// The Trainer: a run in process, from a recipe to its result.
#include "tk/trainer.h"

#include "run.h"

namespace tk {

struct Trainer::Impl {
  Recipe recipe;
  TrainerOptions options;
  detail::Run run;
  std::vector<TraceEntry> trace;
  bool fitted = false;
};

Trainer::Trainer(Recipe recipe, TrainerOptions opts) : impl_(new Impl{std::move(recipe), std::move(opts), {}, {}, false}) {
  detail::assemble(impl_->run, impl_->recipe, impl_->options);
}
Trainer::~Trainer() = default;

void Trainer::add_plugin(std::shared_ptr<Plugin> plugin, const Options& opts) {
  detail::add_plugin(impl_->run, std::move(plugin), opts);
}

std::string Trainer::describe() { return detail::describe(impl_->run, impl_->recipe); }

FitResult Trainer::fit() {
  if (impl_->fitted) throw Error("fit() can run once per Trainer");
  impl_->fitted = true;
  detail::plan_run(impl_->run);
  return detail::train(impl_->run, impl_->recipe, impl_->options, impl_->trace);
}

Model& Trainer::model() { return *impl_->run.model; }
torch::optim::Optimizer& Trainer::optimizer() {
  detail::plan_run(impl_->run);
  return *impl_->run.optimizer;
}
const RunPlan& Trainer::plan() {
  detail::plan_run(impl_->run);
  return impl_->run.plan;
}
const DataSplits& Trainer::data() const { return impl_->run.data; }
const Recipe& Trainer::recipe() const { return impl_->recipe; }
const Registry& Trainer::registry() const { return impl_->run.registry; }
const std::vector<TraceEntry>& Trainer::trace() const { return impl_->trace; }
const std::vector<std::string>& Trainer::warnings() const { return impl_->run.warnings; }
std::vector<std::string> Trainer::plugin_order() {
  detail::plan_run(impl_->run);
  std::vector<std::string> out;
  for (size_t i : impl_->run.order) out.push_back(impl_->run.slots[i].name);
  return out;
}

}  // namespace tk
