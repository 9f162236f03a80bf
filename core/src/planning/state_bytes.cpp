// The training state a step holds (parameters, gradients, the optimizer's state), measured on this
// rank and for the whole model (zero_stages.cpp reckons with it).
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <set>
#include <tuple>

#include "planning/planning.h"
#include "tk/blocks.h"
#include "tk/capabilities.h"
#include "tk/options.h"
#include "world/world.h"

namespace tk::detail {
namespace {

/// Bytes of `t`'s elements that its storage holds now: none for a parameter whose storage was
/// emptied (another rank holds it until it is gathered).
double held_bytes(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return 0;
  return static_cast<double>(std::min<size_t>(t.nbytes(), t.storage().nbytes()));
}

/// Blocks whose gradients the shard plugin's buckets hold together, while within this many bytes
/// (plugins/shard/grad_shards.cpp).
constexpr double kMergedBlocks = 1024.0 * 1024.0;

/// The trainable parameters' bytes of the largest block, of the largest run of neighbouring
/// blocks within kMergedBlocks (a bucket of gradients), and of the parameters in no block (all of
/// them for a model without blocks).
std::tuple<double, double, double> block_sizes(Model& model, double trainable) {
  Blocks* blocks = blocks_of(model);
  if (!blocks || blocks->empty()) return {0.0, 0.0, trainable};
  std::set<const c10::TensorImpl*> in_block;
  double largest = 0, listed = 0, run = 0, largest_run = 0;
  for (size_t b = blocks->size(); b-- > 0;) {  // as backward reaches them
    double size = 0;
    for (const auto& p : blocks->parameters(b))
      if (p.requires_grad() && in_block.insert(p.unsafeGetTensorImpl()).second) size += static_cast<double>(p.nbytes());
    largest = std::max(largest, size);
    listed += size;
    run = run + size <= kMergedBlocks ? run + size : size;
    largest_run = std::max(largest_run, run);
  }
  return {largest, largest_run, trainable - listed};
}

/// Bytes of state the recipe's optimizer keeps per byte of a parameter, from one step on a probe,
/// with the CPU's random stream as it was (a plugin's optimizer may draw); none, with why, where
/// it does not report its state or cannot step so.
std::pair<std::optional<double>, std::string> optimizer_state_per_byte(Run& r) {
  if (!r.optimizer_maker) return {std::nullopt, "the run has no optimizer maker"};
  const RngStates rng = save_rng();
  std::pair<std::optional<double>, std::string> out;
  try {
    at::Tensor probe = at::zeros({int64_t{1} << 16}, at::TensorOptions().dtype(r.dtype).device(r.device));
    probe.requires_grad_(true);
    probe.mutable_grad() = at::zeros_like(probe);
    const auto opt = r.optimizer_maker->make(r.opt_opts, {probe});
    opt->step();
    const int64_t bytes = optimizer_state_bytes(*opt);
    if (bytes >= 0) out.first = static_cast<double>(bytes) / static_cast<double>(probe.nbytes());
    else out.second = "it does not report the size of its state";
  } catch (const std::exception& e) {  // one that needs a closure (LBFGS), say
    out.second = "it could not be stepped on a probe (" + message_of(e) + ")";
  }
  restore_rng(rng);
  return out;
}

/// The training state a step will hold, before any: its optimizer's state reckoned from a probe
/// (Adam's two moments, with why, where that cannot say).
std::pair<TrainingState, std::optional<std::string>> state_before_steps(Run& r) {
  TrainingState s = measure_training_state(r, true);  // no state yet: no shares to sum
  if (r.plan.has(cap::kParamsSharded)) s.stage = 3;  // whole until the first micro-batch
  const auto [per_byte, unknown] = optimizer_state_per_byte(r);
  s.optimizer_whole = std::max(s.optimizer_whole, (per_byte ? *per_byte : 2.0) * s.trainable);
  s.optimizer_known = true;  // measured, or reckoned with why
  if (per_byte) return {s, std::nullopt};
  return {s, unknown};
}

}  // namespace

std::string describe_state(Run& r) {
  const auto [s, unknown] = state_before_steps(r);
  const int64_t n = std::max<int64_t>(r.plan.world_size, 1), here = local_world_size_from_environment(r.plan.world_size);
  std::string out = format_bytes(s.whole()) + " unsharded (" + s.unsharded() +
                    (unknown ? ", reckoned as Adam's two moments" : "") + ")";
  if (n == 1) return out + (s.stage > 0 ? "; one rank shards nothing, whatever its stage" : "");
  const size_t st = static_cast<size_t>(s.stage);
  const double each = s.most(st, n, 1);
  out += "; at ZeRO stage " + std::to_string(st) + " over " + std::to_string(n) + " ranks about " + format_bytes(each) +
         " a rank with the buffers of its sharding";
  // Shares of whole tensors: where one is more than a rank's even part, that rank holds it all.
  const bool uneven = st > 0 && s.share(n) > 1.25 / static_cast<double>(n);
  // More than unsharded: what the collectives hold (a bucket's or a block's, whatever the model's
  // size), and where one tensor is most of the state the share of the rank that holds it.
  if (each > s.whole()) {
    static const char* const kBuffers[] = {"",
                                           "the updated parameters broadcast from their owners",
                                           "the gradients sent to their owners a bucket at a time, and the updated "
                                           "parameters broadcast",
                                           "the blocks' parameters gathered and their gradients sent"};
    out += st == 0 ? std::string(" (more than unsharded: with the buckets its gradients are summed in)")
                   : std::string(" (more than unsharded: on this model ") + kBuffers[std::min<size_t>(st, 3)] +
                         (uneven ? ", and the uneven shares below," : "") + " take more than the stage saves)";
  }
  // A machine's ranks share its memory on the CPU; on GPUs each has its own.
  if (here > 1 && r.device.is_cpu())
    out += ", " + format_bytes(s.most(st, n, here)) + " for the " + std::to_string(here) + " on a machine";
  if (uneven) {
    char pct[16];
    std::snprintf(pct, sizeof pct, "%.0f%%", 100.0 * s.share(n));
    out += "; uneven: its largest tensor is " + std::string(pct) + " of the trainable parameters, and the rank that "
           "holds it holds that tensor's optimizer state whole" +
           std::string(st >= 2 ? ", and its gradient" : "") + (st >= 3 ? " and its weights" : "") + " (ranks hold whole tensors)";
  }
  return out;
}

void check_state_fits(Run& r) {
  if (!r.device.is_cpu()) return;  // a GPU's memory: the memory planner's budget, and the device's own error
  const auto [s, unknown] = state_before_steps(r);
  const double have = machine_memory_bytes();
  std::string why = state_overflow(s, r.plan.world_size, local_world_size_from_environment(r.plan.world_size), have,
                                   machine_memory_note());
  // Every rank the same verdict (machines may differ): each refuses when one does.
  World& world = *r.world;
  if (world.joined() && world.size() > 1) {
    at::Tensor refused = at::full({1}, why.empty() ? 0.0 : 1.0, at::kDouble);
    world.all_reduce(refused, ReduceOp::Max);
    if (why.empty() && refused.item<double>() > 0)
      why = "another rank's machine cannot hold its training state (that rank's error says how much)";
  }
  if (why.empty()) return;
  throw RecipeError(r.model_opts.section_loc(),
                    "model '" + r.model_name + "': " + why +
                        (unknown ? ". The optimizer's state is reckoned as Adam's two moments: " + *unknown : std::string()));
}

TrainingState measure_training_state(Run& r, bool local) {
  TrainingState s;
  for (const auto& p : distinct_tensors(r.model->parameters())) {  // a tied parameter once
    s.params += held_bytes(p);
    const auto bytes = static_cast<double>(p.nbytes());
    (p.requires_grad() ? s.trainable : s.frozen) += bytes;
    if (p.requires_grad()) s.largest_tensor = std::max(s.largest_tensor, bytes), ++s.tensors;
  }
  const int64_t reported = r.optimizer ? optimizer_state_bytes(*r.optimizer) : 0;
  s.optimizer_known = reported >= 0;
  s.optimizer = static_cast<double>(std::max<int64_t>(reported, 0));
  // A sharded optimizer holds this rank's share: the whole is every rank's together (about N
  // shares where the world has not joined: a dry run).
  s.optimizer_whole = s.optimizer;
  World& world = *r.world;
  if (r.plan.has(cap::kOptimizerSharded) && !local) {
    if (world.joined()) {
      at::Tensor total = at::full({1}, s.optimizer, at::kDouble);
      world.all_reduce(total);
      s.optimizer_whole = total.item<double>();
    } else {
      s.optimizer_whole = s.optimizer * world.size();
    }
  }
  std::tie(s.largest_block, s.largest_bucket, s.loose) = block_sizes(*r.model, s.trainable);
  // Which of ZeRO's stages this step is at, from what its plugins provide and what it holds.
  const bool params_sharded = s.params < s.trainable + s.frozen;
  s.stage = r.plan.has(cap::kGradsSharded) ? (params_sharded ? 3 : 2) : r.plan.has(cap::kOptimizerSharded) ? 1 : 0;
  return s;
}

}  // namespace tk::detail
