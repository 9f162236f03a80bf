#pragma once
/// The world: the processes that train a run together, this one's rank among them, and the
/// collectives any plugin may use. A service of the core, there from a plugin's configure on, so
/// that planning agrees across ranks and no plugin has to own the process group.
#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <string>

// What this header declares is libtrainkit's interface: exported (the library hides the rest).
#pragma GCC visibility push(default)

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace tk {

/// How a collective combines the ranks' values.
enum class ReduceOp { Sum, Max, Min };

/// The processes of a run. Every rank calls a collective at the same point of the run, with
/// tensors of the same shape and dtype; each waits until every rank has called it (or the world's
/// timeout passes, which fails the run). In a world of one every collective returns its input.
///
/// The world comes from the launcher's environment: tk-run --nproc and torchrun set RANK,
/// WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; Slurm sets SLURM_PROCID, SLURM_NTASKS and
/// SLURM_LOCALID (with MASTER_ADDR and MASTER_PORT given). Without them a run is a world of one.
/// The recipe's [world] section chooses the backend and the timeouts.
class World {
 public:
  virtual ~World();

  /// This process's rank, 0 .. size() - 1.
  virtual int rank() const noexcept = 0;
  /// The number of processes.
  virtual int size() const noexcept = 0;
  /// This process's rank on its machine (its GPU's index on CUDA).
  virtual int local_rank() const noexcept = 0;
  /// The collective backend: "gloo" (CPU), "nccl" (CUDA); "none" in a world of one.
  virtual const std::string& backend() const noexcept = 0;
  /// Whether the processes are connected: false in a world of one, and in a dry run, which plans
  /// rank 0 alone. Unjoined, the collectives combine this rank's values alone (all_gather gives
  /// size() copies of its own).
  virtual bool joined() const noexcept = 0;
  /// How long a collective may wait for the other ranks before the run fails.
  virtual std::chrono::milliseconds timeout() const noexcept = 0;

  /// Combines `t` over all ranks, in place (on any device: the world moves it where its backend
  /// runs and back).
  virtual void all_reduce(at::Tensor& t, ReduceOp op = ReduceOp::Sum) = 0;
  /// Replaces `t` with rank `root`'s, in place.
  virtual void broadcast(at::Tensor& t, int root = 0) = 0;
  /// Every rank's `t` (the same shape on each), concatenated along dimension 0 in rank order.
  virtual at::Tensor all_gather(const at::Tensor& t) = 0;
  /// This rank's part of the combination of every rank's `t`: `t` is split along dimension 0 into
  /// size() equal parts (its first dimension must divide evenly), and rank r gets part r of the
  /// sum (or max, min) over ranks. Where the backend has no reduce-scatter (Gloo), an all-reduce
  /// of the whole tensor, then this rank's part: the same values, twice the traffic of the native
  /// collective.
  virtual at::Tensor reduce_scatter(const at::Tensor& t, ReduceOp op = ReduceOp::Sum) = 0;
  /// Waits until every rank has reached it.
  virtual void barrier() = 0;
  /// The largest `v` any rank passed (a collective).
  int64_t max(int64_t v);
  /// The largest `v` any rank passed (a collective).
  double max(double v);

  /// c10d's process group (null in a world of one or a dry run; the world joins first), for c10d's own machinery: the data-parallel
  /// Reducer, broadcast_coalesced. Prefer the collectives above.
  virtual c10::intrusive_ptr<c10d::ProcessGroup> process_group() = 0;
  /// Another process group over the same ranks, for `purpose`: made when first asked for (every
  /// rank asks for the same purposes in the same order) and kept until the run leaves the world.
  /// Its collectives are ordered among themselves alone, apart from process_group()'s: a plugin
  /// whose collectives come from two sequences that interleave differently on each rank (the
  /// hooks of backward, say) runs one sequence on each. Null where process_group() is.
  virtual c10::intrusive_ptr<c10d::ProcessGroup> side_group(const std::string& purpose);

 protected:
  World() = default;
  World(const World&) = default;
  World& operator=(const World&) = default;
};

}  // namespace tk

#pragma GCC visibility pop
