// When a step is checkpointed (loop.h).
#include <torch/serialize/output-archive.h>

#include "loop/loop.h"
#include "tk/sharded_state.h"

namespace tk::detail {

CheckpointPolicy::CheckpointPolicy(Run& run, RunOutputs& outputs)
    : r_(run), outputs_(outputs), every_(run.run.get_int("checkpoint_every")) {
  // Every rank writes its share of such an optimizer's state into the checkpoints: they must see
  // the folder rank 0 writes in.
  if (outputs_.writes() && dynamic_cast<const ShardedState*>(r_.optimizer.get()))
    check_folder_shared(outputs_.dir() / "checkpoints", *r_.world);
}

std::optional<std::filesystem::path> CheckpointPolicy::after_step(const Counters& c, const WorldSeen& seen,
                                                                  int64_t epoch, int64_t b,
                                                                  bool last) {
  if (!outputs_.writes() || !(last || (every_ > 0 && c.step % every_ == 0))) return std::nullopt;
  if (outputs_.active()) return outputs_.checkpoint(r_, c, seen, epoch, b);
  // A checkpoint is the world's: rank 0 writes it. An optimizer sharded over the ranks has each
  // rank write its own share beside rank 0 at the same time; any other optimizer saves on every
  // rank (one whose state is spread over the ranks may gather it to rank 0 there).
  if (dynamic_cast<const ShardedState*>(r_.optimizer.get())) {
    save_checkpoint_share(outputs_.dir() / "checkpoints", c.step, *r_.model, *r_.optimizer, *r_.world);
  } else if (r_.plan.world_size > 1) {
    torch::serialize::OutputArchive discarded;
    r_.optimizer->save(discarded);
  }
  return std::nullopt;
}

}  // namespace tk::detail
