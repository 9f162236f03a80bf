// The engine's share of data and models: the in-memory data set, the epoch order, and the
// questions the loop asks of any model and optimizer.
#include "tk/data.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/randperm.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "tk/components.h"
#include "tk/error.h"
#include "tk/model.h"

namespace tk {
namespace {

uint64_t mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

std::string DataInfo::describe() const {
  std::string shape = "[";
  for (size_t i = 0; i < input_shape.size(); ++i) shape += (i ? ", " : "") + std::to_string(input_shape[i]);
  shape += "]";
  if (vocab > 0) return "token ids " + shape + " from a vocabulary of " + std::to_string(vocab);
  if (input_shape.size() == 3) return "images " + shape;
  return "features [" + std::to_string(input_dim) + "]";
}

TensorDataset::TensorDataset(at::Tensor inputs, at::Tensor targets, int64_t ignore_index)
    : inputs_(std::move(inputs)), targets_(std::move(targets)), ignore_index_(ignore_index) {
  if (inputs_.size(0) != targets_.size(0))
    throw Error("data set has " + std::to_string(inputs_.size(0)) + " inputs but " +
                std::to_string(targets_.size(0)) + " targets");
  // One look at all the targets here spares each micro-batch its count of the items that count.
  every_item_counts_ = at::isFloatingType(targets_.scalar_type()) || !targets_.eq(ignore_index_).any().item<bool>();
}

Batch TensorDataset::get(const at::Tensor& indices) const {
  Batch b;
  b.input = inputs_.index_select(0, indices);
  b.target = targets_.index_select(0, indices);
  b.samples = indices.size(0);
  if (at::isFloatingType(b.target.scalar_type())) b.tokens = b.samples;
  else if (every_item_counts_) b.tokens = b.target.numel();
  else b.tokens = b.target.ne(ignore_index_).sum().item<int64_t>();
  return b;
}

at::Tensor epoch_order(int64_t n, uint64_t seed, int64_t epoch, bool shuffle) {
  if (!shuffle) return at::arange(n, at::kLong);
  auto gen = at::detail::createCPUGenerator(mix(mix(seed) ^ static_cast<uint64_t>(epoch)));
  return at::randperm(n, gen, at::kLong);
}

ModelWithFlops::~ModelWithFlops() = default;

const ModelWithFlops* flops_of(const Model& model) { return dynamic_cast<const ModelWithFlops*>(&model); }

double train_flops_of(const Model& model, c10::IntArrayRef input_sizes) {
  const ModelWithFlops* with = flops_of(model);
  return with ? with->train_flops(input_sizes) : -1.0;
}

bool has_batchnorm(torch::nn::Module& m) {
  for (const auto& sub : m.modules(/*include_self=*/true))
    if (sub->name().find("BatchNorm") != std::string::npos) return true;
  return false;
}

double get_lr(const torch::optim::Optimizer& opt) { return opt.param_groups().front().options().get_lr(); }
void set_lr(torch::optim::Optimizer& opt, double lr) {
  for (auto& g : opt.param_groups()) g.options().set_lr(lr);
}

namespace {
int64_t bytes_of(std::initializer_list<const at::Tensor*> tensors) {
  int64_t n = 0;
  for (const at::Tensor* t : tensors)
    if (t->defined()) n += static_cast<int64_t>(t->numel()) * static_cast<int64_t>(t->element_size());
  return n;
}
}  // namespace

int64_t optimizer_state_bytes(const torch::optim::Optimizer& opt) {
  if (const auto* sized = dynamic_cast<const StateSize*>(&opt)) return sized->state_bytes();
  using namespace torch::optim;
  int64_t total = 0;
  for (const auto& [key, state] : opt.state()) {
    const OptimizerParamState* s = state.get();
    if (const auto* a = dynamic_cast<const AdamParamState*>(s))
      total += bytes_of({&a->exp_avg(), &a->exp_avg_sq(), &a->max_exp_avg_sq()});
    else if (const auto* w = dynamic_cast<const AdamWParamState*>(s))
      total += bytes_of({&w->exp_avg(), &w->exp_avg_sq(), &w->max_exp_avg_sq()});
    else if (const auto* g = dynamic_cast<const SGDParamState*>(s))
      total += bytes_of({&g->momentum_buffer()});
    else if (const auto* d = dynamic_cast<const AdagradParamState*>(s))
      total += bytes_of({&d->sum()});
    else if (const auto* m = dynamic_cast<const RMSpropParamState*>(s))
      total += bytes_of({&m->square_avg(), &m->momentum_buffer(), &m->grad_avg()});
    else
      return -1;
  }
  return total;
}

}  // namespace tk
