// Sharded data parallel: the optimizer's state split across the ranks of the run's world (ZeRO
// stage 1). The recipe chooses the stage; the run's optimizer becomes the recipe's over this
// rank's share of the parameters (sharded.h), stepped on the gradients another plugin summed
// across the ranks (ddp), and every rank gets the parameters their owners updated.
#include <tk/abi.h>
#include <tk/world.h>

#include <algorithm>
#include <sstream>

#include "sharded.h"

namespace {

class Shard final : public tk::Plugin {
 public:
  void bind(tk::OptionBinder& o) override {
    o.add("stage", stage_,
          "what is split across the ranks: 0 nothing (every rank keeps the whole optimizer state); 1 the "
          "optimizer's state (ZeRO stage 1): each rank keeps and updates the state of its share of the parameters, "
          "then broadcasts them");
  }

  void init() override {
    if (stage_ != 0 && stage_ != 1)
      fail_option(stage_, "must be 0 or 1 (1 shards the optimizer state; gradients and parameters stay whole on "
                          "every rank), got " + std::to_string(stage_));
  }

  tk::Contract contract() const override {
    tk::Contract c;
    c.provides = {tk::cap::kOptimizerSharded};
    c.after = {tk::cap::kGradsSynced};
    return c;
  }

  /// At stage 1 the run's optimizer is the recipe's over this rank's share only.
  void setup(tk::SetupContext& setup) override {
    if (stage_ == 0) return;
    tk::World* world = &setup.world();
    setup.wrap_optimizer([world](std::vector<at::Tensor> trainable, const tk::OptimizerFactory& inner)
                             -> std::unique_ptr<torch::optim::Optimizer> {
      return tk::shard::ShardedOptimizer::make(std::move(trainable), *world, inner);
    });
  }

  void on_fit_start(tk::FitStartContext& ctx) override {
    sharded_ = dynamic_cast<const tk::shard::ShardedOptimizer*>(&ctx.optimizer());
    if (!sharded_ || ctx.trial()) return;
    const int size = ctx.world_size(), rank = ctx.rank();
    int64_t total = 0;
    for (int r = 0; r < size; ++r) total += sharded_->owned_bytes(r);
    const auto& owners = sharded_->owners();
    std::ostringstream m;
    m << "stage 1: the optimizer state is sharded over " << size << " rank" << (size == 1 ? "" : "s")
      << "; this rank updates " << std::count(owners.begin(), owners.end(), rank) << " of " << owners.size()
      << " tensors (" << sharded_->owned_bytes(rank) << " of " << total << " bytes of parameters)";
    ctx.info(m.str());
  }

  void on_step_end(tk::StepEndContext& ctx) override {
    if (!sharded_ || ctx.world_size() == 1) return decline(tk::Event::StepEnd);
    if (!ctx.step_vetoed()) ctx.metric("shard_param_broadcast_ms", sharded_->broadcast_ms());
  }

  // The optimizer is the core's: made anew after trial steps, released with the run.
  void on_fit_end(tk::FitEndContext&) override { sharded_ = nullptr; }

 private:
  int64_t stage_ = 0;
  const tk::shard::ShardedOptimizer* sharded_ = nullptr;
};

}  // namespace

TK_PLUGIN(Shard, "shard", "0.1.0",
          "sharded data parallel: the optimizer state split across the ranks (ZeRO stage 1), exact against ddp")
