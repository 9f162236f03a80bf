#pragma once
// The world layer: the processes of a run (tk/world.h), made from the launcher's environment and
// joined over c10d (a TCPStore rendezvous, ProcessGroupGloo on CPU, ProcessGroupNCCL on CUDA where
// LibTorch has it). Not installed.
#include <c10/core/Device.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "support/support.h"
#include "tk/options.h"
#include "tk/world.h"

namespace c10d {
class Store;
}  // namespace c10d

namespace tk::detail {

/// The recipe's [world] section: its option specs.
OptionSpecs world_specs();
/// The [world] section's waits, in seconds, each checked to be bounded (more than 0, at most a week;
/// a recipe error at its line otherwise).
struct WorldWaits {
  double collective = 0.0, rendezvous = 0.0;
};
WorldWaits world_waits(const Options& settings);

/// The world of a run: described from the environment when the run is assembled, joined when it
/// is planned.
class ProcessWorld final : public World {
 public:
  explicit ProcessWorld(Placement placement);
  ~ProcessWorld() override;

  int rank() const noexcept override { return p_.rank; }
  int size() const noexcept override { return p_.size; }
  int local_rank() const noexcept override { return p_.local_rank; }
  const std::string& backend() const noexcept override { return backend_; }
  bool joined() const noexcept override { return group_ != nullptr; }
  std::chrono::milliseconds timeout() const noexcept override { return timeout_; }
  void all_reduce(at::Tensor& t, ReduceOp op) override;
  void broadcast(at::Tensor& t, int root) override;
  at::Tensor all_gather(const at::Tensor& t) override;
  at::Tensor reduce_scatter(const at::Tensor& t, ReduceOp op) override;
  void barrier() override;
  c10::intrusive_ptr<c10d::ProcessGroup> process_group() override;
  c10::intrusive_ptr<c10d::ProcessGroup> side_group(const std::string& purpose) override;

  /// Settles how the world joins, from the recipe's [world] `settings` and the run's `device`:
  /// the backend ("auto": nccl on CUDA, gloo on the CPU), the timeouts, where small collectives
  /// run. Refuses a backend the device or this LibTorch cannot use, naming the recipe line. With
  /// `may_join` false (a dry run, which plans rank 0 alone) it never joins.
  void configure(const Options& settings, at::Device device, bool may_join);
  /// While join() waits for the other ranks it asks `stop` ten times a second: true gives up the
  /// wait at once (a RunRefused: nothing was trained), where the rendezvous would otherwise wait
  /// out rendezvous_timeout_s for a rank that never comes (a job stopped while it starts).
  void stop_waiting_when(std::function<bool()> stop) { stop_ = std::move(stop); }
  /// Joins the other ranks, once, when first needed (a collective, the process group): the
  /// rendezvous at MASTER_ADDR:MASTER_PORT within [world] rendezvous_timeout_s, then the process
  /// group. Nothing in a world of one, before configure() or when it may not join.
  void join();
  /// Leaves: the process group and this join's store are released (at the end of the run); the
  /// process keeps its rendezvous store for the next join.
  void leave() noexcept;
  /// "rank 1 of 2 (RANK/WORLD_SIZE, gloo, rendezvous 127.0.0.1:29500)", for the log and the plan
  /// (the backend once configured).
  std::string describe() const;

 private:
  /// A process group of the backend over `store`.
  c10::intrusive_ptr<c10d::ProcessGroup> make_group(const c10::intrusive_ptr<c10d::Store>& store);

  Placement p_;
  std::string backend_ = "none";
  std::chrono::milliseconds timeout_{300000}, rendezvous_timeout_{300000};
  bool may_join_ = false;
  std::function<bool()> stop_;
  at::Device device_ = at::kCPU;  // where small collectives run (NCCL needs the GPU)
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::map<std::string, c10::intrusive_ptr<c10d::ProcessGroup>> side_groups_;
};

}  // namespace tk::detail
