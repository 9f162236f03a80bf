// ZeRO stage 2's gradients (grad_shards.h): summed onto their owners bucket by bucket as backward
// makes them, from hooks on the parameters' grad accumulators (as c10d's Reducer is driven).
#include "grad_shards.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <tk/blocks.h>
#include <tk/error.h>

#include <algorithm>
#include <chrono>
#include <map>

namespace tk::shard {
namespace {

/// Gradients summed together (as PyTorch DDP's bucket_cap_mb).
constexpr int64_t kBucketBytes = int64_t{25} << 20;
/// A bucket of blocks' gradients takes the next block's too while together they stay within this
/// (as DDP's first bucket_cap_mb): a reduce of a few KiB costs about as much as one of a MiB.
constexpr int64_t kMergeBytes = int64_t{1} << 20;

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

}  // namespace

std::vector<int64_t> block_groups(const std::vector<at::Tensor>& params, const tk::Blocks* blocks) {
  std::vector<int64_t> groups(params.size(), -1);
  std::map<const c10::TensorImpl*, size_t> index;
  for (size_t i = 0; i < params.size(); ++i) index.emplace(params[i].unsafeGetTensorImpl(), i);
  for (size_t b = blocks ? blocks->size() : 0; b-- > 0;)  // from the last block: each keeps its first
    for (const auto& p : blocks->parameters(b))
      if (auto it = index.find(p.unsafeGetTensorImpl()); it != index.end()) groups[it->second] = static_cast<int64_t>(b);
  return groups;
}

GradientShards::GradientShards(std::vector<at::Tensor> params, std::vector<std::string> names,
                               const std::vector<int>& owners, tk::World& world, const std::vector<int64_t>& groups)
    : params_(std::move(params)), names_(std::move(names)), bucket_of_(params_.size()), fired_(params_.size(), 0),
      rank_(world.rank()) {
  if (owners.size() != params_.size() || names_.size() != params_.size())
    throw Error("stage 2: " + std::to_string(owners.size()) + " owners and " + std::to_string(names_.size()) +
                " names for " + std::to_string(params_.size()) + " parameters");
  for (size_t i = 1; i < params_.size(); ++i)
    if (params_[i].device() != params_[0].device())
      throw Error("stage 2 sums the gradients of a model on one device: '" + names_[0] + "' is on " +
                  params_[0].device().str() + ", '" + names_[i] + "' on " + params_[i].device().str());
  if (world.size() > 1) group_ = world.process_group();
  std::map<int64_t, int64_t> group_bytes;  // each block's bytes (all its parameters, whoever owns them)
  for (size_t k = 0; k < groups.size(); ++k) group_bytes[groups[k]] += params_[k].numel() * params_[k].element_size();
  for (size_t k = params_.size(); k-- > 0;) {
    const at::Tensor& p = params_[k];
    const int64_t group = groups.empty() ? -1 : groups[k];
    Bucket* last = buckets_.empty() ? nullptr : &buckets_.back();
    // Another block joins a bucket of blocks that it leaves within kMergeBytes: the bucket is then
    // of the earlier block (backward reaches it last), sent once backward has gone through both.
    const bool joins = last && (last->group == group ||
                                (last->group >= 0 && group >= 0 &&
                                 last->numel * p.element_size() + group_bytes[group] <= kMergeBytes));
    const bool fits = joins && last->owner == owners[k] &&
                      params_[last->params.front()].options().type_equal(p.options()) &&
                      (last->numel + p.numel()) * p.element_size() <= kBucketBytes;
    if (!fits) buckets_.push_back(Bucket{owners[k], {}, 0, 0, group});
    buckets_.back().params.push_back(k);
    buckets_.back().numel += p.numel();
    buckets_.back().group = std::min(buckets_.back().group, group);
    bucket_of_[k] = buckets_.size() - 1;
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[i]);
    if (!accumulator) throw Error("stage 2: trainable parameter '" + names_[i] + "' has no gradient accumulator");
    hooks_.push_back(accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          ready(i);
          return outputs;
        })));
    accumulators_.push_back(std::move(accumulator));
  }
}

GradientShards::~GradientShards() {
  // A reduce still in flight (a run that failed mid-backward) is dropped unwaited: its peers may
  // never come, and the launcher stops them.
  for (size_t i = 0; i < hooks_.size(); ++i) accumulators_[i]->del_post_hook(hooks_[i]);
}

void GradientShards::arm(bool send, bool first, bool last) {
  if (in_flight_) complete();  // left by a backward that failed midway
  if (first) {
    sums_.assign(buckets_.size(), at::Tensor());
    reduces_ = sent_early_ = 0;
    reduce_ms_ = 0.0;
  }
  armed_ = send;
  last_ = last;
  next_ = 0;
  sent_.assign(buckets_.size(), 0);
  for (auto& b : buckets_) b.waiting = static_cast<int64_t>(b.params.size());
  std::fill(fired_.begin(), fired_.end(), 0);
}

void GradientShards::ready(size_t i) {
  if (!armed_) return;
  if (fired_[i])
    throw Error("stage 2: the gradient of '" + names_[i] + "' was accumulated twice in one backward (its grad "
                "accumulator ran again): its bucket may be sent already, so it cannot be summed during backward");
  fired_[i] = 1;
  if (when_settled_) {
    if (sent_[bucket_of_[i]])
      throw Error("stage 3: the gradient of '" + names_[i] + "' came after its bucket was sent: its block ran again "
                  "after backward went through it, or a parameter of the block is used outside it");
    return;
  }
  const size_t b = bucket_of_[i];
  if (--buckets_[b].waiting > 0) return;
  while (next_ < buckets_.size() && buckets_[next_].waiting == 0) {
    send(next_++);
    ++sent_early_;
  }
}

void GradientShards::settle(int64_t block) {
  if (!armed_) return;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (sent_[b] || buckets_[b].group < block) continue;  // not final yet, or of no block (-1)
    send(b);
    sent_[b] = 1;
    ++sent_early_;
  }
}

void GradientShards::send(size_t b) {
  const auto t0 = Clock::now();
  at::NoGradGuard no_grad;
  if (in_flight_) complete();  // one reduce in flight at a time: its buffer is all the memory it adds
  const Bucket& k = buckets_[b];
  at::Tensor flat = at::empty({k.numel}, params_[k.params.front()].options());
  int64_t offset = 0;
  for (size_t i : k.params) {
    at::Tensor& grad = params_[i].mutable_grad();
    at::Tensor slot = flat.slice(0, offset, offset + params_[i].numel());
    offset += params_[i].numel();
    if (grad.defined() && grad.is_sparse())
      throw Error("stage 2 sums dense gradients: '" + names_[i] + "' has a sparse one");
    if (grad.defined())
      slot.copy_(grad.reshape(-1));
    else
      slot.zero_();  // no gradient here: this rank adds nothing
    grad = at::Tensor();
  }
  in_flight_ = std::make_unique<InFlight>(InFlight{b, flat, {}});
  if (group_) {
    std::vector<at::Tensor> tensors{flat};
    c10d::ReduceOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    options.rootRank = k.owner;
    in_flight_->work = group_->reduce(tensors, options);
    ++reduces_;
  }
  reduce_ms_ += ms_since(t0);
}

void GradientShards::complete() {
  const std::unique_ptr<InFlight> f = std::move(in_flight_);
  if (f->work) f->work->wait();
  if (buckets_[f->bucket].owner != rank_) return;
  at::Tensor& sum = sums_[f->bucket];
  if (sum.defined())
    sum.add_(f->flat);
  else
    sum = f->flat;
}

void GradientShards::finish() {
  if (!armed_) return;
  armed_ = false;
  if (when_settled_) {
    for (size_t b = 0; b < buckets_.size(); ++b)
      if (!sent_[b]) send(b);
  } else {
    while (next_ < buckets_.size()) send(next_++);
  }
  const auto t0 = Clock::now();
  if (in_flight_) complete();
  reduce_ms_ += ms_since(t0);
  if (!last_) return;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (buckets_[b].owner != rank_) continue;
    int64_t offset = 0;
    for (size_t i : buckets_[b].params) {
      const at::Tensor& p = params_[i];
      p.mutable_grad() = sums_[b].slice(0, offset, offset + p.numel()).view_as(p);
      offset += p.numel();
    }
  }
  sums_.clear();  // the gradients hold them now; the core releases them after the step
}

}  // namespace tk::shard
