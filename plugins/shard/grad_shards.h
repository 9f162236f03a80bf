#pragma once
// ZeRO stage 2's gradients: each summed over the ranks onto the rank that updates its parameter,
// during backward, and released on every rank as it is sent. Backward's hooks run on one thread
// (the caller's on the CPU, the device's on CUDA): the model is on one device.
#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <tk/blocks.h>
#include <tk/world.h>

#include <memory>
#include <string>
#include <vector>

namespace c10d {
class ProcessGroup;
class Work;
}  // namespace c10d
namespace torch::autograd {
struct Node;
}  // namespace torch::autograd

namespace tk::shard {

/// Each of `params`' first block in `blocks` (-1: of no block, or no blocks), for the buckets'
/// groups: a bucket then holds one block's gradients, so that stage 2's backward holds about one
/// block of whole gradients at a time, and stage 3 can send a block's once backward is through it.
std::vector<int64_t> block_groups(const std::vector<at::Tensor>& params, const tk::Blocks* blocks);

/// The gradients of `params` (every trainable parameter, in model order) split by `owners` (the
/// rank that updates each) over `world`'s ranks. Buckets of up to 25 MiB hold the parameters of
/// one owner and one dtype, in the reverse of model order (about the order backward makes their
/// gradients); with groups, of one group, but a bucket of blocks takes the next block's
/// parameters too while together they stay within 1 MiB (its group is then the earliest
/// block's). In a backward that is armed, a bucket is sent as soon as its gradients are all
/// accumulated and every earlier bucket was sent: flattened, summed onto its owner (a c10d
/// `reduce`), and its gradients released. So every rank sends the same buckets in the same order
/// whatever its branches took; what backward left without a gradient here is sent, as zeros, when
/// it ends. The owner adds each sum to those of the window's earlier backwards and, after the
/// window's last, its parameters get them as their gradients; the other ranks have none.
class GradientShards {
 public:
  /// `names`: each parameter's, for errors. Refuses parameters on more than one device. With
  /// `groups` (one per parameter), a bucket holds parameters of one group only (small blocks
  /// merged, above).
  GradientShards(std::vector<at::Tensor> params, std::vector<std::string> names, const std::vector<int>& owners,
                 tk::World& world, const std::vector<int64_t>& groups = {});
  ~GradientShards();
  GradientShards(const GradientShards&) = delete;
  GradientShards& operator=(const GradientShards&) = delete;

  /// Before a backward: whether it sends its gradients (`send`), whether it opens the window's
  /// sums (`first`: nothing earlier stays) and whether it is the window's `last`.
  void arm(bool send, bool first, bool last);
  /// After that backward: the buckets not yet sent go, in order; after the window's last, this
  /// rank's sums become its parameters' gradients.
  void finish();
  /// From now on a bucket goes not when its gradients are accumulated but when settle() says they
  /// are final, or when backward ends: at points that every rank reaches in the same order (stage
  /// 3, whose gathers in backward are collectives too: a rank waiting for a sum its peer sends
  /// later, while the peer waits for it in a gather, would never go on).
  void send_when_settled() { when_settled_ = true; }
  /// In an armed backward, once backward has gone through block b: sends, in bucket order, the
  /// buckets not yet sent whose group (first block) is b or later: their gradients are final (or
  /// there is none here and zeros go). Those of no block go when backward ends.
  void settle(int64_t b);

  /// The last window's reduces and the time spent in them outside of backward's own compute
  /// (waiting on a peer, and the sends at the end).
  int64_t reduces() const noexcept { return reduces_; }
  double reduce_ms() const noexcept { return reduce_ms_; }
  /// The buckets sent during backward in the last window (the rest went at its end).
  int64_t sent_in_backward() const noexcept { return sent_early_; }

 private:
  struct Bucket {
    int owner;
    std::vector<size_t> params;  // indices into params_
    int64_t numel = 0;
    int64_t waiting = 0;         // gradients not yet accumulated in this backward
    int64_t group = -1;          // its parameters' group (the earliest of its blocks), when given groups
  };
  /// Parameter i's gradient is accumulated (from its grad accumulator's hook).
  void ready(size_t i);
  /// Sends bucket b: its gradients flattened and released, its reduce started.
  void send(size_t b);
  /// Waits for the reduce in flight, and adds its sum to this rank's when it is the owner.
  void complete();

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<size_t> bucket_of_;  // the bucket of each parameter
  std::vector<char> fired_;        // whether each parameter's accumulator ran in this backward
  std::vector<Bucket> buckets_;
  int rank_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;  // null in a world of one
  // The hooks on each parameter's grad accumulator, kept alive until removed.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> hooks_;
  // The backward in progress.
  bool armed_ = false, last_ = false, when_settled_ = false;
  size_t next_ = 0;         // the next bucket to send
  std::vector<char> sent_;  // when settled: which buckets went in this backward
  struct InFlight {
    size_t bucket;
    at::Tensor flat;
    c10::intrusive_ptr<c10d::Work> work;
  };
  std::unique_ptr<InFlight> in_flight_;
  std::vector<at::Tensor> sums_;  // per bucket this rank owns: the window's sums so far
  int64_t reduces_ = 0, sent_early_ = 0;
  double reduce_ms_ = 0.0;
};

}  // namespace tk::shard
