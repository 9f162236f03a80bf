#pragma once
// ZeRO stage 1: the optimizer's state split across the ranks of the run's world. Each rank builds
// the recipe's optimizer over its own share of the parameters (whole tensors), steps it on the
// gradients summed across ranks (by ddp; at stage 2 onto their owners alone, grad_shards.h), and
// broadcasts the parameters it updated to the others.
#include <c10/util/intrusive_ptr.h>
#include <torch/optim/optimizer.h>
#include <tk/components.h>
#include <tk/context.h>
#include <tk/sharded_state.h>
#include <tk/world.h>

#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "param_shards.h"

namespace tk::shard {

/// Bytes of `t`'s elements.
int64_t bytes_of(const at::Tensor& t);

/// The rank that owns each of `params`: whole tensors, the largest first, each to the rank that
/// holds the fewest bytes so far (ties: the lowest rank). Every rank computes the same partition
/// from the same model.
std::vector<int> partition(const std::vector<at::Tensor>& params, int world);

/// The same in contiguous runs of model order (stage 2, whose gradients are summed in buckets of
/// one owner's neighbouring parameters: few buckets): rank r takes the tensors whose middle byte
/// falls in the r-th of `world` equal stretches of all the bytes, each rank at least one tensor.
std::vector<int> contiguous_partition(const std::vector<at::Tensor>& params, int world);

/// The run's optimizer under ZeRO stage 1. Its one parameter group lists every trainable
/// parameter (the core sets the learning rate and zeroes gradients through it); the optimizer it
/// holds is the recipe's, over this rank's share only. A checkpoint holds every rank's share, each
/// written by its own rank (save_share(), tk/sharded_state.h); save() gathers them all to rank 0
/// instead, for a caller that wants one archive. Loading re-shards exactly: a resume with another
/// world size, or from an unsharded checkpoint, gives each parameter the state it was saved with.
///
/// At stage 3 the step updates this rank's parameters and broadcasts nothing: the others gather
/// them when they use them (param_shards.h, attach()).
class ShardedOptimizer final : public torch::optim::Optimizer,
                               public tk::StateSize,
                               public tk::ShardedState,
                               public tk::ShardedParameters,
                               public tk::ParameterKeepers {
 public:
  /// Refuses an optimizer whose step is not one per parameter (LBFGS). Over the ranks of `world`,
  /// which outlives it (the run's), for the shard plugin's `stage` (1: partition(), 2:
  /// contiguous_partition()); `params` are at least as many as the ranks (the plugin refuses
  /// fewer at its recipe line).
  static std::unique_ptr<ShardedOptimizer> make(std::vector<at::Tensor> params, tk::World& world,
                                                tk::OptimizerFactory inner, int stage);
  /// Stage 3: where the parameters of other ranks live between uses.
  void attach(std::shared_ptr<ParameterShards> parameters);
  void gather_parameters() const override;
  void release_parameters() const override;
  bool parameters_whole() const override;
  /// Its owner, once attach() has sharded the parameters (-1 before, and for a frozen one).
  int64_t keeper_of(const at::Tensor& param) const override;

  at::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;
  void save_share(torch::serialize::OutputArchive& share) const override;
  void save_layout(torch::serialize::OutputArchive& layout) const override;
  void load_shares(torch::serialize::InputArchive& layout, int64_t count, const ShareReader& read) override;
  int64_t state_bytes() const override;

  const std::vector<int>& owners() const noexcept { return owners_; }
  /// Bytes of the parameters rank `r` updates.
  int64_t owned_bytes(int r) const;
  /// How long the last step's broadcast of the updated parameters took.
  double broadcast_ms() const noexcept { return broadcast_ms_; }

 private:
  ShardedOptimizer(std::vector<at::Tensor> params, std::vector<int> owners, tk::World& world,
                   std::unique_ptr<torch::optim::Optimizer> shard, tk::OptimizerFactory make, int stage);
  /// The device point-to-point messages go on.
  at::Device shard_device() const;
  /// Every rank's share, serialized: all of them on rank 0, none elsewhere.
  std::vector<at::Tensor> gather_shards() const;
  /// Moves the state of this rank's parameters out of `from` (an optimizer over `from_params`,
  /// loaded from a checkpoint) into the shard.
  void adopt(torch::optim::Optimizer& from);
  /// Loads the state of this rank's parameters from the shares of a world of `world` ranks that
  /// updated them as `saved` says; `load_share(r, into)` loads share r into an optimizer over
  /// rank r's saved parameters.
  void load_resharded(int64_t world, const std::vector<int64_t>& saved,
                      const std::function<void(int64_t, torch::optim::Optimizer&)>& load_share);

  std::vector<at::Tensor> params_;               // every trainable parameter, in model order
  std::vector<int> owners_;                      // the rank that updates each
  std::vector<std::vector<at::Tensor>> by_rank_; // each rank's parameters, in model order
  int rank_, world_;
  std::unique_ptr<torch::optim::Optimizer> shard_;
  tk::OptimizerFactory make_;
  tk::World& comm_;
  int stage_;
  std::shared_ptr<ParameterShards> parameters_;  // stage 3, from the fit's start on
  std::map<const c10::TensorImpl*, int> keeper_;   // stage 3: each parameter's owner, once attached
  double broadcast_ms_ = 0.0;
};

}  // namespace tk::shard
