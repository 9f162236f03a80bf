#pragma once
/// The blocks of a model: the stages of its forward that each map one tensor to one tensor using
/// the parameters of some of its submodules (a Transformer's blocks, an MLP's layers). A model
/// lists them once, as it builds them, and runs each through Blocks::run; a plugin can then change
/// how a block runs (recompute it in backward, say) without the model's code knowing.
///
///     class Net : public tk::Model, public tk::ModelWithBlocks {
///      public:
///       Net() {
///         for (int i = 0; i < 4; ++i) {
///           const std::string name = "layer" + std::to_string(i);
///           std::shared_ptr<torch::nn::LinearImpl> layer = register_module(name, torch::nn::Linear(64, 64));
///           blocks_.add(name, {layer}, [layer](const at::Tensor& x) { return at::tanh(layer->forward(x)); });
///         }
///         head_ = register_module("head", torch::nn::Linear(64, 10));
///       }
///       at::Tensor forward(const at::Tensor& x) override {
///         at::Tensor h = x;
///         for (size_t i = 0; i < blocks_.size(); ++i) h = blocks_.run(i, h);
///         return head_->forward(h);
///       }
///       tk::Blocks& blocks() override { return blocks_; }
///      private:
///       tk::Blocks blocks_;
///       torch::nn::Linear head_{nullptr};
///     };
///
/// A block's function may be called again later, in backward (recomputation): it must hold by
/// value what it uses (modules, options), never references to the caller's locals, and compute
/// only from its input, its modules' parameters and buffers, and the random generators.
#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

// What this header declares is libtrainkit's interface: exported (the library hides the rest).
#pragma GCC visibility push(default)

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace tk {

class Model;

/// One block's computation: its input to its output.
using BlockFn = std::function<at::Tensor(const at::Tensor&)>;
/// How a block is run in place of calling its function: `fn` computes the block; `index` is the
/// block's position in its Blocks.
using BlockRunner = std::function<at::Tensor(size_t index, const at::Tensor& input, const BlockFn& fn)>;

/// A model's blocks, in the order its forward runs them.
class Blocks {
 public:
  /// Adds a block: its name (the module path of its main submodule, "blocks.3"), the submodules
  /// whose parameters and buffers its function uses, and the function. Names are unique.
  void add(std::string name, std::vector<std::shared_ptr<torch::nn::Module>> modules, BlockFn fn);

  size_t size() const noexcept { return blocks_.size(); }
  bool empty() const noexcept { return blocks_.empty(); }
  const std::string& name(size_t i) const { return blocks_.at(i).name; }
  const std::vector<std::shared_ptr<torch::nn::Module>>& modules(size_t i) const { return blocks_.at(i).modules; }
  /// The parameters of block i's modules (each once).
  std::vector<at::Tensor> parameters(size_t i) const;
  /// The buffers of block i's modules (each once).
  std::vector<at::Tensor> buffers(size_t i) const;

  /// Runs block i on `input`: its function, or the runner set for the blocks, if any, which the
  /// block's function is given to.
  at::Tensor run(size_t i, const at::Tensor& input) const {
    const Entry& b = blocks_.at(i);
    return runner_ && b.through_runner ? runner_(i, input, b.fn) : b.fn(input);
  }

  /// Runs the blocks whose `selected` entry is true through `runner`; the others as before.
  /// `selected` has one entry per block. A null runner runs every block directly again. This is
  /// how a block computes (recomputed, say): one plugin sets it (capability "model.blocks.runner").
  void set_runner(BlockRunner runner, const std::vector<bool>& selected);
  /// Runs every block through `around`, whose function is the block as set_runner's runner (if
  /// any) runs it: what a block needs around its computation however it computes (the shard
  /// plugin's stage 3 gathers the block's parameters before it and frees them after). One plugin
  /// sets it (capability "model.blocks.around"); a null one removes it. Either setter keeps what
  /// the other set.
  void set_around(BlockRunner around);
  /// Whether block i runs through a runner (set_runner's, or set_around's, which every block does).
  bool runs_through_runner(size_t i) const { return runner_ && blocks_.at(i).through_runner; }

 private:
  struct Entry {
    std::string name;
    std::vector<std::shared_ptr<torch::nn::Module>> modules;
    BlockFn fn;
    bool through_runner = false;
  };
  std::vector<Entry> blocks_;
  BlockRunner runner_;
};

/// A model whose forward runs tk::Blocks: implement it next to tk::Model (multiple inheritance) to
/// let plugins such as recompute act on the blocks. The built-in GPT, MLP and CNN do.
class ModelWithBlocks {
 public:
  virtual Blocks& blocks() = 0;

 protected:
  ModelWithBlocks() = default;
  ModelWithBlocks(const ModelWithBlocks&) = default;
  ModelWithBlocks& operator=(const ModelWithBlocks&) = default;
  virtual ~ModelWithBlocks();
};

/// The blocks of `model` when it implements ModelWithBlocks, else null.
Blocks* blocks_of(Model& model);

}  // namespace tk

#pragma GCC visibility pop
