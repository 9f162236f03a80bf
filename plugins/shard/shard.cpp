// Sharded data parallel over the ranks of the run's world (ZeRO). The recipe chooses the stage:
// at 1 the optimizer's state is split (the run's optimizer becomes the recipe's over this rank's
// share of the parameters, sharded.h), stepped on the gradients another plugin summed across the
// ranks (ddp); at 2 the gradients are split too: during backward each is summed onto the rank that
// updates it (grad_shards.h) and released on every rank, the owner keeping the sum. Either way
// every rank gets the parameters their owners updated. At 3 the parameters are split too: each
// is whole only on its owner between uses, and gathered onto the others while a block uses it
// (param_shards.h); the step broadcasts nothing.
#include <tk/abi.h>
#include <tk/blocks.h>
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
  for (const auto& t : tk::distinct_tensors(tensors))  // a parameter registered under two names (tied) counts once
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
          "the rank that updates it and released everywhere, the owner keeping the sum; 3 the parameters too (ZeRO "
          "stage 3): each is whole only on the rank that updates it, and gathered onto the others for the forward "
          "and the backward of the block that uses it (the parameters of no block: for each micro-batch). From stage 1 "
          "the plugin provides " + tk::cap::kOptimizerSharded.name() + " (and needs " + tk::cap::kGradsSynced.name() +
          "), from 2 also " + tk::cap::kGradsSharded.name() + ", at 3 also " + tk::cap::kParamsSharded.name());
    o.add("reduce", reduce_,
          "stages 2 and 3, with accumulation: which backwards sum the gradients onto their owners. \"micro_batch\": every "
          "backward, so that between backwards a rank holds only its share (least memory); \"window\": the "
          "window's last, each rank accumulating whole gradients until then (least traffic)",
          {"micro_batch", "window"});
    o.add("prefetch", prefetch_,
          "stage 3: start gathering the next block's parameters (the one after in forward, the one before in "
          "backward) before a block computes, so that the broadcast overlaps its computation; false: each block's "
          "gather starts when the block does (one block's parameters fewer held at a time)");
    o.choice("gather_dtype", gather_dtype_,
             "stage 3: the dtype the parameters are gathered in. \"param\": their own, exactly the values their "
             "owners keep; \"bf16\" or \"fp16\": floating parameters wider than it are gathered rounded to it "
             "(half the bytes of float32), and every rank, owners too, computes with the rounded values; the owners "
             "keep and update their own (float32 master copies); checkpoints and the weights are unrounded. Under "
             "mixed_precision's autocast to the same dtype, a parameter that only autocast's lower-precision "
             "operations read (a Linear's weight and bias) computes exactly as with \"param\"",
             {{"param", at::ScalarType::Undefined}, {"bf16", at::kBFloat16}, {"fp16", at::kHalf}});
  }

  void init() override {
    if (stage_ < 0 || stage_ > 3)
      fail_option(stage_, "must be 0, 1, 2 or 3 (1 shards the optimizer state, 2 the gradients too, 3 the "
                          "parameters too), got " + std::to_string(stage_));
    notes_.clear();
    const std::string is = " (stage is " + std::to_string(stage_) + ")";
    if (option_given(reduce_) && stage_ < 2)
      notes_.push_back(at("reduce") + "reduce = \"" + reduce_ + "\" is ignored: only stages 2 and 3 sum the gradients themselves" + is);
    if (option_given(prefetch_) && stage_ < 3)
      notes_.push_back(at("prefetch") + "prefetch is ignored: only stage 3 gathers parameters" + is);
    if (option_given(gather_dtype_) && stage_ < 3)
      notes_.push_back(at("gather_dtype") + "gather_dtype is ignored: only stage 3 gathers parameters" + is);
  }

  tk::Contract contract() const override {
    tk::Contract c;
    if (stage_ >= 1) {
      c.provides = {tk::cap::kOptimizerSharded};
      c.requires_ = {tk::cap::kGradsSynced};  // the data-parallel plugin: the world's totals
    }
    // Stage 2 sums the gradients itself, before the sync plugin's boundary (which then sums the
    // window's counts alone) and so before everything that runs after it.
    if (stage_ >= 2)
      c.provides.push_back(tk::cap::kGradsSharded);
    else
      c.after = {tk::cap::kGradsSynced};
    // Stage 3 gathers each block's parameters around it, however it computes (recomputed or not).
    if (stage_ == 3) {
      c.provides.push_back(tk::Capability{"model.blocks.around"});
      c.provides.push_back(tk::cap::kParamsSharded);
    }
    return c;
  }

  /// From stage 1 on, the run's optimizer is the recipe's over this rank's share only.
  void setup(tk::SetupContext& setup) override {
    // Said once, as the run is planned (a dry run too).
    if (setup.world().rank() == 0)
      for (const auto& n : notes_) setup.warn(n);
    if (stage_ == 0) return;
    tk::World* world = &setup.world();
    setup.wrap_optimizer([this, world](std::vector<at::Tensor> trainable, const tk::OptimizerFactory& inner)
                             -> std::unique_ptr<torch::optim::Optimizer> {
      if (static_cast<int64_t>(trainable.size()) < world->size())  // at the recipe's line that asks for it
        fail_option(stage_, "stage " + std::to_string(stage_) + " shards whole tensors: the model has " +
                                std::to_string(trainable.size()) + " trainable tensors for " +
                                std::to_string(world->size()) + " ranks; use fewer ranks or stage = 0");
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
    if (stage_ >= 2) {  // trial steps too: the memory planner measures the step as it will be
      std::map<const c10::TensorImpl*, std::string> name_of;
      for (const auto& p : ctx.model().named_parameters()) name_of.emplace(p.value().unsafeGetTensorImpl(), p.key());
      const auto& params = sharded_->param_groups().front().params();
      std::vector<std::string> names;
      for (const auto& p : params) {
        auto it = name_of.find(p.unsafeGetTensorImpl());
        names.push_back(it == name_of.end() ? "(a parameter outside the model)" : it->second);
      }
      // One block's gradients to a bucket: stage 2's backward holds about one block of them whole.
      const auto groups = tk::shard::block_groups(params, tk::blocks_of(ctx.model()));
      if (stage_ == 3) {
        shard_parameters(ctx, params, names, groups);
        params_->check_fits();
      }
      grads_ = std::make_unique<tk::shard::GradientShards>(params, names, sharded_->owners(), ctx.world(), groups);
      if (params_) {
        grads_->send_when_settled();
        params_->on_block_done([grads = grads_.get()](size_t b) { grads->settle(static_cast<int64_t>(b)); });
      }
    }
    if (!sharded_ || ctx.trial()) return;
    const int size = ctx.world_size(), rank = ctx.rank();
    if (size == 1)
      return ctx.info("stage " + std::to_string(stage_) + " in a world of one rank: it holds and updates every "
                      "parameter, nothing is sharded or gathered");
    int64_t total = 0;
    for (int r = 0; r < size; ++r) total += sharded_->owned_bytes(r);
    const auto& owners = sharded_->owners();
    std::ostringstream m;
    m << "stage " << stage_ << ": the optimizer state"
      << (stage_ == 3 ? ", the gradients and the parameters are" : stage_ == 2 ? " and the gradients are" : " is")
      << " sharded over " << size << " ranks; this rank updates "
      << std::count(owners.begin(), owners.end(), rank) << " of " << owners.size() << " tensors ("
      << sharded_->owned_bytes(rank) << " of " << total << " bytes of parameters)";
    if (stage_ >= 2) m << "; gradients summed onto their owners during " << (reduce_ == "window" ? "each window's last backward" : "every backward");
    if (stage_ == 3) {
      m << "; parameters gathered "
        << (params_->narrows() ? "in " + tk::shard::dtype_word(gather_dtype_) + " " : std::string());
      if (!blocks_ || blocks_->empty())
        m << "whole for each micro-batch (the model lists no blocks, tk/blocks.h)";
      else
        m << (blocks_->size() == 1 ? std::string("for the model's block")
                                   : "for each of the model's " + std::to_string(blocks_->size()) + " blocks")
          << " in forward and backward, the rest for each micro-batch";
    }
    ctx.info(m.str());
  }

  /// Stage 3: every rank gathers the parameters it does not update for each micro-batch (those
  /// of no block) and for each block.
  void on_micro_batch(tk::MicroBatchContext&) override {
    if (!params_) return decline(tk::Event::MicroBatch);
    params_->start();
    params_->gather_loose();
  }

  void on_validation_start(tk::ValidationStartContext&) override {
    if (!params_) return decline(tk::Event::ValidationStart);
    params_->start();  // sharded from here, even before the first micro-batch: a pass as training's
    params_->start_evaluation();
  }

  void on_validation_end(tk::ValidationEndContext&) override {
    if (!params_) return decline(tk::Event::ValidationEnd);
    params_->end_evaluation();
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
    if (params_) {
      params_->after_backward();
      params_->release_loose();
    }
    grads_->finish();
  }

  /// This rank's bytes of parameters and of the gradients the step will apply, for every stage.
  void on_boundary(tk::BoundaryContext& ctx) override {
    if (params_) params_->check_released();
    ctx.metric("param_mib", params_ ? static_cast<double>(params_->resident_bytes()) / kMiB : mib_of(ctx.model().parameters()));
    ctx.metric("grad_mib", mib_of(ctx.gradients()));
  }

  void on_step_end(tk::StepEndContext& ctx) override {
    if (params_ && !ctx.step_vetoed()) params_->check_fits();  // the values the next gathers round
    if (!sharded_ || ctx.world_size() == 1) return params_ ? void() : decline(tk::Event::StepEnd);
    if (ctx.step_vetoed()) return;
    if (params_) {
      const auto t = params_->take_traffic();
      ctx.metric("shard_param_gathers", static_cast<double>(t.gathers));
      ctx.metric("shard_param_gather_mib", static_cast<double>(t.bytes) / kMiB);
      ctx.metric("shard_param_gather_ms", t.ms);
      ctx.metric("shard_param_peak_mib", static_cast<double>(t.peak_bytes) / kMiB);
    } else {
      ctx.metric("shard_param_broadcast_ms", sharded_->broadcast_ms());
    }
    if (!grads_) return;
    ctx.metric("shard_grad_reduce_ms", grads_->reduce_ms());
    ctx.metric("shard_grad_reduces", static_cast<double>(grads_->reduces()));
    ctx.metric("shard_grad_sent_in_backward", static_cast<double>(grads_->sent_in_backward()));
  }

  // The optimizer is the core's: made anew after trial steps, released with the run (after the
  // hooks on its parameters are gone).
  void on_fit_end(tk::FitEndContext& ctx) override {
    if (params_) {
      if (blocks_) blocks_->set_around(nullptr);
      params_->on_block_done(nullptr);  // it held grads_
      // Whole again on every rank, for the weights and whatever reads the model next; not after a
      // failure, whose peers may be gone (the core then writes no weights: parameters_whole()).
      if (ctx.status() != tk::FitStatus::Failed) params_->gather_all();
      params_.reset();  // the optimizer keeps it, to say whether the parameters are whole
    }
    grads_.reset();
    sharded_ = nullptr;
    blocks_ = nullptr;
  }

 private:
  /// Stage 3: the parameters of other ranks freed between uses, and gathered around each block.
  void shard_parameters(tk::FitStartContext& ctx, const std::vector<at::Tensor>& params, std::vector<std::string> names,
                        const std::vector<int64_t>& groups) {
    blocks_ = tk::blocks_of(ctx.model());
    params_ = std::make_shared<tk::shard::ParameterShards>(params, std::move(names), sharded_->owners(), ctx.world(),
                                                           blocks_, groups, prefetch_, narrow());
    sharded_->attach(params_);
    if (!blocks_) return;
    std::weak_ptr<tk::shard::ParameterShards> weak = params_;
    blocks_->set_around([weak](size_t i, const at::Tensor& x, const tk::BlockFn& fn) {
      auto shards = weak.lock();
      return shards ? shards->run_block(i, x, fn) : fn(x);
    });
  }

  /// "FILE:LINE: " where option `key` was set (a --set's own words), or "".
  std::string at(const std::string& key) const {
    const tk::SourceLoc where = options().where(key);
    return where.file.empty() ? "" : where.str() + ": ";
  }

  /// gather_dtype_, where it is not the parameters' own.
  std::optional<at::ScalarType> narrow() const {
    if (gather_dtype_ == at::ScalarType::Undefined) return std::nullopt;
    return gather_dtype_;
  }

  int64_t stage_ = 0;
  at::ScalarType gather_dtype_ = at::ScalarType::Undefined;
  std::string reduce_ = "micro_batch";
  bool prefetch_ = true;
  std::vector<std::string> notes_;  // options given that this stage ignores, where they were given
  tk::shard::ShardedOptimizer* made_ = nullptr;    // the optimizer this plugin made last
  tk::shard::ShardedOptimizer* sharded_ = nullptr;  // the run's, from on_fit_start to on_fit_end
  std::unique_ptr<tk::shard::GradientShards> grads_;  // stage 2, as long as sharded_
  std::shared_ptr<tk::shard::ParameterShards> params_;  // stage 3, as long as sharded_
  tk::Blocks* blocks_ = nullptr;                        // the model's, at stage 3 (null: it lists none)
};

}  // namespace

TK_PLUGIN(Shard, "shard", "0.3.0",
          "sharded data parallel (ZeRO): the optimizer state (stage 1), the gradients (stage 2) and the parameters "
          "(stage 3) split across the ranks, exact against ddp")
