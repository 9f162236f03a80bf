// ZeRO stage 3's parameters (param_shards.h): freed under their tensors on the ranks that do not
// update them, and broadcast by their owners while a block uses them.
#include "param_shards.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <tk/error.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <set>

namespace tk::shard {
namespace {

using Clock = std::chrono::steady_clock;

c10::StorageImpl& storage_of(const at::Tensor& t) { return *t.storage().unsafeGetStorageImpl(); }

}  // namespace

ParameterShards::ParameterShards(std::vector<at::Tensor> params, std::vector<std::string> names,
                                 std::vector<int> owners, tk::World& world, const tk::Blocks* blocks)
    : params_(std::move(params)),
      names_(std::move(names)),
      owners_(std::move(owners)),
      holds_(params_.size(), 1),
      rank_(world.rank()),
      world_(world.size()) {
  std::map<const c10::TensorImpl*, size_t> index;
  std::set<const c10::StorageImpl*> storages;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    const size_t bytes = static_cast<size_t>(p.numel()) * p.element_size();
    if (!p.is_contiguous() || p.storage_offset() != 0 || storage_of(p).nbytes() != bytes ||
        !storages.insert(&storage_of(p)).second || !storage_of(p).allocator())
      throw Error("stage 3 frees the memory of the parameters a rank does not update, which needs each to have "
                  "memory of its own: '" + names_[i] + "' shares its memory with another tensor (a view, or a "
                  "slice of a flat buffer); use stage 2");
    bytes_.push_back(bytes);
    index.emplace(p.unsafeGetTensorImpl(), i);
    all_.push_back(i);
  }
  std::vector<size_t> first(params_.size(), SIZE_MAX);  // the first block that lists each
  std::vector<char> in_block(params_.size(), 0);
  for (size_t b = 0; blocks && b < blocks->size(); ++b) {
    std::vector<size_t> mine;
    for (const auto& p : blocks->parameters(b)) {
      auto it = index.find(p.unsafeGetTensorImpl());
      if (it == index.end()) continue;  // frozen: whole everywhere
      mine.push_back(it->second);
      in_block[it->second] = 1;
      first[it->second] = std::min(first[it->second], b);
    }
    blocks_.push_back(std::move(mine));
  }
  for (size_t i = 0; i < params_.size(); ++i)
    if (!in_block[i]) loose_.push_back(i);
  for (size_t b = 0; b < blocks_.size(); ++b) {
    std::vector<char> settled(params_.size(), 0);
    for (size_t i = 0; i < params_.size(); ++i) settled[i] = in_block[i] ? first[i] >= b : 2;
    settled_.push_back(std::move(settled));
  }
  if (world_ > 1) group_ = world.side_group("stage 3's parameter gathers");
}

ParameterShards::~ParameterShards() = default;

void ParameterShards::allocate(size_t i) {
  c10::StorageImpl& s = storage_of(params_[i]);
  s.set_data_ptr_noswap(s.allocator()->allocate(bytes_[i]));
  s.set_nbytes(bytes_[i]);
}

void ParameterShards::free(size_t i) {
  c10::StorageImpl& s = storage_of(params_[i]);
  s.set_data_ptr_noswap(at::DataPtr(nullptr, params_[i].device()));
  s.set_nbytes(0);
}

void ParameterShards::gather(const std::vector<size_t>& which) {
  std::vector<std::vector<size_t>> by_owner(static_cast<size_t>(world_));
  for (size_t i : which) {
    if (holds_[i]++ > 0) continue;
    if (owners_[i] != rank_) allocate(i);
    if (params_[i].numel() > 0) by_owner[static_cast<size_t>(owners_[i])].push_back(i);
  }
  if (!group_) return;
  const auto t0 = Clock::now();
  at::NoGradGuard no_grad;
  for (int r = 0; r < world_; ++r) {
    const auto& mine = by_owner[static_cast<size_t>(r)];
    if (mine.empty()) continue;
    // variable_data(): the parameter's memory under a tensor of its own, whose writes do not count
    // as changes of the parameter (autograd's saved views of it stay valid).
    std::vector<at::Tensor> parts;
    int64_t numel = 0;
    for (size_t i : mine) {
      parts.push_back(params_[i].variable_data().view({-1}));
      numel += params_[i].numel();
    }
    std::vector<at::Tensor> flat{r == rank_ ? at::cat(parts) : at::empty({numel}, parts.front().options())};
    c10d::BroadcastOptions options;
    options.rootRank = r;
    group_->broadcast(flat, options)->wait();
    ++traffic_.gathers;
    if (r == rank_) continue;
    traffic_.bytes += numel * flat.front().element_size();
    int64_t offset = 0;
    for (auto& part : parts) {
      part.copy_(flat.front().slice(0, offset, offset + part.numel()));
      offset += part.numel();
    }
  }
  traffic_.ms += std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

void ParameterShards::release(const std::vector<size_t>& which) {
  for (size_t i : which) {
    if (holds_[i] == 0) throw Error("stage 3: parameter '" + names_[i] + "' released more often than gathered");
    if (--holds_[i] == 0 && owners_[i] != rank_) free(i);
  }
}

void ParameterShards::start() {
  if (started_) return;
  started_ = true;
  release(all_);
}

void ParameterShards::gather_all() { gather(all_); }
void ParameterShards::release_all() { release(all_); }
void ParameterShards::gather_loose() { gather(loose_); }
void ParameterShards::release_loose() { release(loose_); }

bool ParameterShards::all_whole() const {
  for (size_t i = 0; i < params_.size(); ++i)
    if (holds_[i] == 0 && owners_[i] != rank_) return false;
  return true;
}

at::Tensor ParameterShards::run_block(size_t b, const at::Tensor& x, const tk::BlockFn& fn) {
  const std::vector<size_t>& which = blocks_.at(b);
  gather(which);
  at::Tensor y;
  try {
    y = fn(x);
  } catch (...) {
    release(which);
    throw;
  }
  release(which);
  if (!at::GradMode::is_enabled() || !y.requires_grad()) return y;
  // Backward needs the parameters again when it reaches the block's output, and no longer once
  // its input's gradient is complete (every node of the block has run).
  std::weak_ptr<ParameterShards> self = weak_from_this();
  y.register_hook([self, b](const at::Tensor&) {
    if (auto s = self.lock()) s->backward_gather(b);
  });
  if (x.requires_grad())
    x.register_hook([self, b](const at::Tensor&) {
      if (auto s = self.lock()) s->backward_done(b);
    });
  return y;
}

void ParameterShards::backward_gather(size_t b) {
  gather(blocks_[b]);
  pending_.push_back(b);
}

void ParameterShards::backward_done(size_t b) {
  auto it = std::find(pending_.rbegin(), pending_.rend(), b);
  if (it != pending_.rend()) {
    release(blocks_[b]);
    pending_.erase(std::next(it).base());
  }
  if (done_) done_(b);
}

void ParameterShards::after_backward() {
  for (size_t b : pending_) release(blocks_[b]);
  pending_.clear();
}

int64_t ParameterShards::resident_bytes() const {
  int64_t n = 0;
  for (size_t i = 0; i < params_.size(); ++i)
    if (holds_[i] > 0 || owners_[i] == rank_) n += static_cast<int64_t>(bytes_[i]);
  return n;
}

ParameterShards::Traffic ParameterShards::take_traffic() {
  Traffic t = traffic_;
  traffic_ = {};
  return t;
}

}  // namespace tk::shard
