// The micro-batch halved after running out of memory (loop.h).
#include "loop/loop.h"

namespace tk::detail {

BackOff::BackOff(Run& run) : r_(run) {}

bool BackOff::ready() const noexcept { return r_.plan.micro_batch_auto; }

void BackOff::window_opened(int64_t b, const Counters& counters) {
  if (!ready()) return;
  batch_ = b;
  counters_ = counters;
  rng_ = save_rng();
}

int64_t BackOff::back_off(LoopState& s, const std::string& what, std::string& note) {
  const int64_t m = r_.plan.micro_batch, k = r_.plan.accumulation;
  std::string why_not;
  if (r_.plan.world_size > 1) why_not = "under DDP, where every rank would have to back off together";
  else if (r_.plan.ramp.active()) why_not = "during a batch ramp";
  else if (r_.plan.last_window == LastWindow::Carry) why_not = "with last_window = \"carry\"";
  const int64_t smaller = why_not.empty() ? backed_off_micro_batch(r_) : 0;
  if (why_not.empty() && smaller == 0) why_not = "below a micro-batch of " + std::to_string(m);
  const std::string where = "out of memory at step " + std::to_string(counters_.step + 1) + " with micro-batches of " +
                            std::to_string(m) + " (" + what + ")";
  if (!why_not.empty()) throw Error(where + "; it cannot back off " + why_not);
  // Nothing of the window stays: its gradients, counts and random draws.
  s.loss = at::Tensor();
  clear_grads(r_);
  s.counters = counters_;
  restore_rng(rng_);
  const int64_t first_example = batch_ * m;
  rebatch(r_, smaller);
  note = "micro-batch " + std::to_string(m) + " x " + std::to_string(k) + " -> " + std::to_string(smaller) + " x " +
         std::to_string(r_.plan.accumulation);
  r_.warn(where + "; backing off to " + std::to_string(smaller) + " x " + std::to_string(r_.plan.accumulation) +
          " micro-batches, and the step is redone from its first");
  return first_example / smaller;
}

}  // namespace tk::detail
