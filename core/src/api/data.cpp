// The engine's share of data (tk/data.h): what a data set tells, the in-memory data set, the
// epoch order.
#include "tk/data.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/randperm.h>

#include "tk/error.h"

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

}  // namespace tk
