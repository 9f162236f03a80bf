#pragma once
// ZeRO stage 3's parameters: each is whole only on the rank that updates it (its owner). On the
// others its tensor keeps its shape, dtype and autograd identity, but its memory is freed; it is
// gathered (broadcast by its owner into a buffer of the block's parameters, which the parameter's
// storage then points into) while a block's forward or backward uses it, and freed after.
//
// The memory is freed and set under the tensor, in its storage: every view of the parameter that
// autograd saved in forward (a Linear's transposed weight) reads what the backward gather put
// there, and the parameter's version counter never moves (autograd's checks of saved tensors
// pass). A block's parameters are gathered just before its forward and freed after it; a hook on
// the block's output gathers them again when backward reaches it, and a hook on the block's input
// frees them when backward has gone through the block (its input's gradient is complete). The
// parameters of no block are gathered for each micro-batch's forward and backward. Gathers nest:
// each parameter counts its holders and is freed when the last lets go. With prefetch, the next
// block's gather (the one after in forward, the one before in backward) is started before a
// block computes, and waited for when that block comes; in backward, once the block after the
// one computing is let go, so that a rank holds two blocks at a time in forward and backward.
//
// With a narrower dtype to gather in (`narrow`), a floating parameter wider than it is broadcast
// rounded to it, and every rank, its owner too, computes with the rounded values (in the
// parameter's dtype) while it is gathered: fewer bytes on the wire, the same forward on every
// rank. The owner keeps its own values under them (its master copy), back in place once it lets
// go, for the step; what reads every parameter outside a step (gather_all) reads them unrounded.
//
// A world of several ranks that one rank plans alone (a dry run: no process group) gathers the
// parameters of the others as zeros: the trial steps of its memory planner measure a stage-3 step.
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/intrusive_ptr.h>
#include <tk/blocks.h>
#include <tk/world.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace c10d {
class ProcessGroup;
class Work;
}  // namespace c10d

namespace tk::shard {

/// The word shard's gather_dtype option spells `dtype` with: "bf16", "fp16", else its name.
std::string dtype_word(at::ScalarType dtype);

class ParameterShards : public std::enable_shared_from_this<ParameterShards> {
 public:
  /// `params`: every trainable parameter, in model order, with `names` (for errors) and `owners`
  /// (the rank that updates each); `blocks`: the model's (null: it lists none, and every
  /// parameter is of no block), with `groups` the block of each parameter (block_groups: -1 for
  /// none). Every parameter starts whole, held once until start(). Refuses a parameter that shares
  /// its memory with another tensor (it cannot be freed alone). `narrow`: the dtype to gather
  /// floating parameters wider than it in, rounded (none: their own).
  ParameterShards(std::vector<at::Tensor> params, std::vector<std::string> names, std::vector<int> owners,
                  tk::World& world, const tk::Blocks* blocks, const std::vector<int64_t>& groups, bool prefetch,
                  std::optional<at::ScalarType> narrow = std::nullopt);
  ~ParameterShards();
  ParameterShards(const ParameterShards&) = delete;
  ParameterShards& operator=(const ParameterShards&) = delete;

  /// Drops the hold every parameter started with: from here, those of other ranks are freed
  /// between uses.
  void start();
  /// Every parameter whole / one such hold undone (gather_all is a collective): what reads every
  /// parameter outside a step (checkpoints, a check that the ranks agree). Exact: a parameter held
  /// rounded is sent again unrounded, and stays so until let go.
  void gather_all();
  void release_all();
  bool all_whole() const;
  /// Whether some parameter is gathered rounded (`narrow` and wider than it).
  bool narrows() const;
  /// Refuses a parameter this rank keeps that is finite but rounds to an infinity (every rank
  /// would compute with it): owners' values change only at the step, so once after each step
  /// and once at the start suffice.
  void check_fits() const;

  /// Runs block `b` (computed by `fn`) on `x` with its parameters gathered (Blocks::set_around).
  at::Tensor run_block(size_t b, const at::Tensor& x, const tk::BlockFn& fn);
  /// The parameters of no block: gathered for a micro-batch, released after its backward. Once
  /// each: a micro-batch redone before its backward (out of memory) gathers nothing more.
  void gather_loose();
  void release_loose();
  /// Validation's forward (no backward follows): the parameters of no block gathered for it, the
  /// blocks' one at a time with the next one's prefetched, as in training; released after.
  void start_evaluation();
  void end_evaluation();
  /// After a backward: frees what its gathers still hold (blocks whose input had no gradient).
  void after_backward();
  /// Called when backward has gone through block b (its parameters' gradients are final).
  void on_block_done(std::function<void(size_t b)> done) { done_ = std::move(done); }
  /// Refuses a parameter of another rank still gathered at the step (between micro-batches none
  /// is): it would keep its values while its owner updates them.
  void check_released() const;

  /// Bytes of parameters this rank holds now: its own, and those of other ranks gathered.
  int64_t resident_bytes() const { return owned_bytes_ + gathered_bytes_; }
  /// Gathers since the last call, their bytes received, the time this rank spent starting them and
  /// waiting for them (with prefetch, less than they took), and the most bytes of parameters it
  /// held at once (validation and checkpoints included).
  struct Traffic {
    int64_t gathers = 0, bytes = 0, peak_bytes = 0;
    double ms = 0.0;
  };
  Traffic take_traffic();

 private:
  /// Gathers / releases parameters `which` (indices into params_): a gather broadcasts, from each
  /// owner, those that no one held (every rank makes the same calls in the same order); `exact`:
  /// unrounded, whatever `narrow` says.
  void gather(const std::vector<size_t>& which, bool exact = false);
  void release(const std::vector<size_t>& which);
  /// A gather in two halves: its broadcasts started (the parameters held), then waited for, the
  /// parameters of other ranks pointed into what came.
  struct Flight {
    struct Part {
      int root;
      bool rounded;                  // broadcast in the narrow dtype
      std::vector<at::Tensor> flat;  // what is broadcast
      std::vector<size_t> into;      // its parameters, in order
      c10::intrusive_ptr<c10d::Work> work;
    };
    std::vector<Part> parts;
  };
  Flight launch(const std::vector<size_t>& which, bool exact = false);
  void land(Flight& f);
  /// Whether the gather in flight is block b's (in backward or not), which then holds its
  /// parameters; any other is waited for and let go.
  bool take_prefetched(size_t b, bool backward);
  void prefetch(size_t b, bool backward);
  /// Parameter i's memory: `flat` from element `offset` on; returns what it was.
  at::DataPtr point_into(size_t i, const at::Tensor& flat, int64_t offset);
  void free(size_t i);
  /// Whether parameter i is gathered rounded (narrow_), unless `exact`.
  bool rounds(size_t i, bool exact) const;
  /// The owner's own values of parameter i back under it, where a rounded copy was.
  void restore_master(size_t i);
  void backward_gather(size_t b);
  void backward_done(size_t b);

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<int> owners_;
  std::vector<size_t> bytes_;    // each parameter's memory when whole
  std::vector<int64_t> holds_;   // each parameter's holders now
  std::vector<at::DataPtr> masters_;  // an owned parameter's own memory while it holds rounded values
  std::vector<char> rounded_;         // each parameter's values now rounded (narrow_)
  std::vector<std::vector<size_t>> blocks_;  // each block's parameters (indices)
  std::vector<size_t> loose_;                // the parameters of no block
  std::vector<size_t> all_;                  // every parameter (0 to n-1), for gather and release
  std::vector<size_t> pending_;              // blocks gathered by backward, not yet released
  std::vector<int64_t> runs_;                // per block: forward runs whose backward has not gone through it
  std::function<void(size_t)> done_;
  int rank_, world_;
  bool started_ = false;
  bool loose_held_ = false;  // the parameters of no block gathered for the micro-batch
  bool prefetching_;
  bool evaluating_ = false;       // validation's forward: prefetched though no gradient is taken
  int64_t owned_bytes_ = 0;       // this rank's parameters, always whole
  int64_t gathered_bytes_ = 0;    // other ranks' parameters held now
  int64_t peak_gathered_ = 0;     // the most of those since take_traffic()
  struct Prefetch {
    size_t block;
    bool backward;
    Flight flight;
  };
  std::optional<Prefetch> prefetch_;
  std::optional<size_t> deferred_;  // a backward prefetch waiting for the block after the next to go
  std::optional<at::ScalarType> narrow_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;  // the gathers' own (World::side_group); null in a world of one
  Traffic traffic_;
};

}  // namespace tk::shard
