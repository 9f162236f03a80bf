// The run's optimizer, made over the trainable parameters (through the plugins that wrap it), and
// the gradients it steps: released or zeroed after a step, completed before one.
#include <torch/optim/optimizer.h>

#include <map>

#include "assemble/assemble.h"
#include "support/support.h"

namespace tk::detail {

namespace {

/// Refuses a wrapped optimizer whose groups do not list each trainable parameter exactly once.
void check_optimizer_covers(const Run& r, const torch::optim::Optimizer& opt, const std::vector<at::Tensor>& trainable) {
  std::map<const void*, int> seen;
  for (const auto& g : opt.param_groups())
    for (const auto& p : g.params()) ++seen[p.unsafeGetTensorImpl()];
  const std::string who = "the optimizer made through the wrap_optimizer of plugin '" + r.optimizer_wraps.back().first + "'";
  for (const auto& [name, p] : distinct_named(r.model->named_parameters())) {  // a tied parameter once
    if (!p.requires_grad()) continue;
    auto it = seen.find(p.unsafeGetTensorImpl());
    if (it == seen.end())
      throw Error(who + " does not list trainable parameter '" + name +
                  "' in its param_groups: the core sets the learning rate and zeroes gradients through them");
    if (it->second > 1) throw Error(who + " lists parameter '" + name + "' " + std::to_string(it->second) + " times");
    seen.erase(it);
  }
  if (!seen.empty())
    throw Error(who + " lists " + std::to_string(seen.size()) + " tensor(s) that are not trainable parameters of the model (" +
                std::to_string(trainable.size()) + " are)");
}

}  // namespace

void make_optimizer(Run& r) {
  std::vector<at::Tensor> trainable;
  for (const auto& p : distinct_tensors(r.model->parameters()))
    if (p.requires_grad()) trainable.push_back(p);
  if (trainable.empty())
    throw RecipeError(r.model_opts.section_loc(), "model '" + r.model_name + "' has no trainable parameter" +
                (r.model->parameters().empty() ? std::string() : " (every parameter has requires_grad = false)"));
  OptimizerFactory make = [&r](std::vector<at::Tensor> params) { return r.optimizer_maker->make(r.opt_opts, std::move(params)); };
  for (const auto& [plugin, wrap] : r.optimizer_wraps)
    make = [&plugin = plugin, &wrap = wrap, inner = std::move(make)](std::vector<at::Tensor> params) {
      std::unique_ptr<torch::optim::Optimizer> made;
      try {
        made = wrap(std::move(params), inner);
      } catch (const RecipeError&) {
        throw;  // the recipe's optimizer section, located
      } catch (const PluginRuntimeError&) {
        throw;  // an earlier plugin's wrap, named
      } catch (const std::exception& e) {
        throw PluginRuntimeError("plugin '" + plugin + "' could not make the optimizer: " + message_of(e));
      }
      if (!made) throw PluginRuntimeError("plugin '" + plugin + "' made no optimizer (its wrap_optimizer returned null)");
      return made;
    };
  auto made = make(trainable);
  if (!r.optimizer_wraps.empty()) check_optimizer_covers(r, *made, trainable);
  r.optimizer = std::move(made);
}

void clear_grads(Run& r) {
  const bool keep = !r.plan.gradients_kept_by.empty();
  for (auto& group : r.optimizer->param_groups())
    for (auto& p : group.params()) {
      at::Tensor& g = p.mutable_grad();
      if (!keep) {
        g = at::Tensor();
        continue;
      }
      if (!g.defined()) {
        g = at::zeros_like(p, at::MemoryFormat::Preserve);
        continue;
      }
      if (g.requires_grad()) g = g.detach();  // a graph left by create_graph: dropped (detach_ fails on views)
      g.zero_();
    }
}

void complete_grads(Run& r) {
  // Sharded gradients: a rank holds its own part only, which the sharding plugin completed.
  if (r.plan.has(cap::kGradsSharded.name())) return;
  for (auto& group : r.optimizer->param_groups())
    for (auto& p : group.params())
      if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p, at::MemoryFormat::Preserve);
}

}  // namespace tk::detail
