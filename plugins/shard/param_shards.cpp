// ZeRO stage 3's parameters (param_shards.h): freed under their tensors on the ranks that do not
// update them, and broadcast by their owners while a block uses them.
#include "param_shards.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/aminmax.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <tk/error.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <set>

namespace tk::shard {
namespace {

using Clock = std::chrono::steady_clock;

c10::StorageImpl& storage_of(const at::Tensor& t) { return *t.storage().unsafeGetStorageImpl(); }

}  // namespace

std::string dtype_word(at::ScalarType dtype) {
  return dtype == at::kBFloat16 ? "bf16" : dtype == at::kHalf ? "fp16" : c10::toString(dtype);
}

ParameterShards::ParameterShards(std::vector<at::Tensor> params, std::vector<std::string> names,
                                 std::vector<int> owners, tk::World& world, const tk::Blocks* blocks,
                                 const std::vector<int64_t>& groups, bool prefetch,
                                 std::optional<at::ScalarType> narrow)
    : params_(std::move(params)),
      names_(std::move(names)),
      owners_(std::move(owners)),
      holds_(params_.size(), 1),
      masters_(params_.size()),
      rounded_(params_.size(), 0),
      rank_(world.rank()),
      world_(world.size()),
      prefetching_(prefetch),
      narrow_(narrow) {
  std::map<const c10::TensorImpl*, size_t> index;
  std::set<const c10::StorageImpl*> storages;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    const size_t bytes = static_cast<size_t>(p.numel()) * p.element_size();
    if (bytes > 0 && storage_of(p).nbytes() == 0)
      throw Error("stage 3: parameter '" + names_[i] + "' has no memory: a run before this one in the process failed "
                  "while the parameters were sharded, and left it freed; build the model again");
    if (!p.is_contiguous() || p.storage_offset() != 0 || storage_of(p).nbytes() != bytes ||
        !storages.insert(&storage_of(p)).second)
      throw Error("stage 3 frees the memory of the parameters a rank does not update, which needs each to have "
                  "memory of its own: '" + names_[i] + "' shares its memory with another tensor (a view, or a "
                  "slice of a flat buffer); use stage 2");
    bytes_.push_back(bytes);
    (owners_[i] == rank_ ? owned_bytes_ : gathered_bytes_) += static_cast<int64_t>(bytes);  // whole until start()
    index.emplace(p.unsafeGetTensorImpl(), i);
    all_.push_back(i);
  }
  peak_gathered_ = gathered_bytes_;  // every parameter whole until start()
  for (size_t b = 0; blocks && b < blocks->size(); ++b) {
    std::vector<size_t> mine;
    for (const auto& p : blocks->parameters(b))
      if (auto it = index.find(p.unsafeGetTensorImpl()); it != index.end()) mine.push_back(it->second);  // else frozen: whole everywhere
    blocks_.push_back(std::move(mine));
  }
  for (size_t i = 0; i < params_.size(); ++i)
    if (groups[i] < 0) loose_.push_back(i);
  runs_.assign(blocks_.size(), 0);
  if (world_ > 1) group_ = world.side_group("stage 3's parameter gathers");
}

ParameterShards::~ParameterShards() {
  // An owner's values under the rounded ones it computed with (a step cut short): back in place.
  for (size_t i = 0; i < params_.size(); ++i) restore_master(i);
}

void ParameterShards::restore_master(size_t i) {
  if (!masters_[i]) return;
  storage_of(params_[i]).set_data_ptr_noswap(std::move(masters_[i]));
  masters_[i] = at::DataPtr();
  gathered_bytes_ -= static_cast<int64_t>(bytes_[i]);
}

bool ParameterShards::narrows() const {
  for (size_t i = 0; i < params_.size(); ++i)
    if (rounds(i, false)) return true;
  return false;
}

bool ParameterShards::rounds(size_t i, bool exact) const {
  return !exact && narrow_ && params_[i].is_floating_point() &&
         params_[i].element_size() > static_cast<int64_t>(c10::elementSize(*narrow_));
}

at::DataPtr ParameterShards::point_into(size_t i, const at::Tensor& flat, int64_t offset) {
  // The parameter's memory is its part of the buffer the broadcast filled, which lives as long as
  // any parameter points into it: no copy, and no second buffer.
  auto* keep = new at::Tensor(flat);
  void* data = static_cast<char*>(flat.data_ptr()) + offset * flat.element_size();
  c10::StorageImpl& s = storage_of(params_[i]);
  at::DataPtr before = s.set_data_ptr(
      at::DataPtr(data, keep, [](void* held) { delete static_cast<at::Tensor*>(held); }, params_[i].device()));
  s.set_nbytes(bytes_[i]);
  return before;
}

void ParameterShards::free(size_t i) {
  c10::StorageImpl& s = storage_of(params_[i]);
  s.set_data_ptr_noswap(at::DataPtr(nullptr, params_[i].device()));
  s.set_nbytes(0);
}

ParameterShards::Flight ParameterShards::launch(const std::vector<size_t>& which, bool exact) {
  // One broadcast per owner and dtype, in that order on every rank.
  std::map<std::pair<int, int>, std::vector<size_t>> by_owner;
  int64_t again = 0;  // sent again unrounded to this rank: held twice until they land
  for (size_t i : which) {
    // An exact gather of a parameter held rounded sends it again, unrounded, into its place: from
    // there on it is exact until let go (the owner's own values are back under it now).
    const bool refresh = exact && holds_[i] > 0 && rounded_[i];
    if (holds_[i]++ > 0 && !refresh) continue;
    if (refresh) {
      rounded_[i] = 0;
      restore_master(i);
      if (owners_[i] != rank_) again += static_cast<int64_t>(bytes_[i]);
    } else if (owners_[i] != rank_) {
      gathered_bytes_ += static_cast<int64_t>(bytes_[i]);
      peak_gathered_ = std::max(peak_gathered_, gathered_bytes_);
    }
    if (params_[i].numel() > 0) by_owner[{owners_[i], static_cast<int>(params_[i].scalar_type())}].push_back(i);
  }
  peak_gathered_ = std::max(peak_gathered_, gathered_bytes_ + again);
  Flight f;
  const auto t0 = Clock::now();
  at::NoGradGuard no_grad;
  for (const auto& [key, mine] : by_owner) {
    Flight::Part part;
    part.root = key.first;
    part.rounded = rounds(mine.front(), exact);  // one dtype to a part
    if (!group_ && !part.rounded && part.root == rank_) continue;  // alone, a rank holds its parameters whole
    part.into = mine;
    int64_t numel = 0;
    std::vector<at::Tensor> own;
    for (size_t i : mine) {
      // variable_data(): the parameter's values without its autograd history.
      if (part.root == rank_) own.push_back(params_[i].variable_data().view({-1}));
      numel += params_[i].numel();
    }
    const at::ScalarType dtype = part.rounded ? *narrow_ : params_[mine.front()].scalar_type();
    // A world planned by one rank alone (a dry run) gathers what it cannot receive as zeros: the
    // memory of the gather, for the planner's measurements, without the values.
    const auto options = params_[mine.front()].options().dtype(dtype);
    at::Tensor flat = part.root == rank_ ? at::cat(own).to(dtype) : group_ ? at::empty({numel}, options) : at::zeros({numel}, options);
    // Rounded values go as their bits, in fp16 clothes: Gloo (LibTorch 1.13) broadcasts no bf16.
    part.flat = {part.rounded ? flat.view(at::kHalf) : flat};
    if (group_) {
      c10d::BroadcastOptions broadcast;
      broadcast.rootRank = part.root;
      part.work = group_->broadcast(part.flat, broadcast);
      ++traffic_.gathers;
      if (part.root != rank_) traffic_.bytes += numel * part.flat.front().element_size();
    }
    f.parts.push_back(std::move(part));
  }
  traffic_.ms += std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  return f;
}

void ParameterShards::check_fits() const {
  at::NoGradGuard no_grad;
  std::vector<size_t> mine;
  std::vector<at::Tensor> ends;  // per parameter of mine: its smallest and largest value, no copy of it
  for (size_t i = 0; i < params_.size(); ++i) {
    if (owners_[i] != rank_ || !rounds(i, false) || params_[i].numel() == 0) continue;
    const auto [low, high] = at::aminmax(params_[i].variable_data());
    ends.push_back(at::stack({low, high}).to(at::kDouble));
    mine.push_back(i);
  }
  if (mine.empty()) return;
  const at::Tensor found = at::cat(ends).cpu();  // one wait for the device
  const double* v = found.data_ptr<double>();
  for (size_t k = 0; k < mine.size(); ++k) {
    const size_t i = mine[k];
    double largest = std::max(std::abs(v[2 * k]), std::abs(v[2 * k + 1]));
    bool lost;
    if (std::isfinite(v[2 * k]) && std::isfinite(v[2 * k + 1])) {
      // Rounding is monotonic: some value rounds to an infinity iff the largest in magnitude does.
      lost = at::scalar_tensor(largest, at::TensorOptions().dtype(params_[i].scalar_type())).to(*narrow_).isinf().item<bool>();
    } else {  // an infinity or a NaN already there (the step's to answer for): its finite values alone
      const at::Tensor values = params_[i].variable_data(), finite = values.isfinite();
      lost = (finite & values.to(*narrow_).isfinite().logical_not()).any().item<bool>();
      if (lost) largest = at::where(finite, values.abs(), at::zeros({}, values.options())).max().item<double>();
    }
    if (!lost) continue;
    const bool fp16 = *narrow_ == at::kHalf;
    throw Error("stage 3: parameter '" + names_[i] + "' does not fit gather_dtype \"" + dtype_word(*narrow_) +
                "\": its largest magnitude, " + std::to_string(largest) + ", rounds to infinity; gather " +
                (fp16 ? "in bf16, whose range is float32's, or " : "") + "in the parameters' dtype (\"param\")");
  }
}

void ParameterShards::land(Flight& f) {
  const auto t0 = Clock::now();
  at::NoGradGuard no_grad;
  while (!f.parts.empty()) {  // each part taken out as it lands: none lands twice
    Flight::Part part = std::move(f.parts.front());
    f.parts.erase(f.parts.begin());
    if (part.work) part.work->wait();
    const bool mine = part.root == rank_;
    if (mine && !part.rounded) continue;
    // Rounded: what came, in the parameters' dtype; the owner computes with it too.
    const at::Tensor& came = part.flat.front();
    const at::Tensor flat = part.rounded ? came.view(*narrow_).to(params_[part.into.front()].scalar_type()) : came;
    if (part.rounded && !mine)  // what came, beside its widened copy until this part has landed
      peak_gathered_ = std::max(peak_gathered_, gathered_bytes_ + came.numel() * came.element_size());
    int64_t offset = 0;
    for (size_t i : part.into) {
      if (mine && masters_[i])
        throw Error("stage 3: parameter '" + names_[i] + "' rounded again while its owner's values are set aside");
      at::DataPtr before = point_into(i, flat, offset);
      offset += params_[i].numel();
      rounded_[i] = part.rounded;
      if (!mine) continue;
      masters_[i] = std::move(before);  // the owner's own values, back at release
      gathered_bytes_ += static_cast<int64_t>(bytes_[i]);
      peak_gathered_ = std::max(peak_gathered_, gathered_bytes_);
    }
  }
  traffic_.ms += std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

void ParameterShards::gather(const std::vector<size_t>& which, bool exact) {
  Flight f = launch(which, exact);
  land(f);
}

bool ParameterShards::take_prefetched(size_t b, bool backward) {
  if (!prefetch_) return false;
  Prefetch taken = std::move(*prefetch_);  // gone, whatever landing it throws
  prefetch_.reset();
  const bool mine = taken.block == b && taken.backward == backward;
  land(taken.flight);
  if (!mine) release(blocks_[taken.block]);  // not what came next: its holds go
  return mine;
}

void ParameterShards::prefetch(size_t b, bool backward) {
  if (!prefetching_) return;
  take_prefetched(SIZE_MAX, false);  // one in flight at a time: one still unclaimed is let go
  prefetch_ = Prefetch{b, backward, launch(blocks_[b])};
}

void ParameterShards::release(const std::vector<size_t>& which) {
  for (size_t i : which) {
    if (holds_[i] == 0) throw Error("stage 3: parameter '" + names_[i] + "' released more often than gathered");
    if (--holds_[i] > 0) continue;
    rounded_[i] = 0;
    if (owners_[i] != rank_) {
      free(i);
      gathered_bytes_ -= static_cast<int64_t>(bytes_[i]);
    } else {
      restore_master(i);  // the owner's rounded copy goes, its own values come back
    }
  }
}

void ParameterShards::start() {
  if (started_) return;
  started_ = true;
  release(all_);
  peak_gathered_ = gathered_bytes_;  // from here on, what the sharded run holds
}

void ParameterShards::gather_all() {
  take_prefetched(SIZE_MAX, false);
  gather(all_, /*exact=*/true);
}
void ParameterShards::release_all() { release(all_); }
void ParameterShards::gather_loose() {
  if (loose_held_) return;
  gather(loose_);
  loose_held_ = true;
}

void ParameterShards::release_loose() {
  if (!loose_held_) return;
  release(loose_);
  loose_held_ = false;
}

void ParameterShards::start_evaluation() {
  gather_loose();
  evaluating_ = true;
}

void ParameterShards::end_evaluation() {
  evaluating_ = false;
  take_prefetched(SIZE_MAX, false);  // a forward cut short leaves its prefetch
  release_loose();
}

bool ParameterShards::all_whole() const {
  // A parameter held by a gather still in flight has no memory yet.
  for (size_t i = 0; i < params_.size(); ++i)
    if (owners_[i] != rank_ && (holds_[i] == 0 || storage_of(params_[i]).nbytes() != bytes_[i])) return false;
  return true;
}

at::Tensor ParameterShards::run_block(size_t b, const at::Tensor& x, const tk::BlockFn& fn) {
  const std::vector<size_t>& which = blocks_.at(b);
  // Backward is through the block once its input's gradient is complete: the hook goes on the
  // input as the block gets it (a block that changes it in place moves it to its own node). It
  // counts only if backward comes through the block (the output hooked below).
  std::weak_ptr<ParameterShards> self = weak_from_this();
  auto hooked = std::make_shared<bool>(false);
  // (Not on a leaf, whose hooks outlive the graph: one more each micro-batch.)
  if (at::GradMode::is_enabled() && x.requires_grad() && !x.is_leaf())
    x.register_hook([self, b, hooked](const at::Tensor&) {
      auto s = self.lock();
      if (s && *hooked) s->backward_done(b);
    });
  if (!take_prefetched(b, false)) gather(which);
  // The next block's parameters come while this one computes (every rank makes the same calls).
  if ((evaluating_ || at::GradMode::is_enabled()) && b + 1 < blocks_.size()) prefetch(b + 1, false);
  at::Tensor y;
  try {
    y = fn(x);
  } catch (...) {
    release(which);
    throw;
  }
  release(which);
  if (!at::GradMode::is_enabled() || !y.requires_grad()) return y;
  // Backward needs the parameters again when it reaches the block's output.
  y.register_hook([self, b](const at::Tensor&) {
    if (auto s = self.lock()) s->backward_gather(b);
  });
  *hooked = true;
  ++runs_[b];
  return y;
}

void ParameterShards::backward_gather(size_t b) {
  if (!take_prefetched(b, true)) gather(blocks_[b]);
  pending_.push_back(b);
  deferred_.reset();
  // Backward reaches the block before next (its output hooked in this forward). While the block
  // after this one is still held (its input's gradient, the hook on which lets it go, is this
  // block's output's), that gather waits for it to go: backward then holds two blocks, not three.
  if (b == 0 || runs_[b - 1] == 0) return;
  if (std::find(pending_.begin(), pending_.end(), b + 1) != pending_.end()) deferred_ = b - 1;
  else prefetch(b - 1, true);
}

void ParameterShards::backward_done(size_t b) {
  auto it = std::find(pending_.rbegin(), pending_.rend(), b);
  if (it != pending_.rend()) {
    release(blocks_[b]);
    pending_.erase(std::next(it).base());
  }
  if (deferred_ && *deferred_ + 2 == b) {
    const size_t next = *deferred_;
    deferred_.reset();
    prefetch(next, true);
  }
  // A block run more than once in the forward: its gradients are final after the last run's backward.
  if (runs_[b] > 0 && --runs_[b] == 0 && done_) done_(b);
}

void ParameterShards::after_backward() {
  deferred_.reset();
  take_prefetched(SIZE_MAX, false);
  for (size_t b : pending_) release(blocks_[b]);
  pending_.clear();
  std::fill(runs_.begin(), runs_.end(), 0);
}

void ParameterShards::check_released() const {
  for (size_t i = 0; i < params_.size(); ++i)
    if (holds_[i] > 0 && (owners_[i] != rank_ || masters_[i]))
      throw Error("stage 3: parameter '" + names_[i] + "' is still gathered at the step (" + std::to_string(holds_[i]) +
                  " holders): its values would not follow its owner's update");
}

ParameterShards::Traffic ParameterShards::take_traffic() {
  Traffic t = traffic_;
  t.peak_bytes = owned_bytes_ + peak_gathered_;
  traffic_ = {};
  peak_gathered_ = gathered_bytes_;
  return t;
}

}  // namespace tk::shard
