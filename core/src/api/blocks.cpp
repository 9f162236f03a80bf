// A model's blocks (tk/blocks.h): the list a model builds, and the runner plugins set on it.
#include "tk/blocks.h"

#include <torch/nn/module.h>

#include <set>

#include "tk/error.h"
#include "tk/model.h"

namespace tk {
namespace {

template <class Of>
std::vector<at::Tensor> unique_tensors(const std::vector<std::shared_ptr<torch::nn::Module>>& modules, Of of) {
  std::vector<at::Tensor> out;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& m : modules)
    for (const auto& t : of(*m))
      if (seen.insert(t.unsafeGetTensorImpl()).second) out.push_back(t);
  return out;
}

}  // namespace

void Blocks::add(std::string name, std::vector<std::shared_ptr<torch::nn::Module>> modules, BlockFn fn) {
  if (name.empty()) throw Error("a block needs a name (the module path of its submodule)");
  for (const auto& b : blocks_)
    if (b.name == name) throw Error("the model lists two blocks named '" + name + "'");
  if (!fn) throw Error("block '" + name + "' has no function");
  for (const auto& m : modules)
    if (!m) throw Error("block '" + name + "' lists a null module");
  blocks_.push_back({std::move(name), std::move(modules), std::move(fn), false});
}

std::vector<at::Tensor> Blocks::parameters(size_t i) const {
  return unique_tensors(modules(i), [](torch::nn::Module& m) { return m.parameters(); });
}

std::vector<at::Tensor> Blocks::buffers(size_t i) const {
  return unique_tensors(modules(i), [](torch::nn::Module& m) { return m.buffers(); });
}

namespace {

/// The runner of blocks with both set_runner's runner and set_around's: the second around the
/// first. Held as the blocks' one runner, so that a model built against any trainkit header of
/// this ABI runs it; each setter finds the other's part in it.
struct Layered {
  BlockRunner around;
  BlockRunner compute;
  std::vector<bool> selected;  // the blocks `compute` runs
  at::Tensor operator()(size_t i, const at::Tensor& input, const BlockFn& fn) const {
    if (!compute || !selected.at(i)) return around(i, input, fn);
    return around(i, input, [&](const at::Tensor& x) { return compute(i, x, fn); });
  }
};

}  // namespace

void Blocks::set_runner(BlockRunner runner, const std::vector<bool>& selected) {
  if (runner && selected.size() != blocks_.size())
    throw Error("set_runner: " + std::to_string(selected.size()) + " selections for " + std::to_string(blocks_.size()) +
                " blocks");
  if (const Layered* layered = runner_.target<Layered>()) {
    Layered next{layered->around, std::move(runner), selected};
    if (!next.compute) next.selected.assign(blocks_.size(), false);
    runner_ = std::move(next);
    return;  // every block runs through `around`
  }
  runner_ = std::move(runner);
  for (size_t i = 0; i < blocks_.size(); ++i) blocks_[i].through_runner = runner_ && selected[i];
}

void Blocks::set_around(BlockRunner around) {
  BlockRunner compute;
  std::vector<bool> selected(blocks_.size(), false);
  if (const Layered* layered = runner_.target<Layered>()) {
    compute = layered->compute;
    selected = layered->selected;
  } else if (runner_) {
    compute = runner_;
    for (size_t i = 0; i < blocks_.size(); ++i) selected[i] = blocks_[i].through_runner;
  }
  if (!around) {
    runner_ = nullptr;
    for (auto& b : blocks_) b.through_runner = false;
    if (compute) set_runner(std::move(compute), selected);
    return;
  }
  runner_ = Layered{std::move(around), std::move(compute), std::move(selected)};
  for (auto& b : blocks_) b.through_runner = true;
}

ModelWithBlocks::~ModelWithBlocks() = default;

Blocks* blocks_of(Model& model) {
  auto* with = dynamic_cast<ModelWithBlocks*>(&model);
  return with ? &with->blocks() : nullptr;
}

}  // namespace tk
