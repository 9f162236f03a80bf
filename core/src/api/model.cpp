// The questions asked of any model (tk/model.h): its FLOPs, whether it runs as one compiled graph,
// whether it has BatchNorm, its parameters each once.
#include "tk/model.h"

#include "support/support.h"

namespace tk {

ModelWithFlops::~ModelWithFlops() = default;
CompiledModel::~CompiledModel() = default;

const CompiledModel* compiled_of(const Model& model) { return dynamic_cast<const CompiledModel*>(&model); }

const ModelWithFlops* flops_of(const Model& model) { return dynamic_cast<const ModelWithFlops*>(&model); }

double train_flops_of(const Model& model, c10::IntArrayRef input_sizes) {
  const ModelWithFlops* with = flops_of(model);
  return with ? with->train_flops(input_sizes) : -1.0;
}

std::vector<at::Tensor> distinct_tensors(const std::vector<at::Tensor>& tensors) {
  return detail::distinct_tensors(tensors);
}

std::vector<std::pair<std::string, at::Tensor>> distinct_parameters(const torch::nn::Module& module) {
  return detail::distinct_named(module.named_parameters());
}

bool has_batchnorm(torch::nn::Module& m) {
  for (const auto& sub : m.modules(/*include_self=*/true))
    if (sub->name().find("BatchNorm") != std::string::npos) return true;
  return false;
}

}  // namespace tk
