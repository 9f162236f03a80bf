// Sharded data parallel over the ranks of the run's world (ZeRO). The recipe chooses the stage:
// at 1 the optimizer's state is split (the run's optimizer becomes the recipe's over this rank's
// share of the parameters, sharded.h), stepped on the gradients another plugin summed across the
// ranks (ddp); at 2 the gradients are split too: during backward each is summed onto the rank that
// updates it (grad_shards.h) and released on every rank, the owner keeping the sum. Either way
// every rank gets the parameters their owners updated.
#include <tk/abi.h>
#include <tk/world.h>

#include <algorithm>
#include <map>
#include <sstream>

#include "grad_shards.h"
#include "sharded.h"

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

double mib_of(const std::vector<at::Tensor>& tensors) {
  int64_t n = 0;
  for (const auto& t : tensors)
    if (t.defined()) n += tk::shard::bytes_of(t);
  return static_cast<double>(n) / kMiB;
}

class Shard final : public tk::Plugin {
 public:
  void bind(tk::OptionBinder& o) override {
    o.add("stage", stage_,
          "what is split across the ranks: 0 nothing (every rank keeps the whole optimizer state); 1 the "
          "optimizer's state (ZeRO stage 1): each rank keeps and updates the state of its share of the parameters, "
          "then broadcasts them; 2 the gradients too (ZeRO stage 2): during backward each gradient is summed onto "
          "the rank that updates it and released everywhere, the owner keeping the sum");
    o.add("reduce", reduce_,
          "stage 2, with accumulation: which backwards sum the gradients onto their owners. \"micro_batch\": every "
          "backward, so that between backwards a rank holds only its share (least memory); \"window\": the "
          "window's last, each rank accumulating whole gradients until then (least traffic)",
          {"micro_batch", "window"});
  }

  void init() override {
    if (stage_ < 0 || stage_ > 2)
      fail_option(stage_, "must be 0, 1 or 2 (1 shards the optimizer state, 2 the gradients too; parameters stay "
                          "whole on every rank), got " + std::to_string(stage_));
    if (option_given(reduce_) && stage_ != 2)
      note_ = "reduce = \"" + reduce_ + "\" is ignored: only stage 2 sums the gradients itself (stage is " +
              std::to_string(stage_) + ")";
  }

  tk::Contract contract() const override {
    tk::Contract c;
    c.provides = {tk::cap::kOptimizerSharded};
    if (stage_ >= 1) c.requires_ = {tk::cap::kGradsSynced};  // the data-parallel plugin: the world's totals
    // Stage 2 sums the gradients itself, before the sync plugin's boundary (which then sums the
    // window's counts alone) and so before everything that runs after it.
    if (stage_ == 2)
      c.provides.push_back(tk::cap::kGradsSharded);
    else
      c.after = {tk::cap::kGradsSynced};
    return c;
  }

  /// From stage 1 on, the run's optimizer is the recipe's over this rank's share only.
  void setup(tk::SetupContext& setup) override {
    if (stage_ == 0) return;
    tk::World* world = &setup.world();
    setup.wrap_optimizer([this, world](std::vector<at::Tensor> trainable, const tk::OptimizerFactory& inner)
                             -> std::unique_ptr<torch::optim::Optimizer> {
      auto made = tk::shard::ShardedOptimizer::make(std::move(trainable), *world, inner, static_cast<int>(stage_));
      made_ = made.get();
      return made;
    });
  }

  void on_fit_start(tk::FitStartContext& ctx) override {
    // The run's optimizer is the last one this plugin made (after trial steps the core makes another).
    sharded_ = &ctx.optimizer() == made_ ? made_ : nullptr;
    if (stage_ >= 1 && !sharded_)
      throw std::runtime_error("stage " + std::to_string(stage_) + ": the run's optimizer is not the sharded one this "
                               "plugin made (another plugin replaced or wrapped it after)");
    if (stage_ == 2) {  // trial steps too: the memory planner measures the step as it will be
      std::map<const c10::TensorImpl*, std::string> name_of;
      for (const auto& p : ctx.model().named_parameters()) name_of.emplace(p.value().unsafeGetTensorImpl(), p.key());
      const auto& params = sharded_->param_groups().front().params();
      std::vector<std::string> names;
      for (const auto& p : params) {
        auto it = name_of.find(p.unsafeGetTensorImpl());
        names.push_back(it == name_of.end() ? "(a parameter outside the model)" : it->second);
      }
      grads_ = std::make_unique<tk::shard::GradientShards>(params, std::move(names), sharded_->owners(), ctx.world());
    }
    if (!note_.empty() && !ctx.trial()) ctx.warn(note_);
    if (!sharded_ || ctx.trial()) return;
    const int size = ctx.world_size(), rank = ctx.rank();
    int64_t total = 0;
    for (int r = 0; r < size; ++r) total += sharded_->owned_bytes(r);
    const auto& owners = sharded_->owners();
    std::ostringstream m;
    m << "stage " << stage_ << ": the optimizer state" << (stage_ == 2 ? " and the gradients are" : " is")
      << " sharded over " << size << " rank" << (size == 1 ? "" : "s") << "; this rank updates "
      << std::count(owners.begin(), owners.end(), rank) << " of " << owners.size() << " tensors ("
      << sharded_->owned_bytes(rank) << " of " << total << " bytes of parameters)";
    if (stage_ == 2) m << "; gradients summed onto their owners during " << (reduce_ == "window" ? "each window's last backward" : "every backward");
    ctx.info(m.str());
  }

  /// Stage 2: the coming backward sums the gradients onto their owners as it makes them (every
  /// backward, or only the window's last).
  void on_loss(tk::LossContext& ctx) override {
    if (!grads_) return decline(tk::Event::Loss);
    const bool last = ctx.window().is_last(), each = reduce_ == "micro_batch";
    grads_->arm(each || last, !each || ctx.window().is_first(), last);
  }

  void on_backward(tk::BackwardContext&) override {
    if (!grads_) return decline(tk::Event::Backward);
    grads_->finish();
  }

  /// This rank's bytes of parameters and of the gradients the step will apply, for every stage.
  void on_boundary(tk::BoundaryContext& ctx) override {
    ctx.metric("param_mib", mib_of(ctx.model().parameters()));
    ctx.metric("grad_mib", mib_of(ctx.gradients()));
  }

  void on_step_end(tk::StepEndContext& ctx) override {
    if (!sharded_ || ctx.world_size() == 1) return decline(tk::Event::StepEnd);
    if (ctx.step_vetoed()) return;
    ctx.metric("shard_param_broadcast_ms", sharded_->broadcast_ms());
    if (!grads_) return;
    ctx.metric("shard_grad_reduce_ms", grads_->reduce_ms());
    ctx.metric("shard_grad_reduces", static_cast<double>(grads_->reduces()));
    ctx.metric("shard_grad_sent_in_backward", static_cast<double>(grads_->sent_in_backward()));
  }

  // The optimizer is the core's: made anew after trial steps, released with the run (after the
  // hooks on its parameters are gone).
  void on_fit_end(tk::FitEndContext&) override {
    grads_.reset();
    sharded_ = nullptr;
  }

 private:
  int64_t stage_ = 0;
  std::string reduce_ = "micro_batch";
  std::string note_;
  tk::shard::ShardedOptimizer* made_ = nullptr;    // the optimizer this plugin made last
  tk::shard::ShardedOptimizer* sharded_ = nullptr;  // the run's, from on_fit_start to on_fit_end
  std::unique_ptr<tk::shard::GradientShards> grads_;  // stage 2, as long as sharded_
};

}  // namespace

TK_PLUGIN(Shard, "shard", "0.2.0",
          "sharded data parallel (ZeRO): the optimizer state (stage 1) and the gradients (stage 2) split across the "
          "ranks, exact against ddp")
