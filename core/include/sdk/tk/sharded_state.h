#pragma once
/// An optimizer whose state is spread over the ranks of the run's world (the shard plugin's ZeRO
/// optimizer) derives from this too. A checkpoint then holds one file per rank, each written by
/// its own rank at the same time (`optimizer-share-<rank>.pt`), and `optimizer.pt` says how many
/// there are and how they fit together: no rank ever holds another's share, and the writes go in
/// parallel. The folder is moved into place once every rank's share is written, so a checkpoint
/// is whole or absent. Its folder must be one every rank sees (on several machines: a shared
/// filesystem), as it must be for the ranks to resume from it.
#include <cstddef>
#include <cstdint>
#include <functional>

// What this header declares is libtrainkit's interface: exported (the library hides the rest).
#pragma GCC visibility push(default)

namespace at {
class Tensor;
}  // namespace at
namespace torch::serialize {
class InputArchive;
class OutputArchive;
}  // namespace torch::serialize

namespace tk {

class ShardedState {
 public:
  /// Reads share `r` of a checkpoint into `archive`.
  using ShareReader = std::function<void(int64_t r, torch::serialize::InputArchive& archive)>;

  /// This rank's share of the state (every rank, into its own file).
  virtual void save_share(torch::serialize::OutputArchive& share) const = 0;
  /// How the shares fit together (rank 0, into optimizer.pt): which rank held which parameter's
  /// state, say.
  virtual void save_layout(torch::serialize::OutputArchive& layout) const = 0;
  /// Restores the state from a checkpoint's `layout` and its `count` shares, reading only those
  /// that hold state of this rank's parameters: a checkpoint of another world size is cut anew.
  virtual void load_shares(torch::serialize::InputArchive& layout, int64_t count, const ShareReader& read) = 0;

 protected:
  ShardedState() = default;
  ShardedState(const ShardedState&) = default;
  ShardedState& operator=(const ShardedState&) = default;
  virtual ~ShardedState() = default;
};

/// An optimizer whose parameters are whole only on the ranks that update them, and gathered onto
/// the others while they are used (the shard plugin's stage 3), derives from this too. Between
/// uses a parameter that another rank updates has its shape but no memory: reading its values
/// then is an error. Whoever reads every parameter outside a step's forward and backward (the
/// core's checkpoints, a check that the ranks agree) gathers them first, on every rank at the same
/// point (WholeParameters).
class ShardedParameters {
 public:
  /// Makes every parameter whole on this rank: a collective, which every rank calls at the same
  /// point. Nests: each call is undone by one release_parameters(). Const: where a parameter
  /// lives changes, not its value.
  virtual void gather_parameters() const = 0;
  /// Undoes one gather_parameters(): what only that call made whole is freed again (this rank
  /// alone).
  virtual void release_parameters() const = 0;
  /// Whether every parameter is whole on this rank now.
  virtual bool parameters_whole() const = 0;

 protected:
  ShardedParameters() = default;
  ShardedParameters(const ShardedParameters&) = default;
  ShardedParameters& operator=(const ShardedParameters&) = default;
  virtual ~ShardedParameters() = default;
};

/// A ShardedParameters optimizer that is also a ShardedState, and says which rank keeps each
/// parameter between uses (the shard plugin's stage 3), derives from this too. A checkpoint then
/// holds the parameters the way it holds the optimizer state: each rank writes those it keeps
/// into `model-share-<rank>.pt` while rank 0 writes the rest (frozen parameters, buffers) into
/// model.pt, so no rank gathers the whole model to save it. Reading the checkpoint (a resume with
/// any world size, `[model] init` given its model.pt) takes the shares beside model.pt too.
class ParameterKeepers {
 public:
  /// The rank that keeps `param` whole between uses, or -1 for a parameter that is not sharded
  /// (frozen, or any before the sharding starts): rank 0 writes those into model.pt. Every rank
  /// answers the same.
  virtual int64_t keeper_of(const at::Tensor& param) const = 0;

 protected:
  ParameterKeepers() = default;
  ParameterKeepers(const ParameterKeepers&) = default;
  ParameterKeepers& operator=(const ParameterKeepers&) = default;
  virtual ~ParameterKeepers() = default;
};

/// Every parameter whole for the life of this object, given the optimizer (nothing to do for one
/// that does not shard its parameters, or for null):
///     tk::WholeParameters whole(&ctx.optimizer());
class WholeParameters {
 public:
  template <class Optimizer>
  explicit WholeParameters(const Optimizer* optimizer) : sharded_(dynamic_cast<const ShardedParameters*>(optimizer)) {
    if (sharded_) sharded_->gather_parameters();
  }
  explicit WholeParameters(std::nullptr_t) : sharded_(nullptr) {}
  ~WholeParameters() {
    if (sharded_) sharded_->release_parameters();
  }
  WholeParameters(const WholeParameters&) = delete;
  WholeParameters& operator=(const WholeParameters&) = delete;

 private:
  const ShardedParameters* sharded_;
};

}  // namespace tk

#pragma GCC visibility pop
