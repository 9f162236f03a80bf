// ZeRO stage 1: the recipe's optimizer over this rank's share of the parameters, the updated
// parameters broadcast by their owners, and checkpoints that hold every share.
#include "sharded.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/optim/lbfgs.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <tk/compat.h>
#include <tk/error.h>

#include <algorithm>
#include <chrono>
#include <numeric>
#include <sstream>

namespace tk::shard {
namespace {

/// Parameters broadcast together after a step (as PyTorch DDP's bucket_cap_mb).
constexpr size_t kBucketBytes = 25u << 20;

const char* const kWorldKey = "zero_world_size";
const char* const kOwnersKey = "zero_owners";
std::string shard_key(int r) { return "zero_shard_" + std::to_string(r); }

at::Tensor read_tensor(torch::serialize::InputArchive& a, const std::string& key) {
  at::Tensor t;
  if (!a.try_read(key, t, /*is_buffer=*/true))
    throw Error("the sharded optimizer state in the checkpoint has no '" + key + "': it is damaged");
  return t;
}

}  // namespace

int64_t bytes_of(const at::Tensor& t) { return static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size()); }

std::vector<int> contiguous_partition(const std::vector<at::Tensor>& params, int world) {
  int64_t total = 0;
  for (const auto& p : params) total += bytes_of(p);
  std::vector<int> owners(params.size(), 0);
  int r = 0;
  size_t first = 0;     // rank r's first tensor
  int64_t before = 0;   // bytes of the tensors before i
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t b = bytes_of(params[i]);
    const bool past = static_cast<double>(before) + static_cast<double>(b) / 2 >
                      static_cast<double>(total) * (r + 1) / world;  // its middle lies beyond rank r's stretch
    const bool needed = params.size() - i == static_cast<size_t>(world - 1 - r);  // one left for each later rank
    if (r < world - 1 && i > first && (past || needed)) {
      ++r;
      first = i;
    }
    owners[i] = r;
    before += b;
  }
  return owners;
}

std::vector<int> partition(const std::vector<at::Tensor>& params, int world) {
  std::vector<size_t> order(params.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return bytes_of(params[a]) > bytes_of(params[b]); });
  std::vector<int64_t> load(static_cast<size_t>(world), 0);
  std::vector<int> owners(params.size(), 0);
  for (size_t i : order) {
    const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    owners[i] = r;
    load[static_cast<size_t>(r)] += bytes_of(params[i]);
  }
  return owners;
}

std::unique_ptr<ShardedOptimizer> ShardedOptimizer::make(std::vector<at::Tensor> params, tk::World& comm,
                                                         tk::OptimizerFactory inner, int stage) {
  const int rank = comm.rank(), world = comm.size();
  const std::string named = "stage " + std::to_string(stage);
  if (static_cast<int64_t>(params.size()) < world)  // the plugin refuses this at its recipe line, before
    throw std::logic_error("ShardedOptimizer::make: fewer trainable tensors than ranks");
  std::vector<int> owners = stage >= 2 ? contiguous_partition(params, world) : partition(params, world);
  std::vector<at::Tensor> mine;
  for (size_t i = 0; i < params.size(); ++i)
    if (owners[i] == rank) mine.push_back(params[i]);
  auto shard = inner(mine);
  if (!shard) throw Error(named + ": the recipe's optimizer factory made no optimizer");
  if (dynamic_cast<const torch::optim::LBFGS*>(shard.get()))
    throw Error(named + " cannot shard LBFGS: its step looks at every parameter at once");
  return std::unique_ptr<ShardedOptimizer>(
      new ShardedOptimizer(std::move(params), std::move(owners), comm, std::move(shard), std::move(inner), stage));
}

ShardedOptimizer::ShardedOptimizer(std::vector<at::Tensor> params, std::vector<int> owners, tk::World& comm,
                                   std::unique_ptr<torch::optim::Optimizer> shard, tk::OptimizerFactory make, int stage)
    : Optimizer(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(params)},
                shard->defaults().clone()),
      params_(std::move(params)),
      owners_(std::move(owners)),
      by_rank_(static_cast<size_t>(comm.size())),
      rank_(comm.rank()),
      world_(comm.size()),
      shard_(std::move(shard)),
      make_(std::move(make)),
      comm_(comm),
      stage_(stage) {
  for (size_t i = 0; i < params_.size(); ++i) by_rank_[static_cast<size_t>(owners_[i])].push_back(params_[i]);
}

int64_t ShardedOptimizer::owned_bytes(int r) const {
  int64_t n = 0;
  for (const auto& p : by_rank_.at(static_cast<size_t>(r))) n += bytes_of(p);
  return n;
}

int64_t ShardedOptimizer::state_bytes() const { return tk::optimizer_state_bytes(*shard_); }

at::Tensor ShardedOptimizer::step(LossClosure closure) {
  if (closure) throw Error("the sharded optimizer (the shard plugin's stage 1 to 3) takes no closure");
  // The core set the learning rate on this optimizer's group; the shard's groups follow it.
  const double lr = param_groups().front().options().get_lr();
  for (auto& g : shard_->param_groups()) g.options().set_lr(lr);
  shard_->step();
  const auto t0 = std::chrono::steady_clock::now();
  // Stage 3: the others gather the updated parameters when they use them.
  if (auto group = world_ > 1 && stage_ < 3 ? comm_.process_group() : c10::intrusive_ptr<c10d::ProcessGroup>()) {
    torch::NoGradGuard no_grad;
    for (int r = 0; r < world_; ++r) c10d::broadcast_coalesced(group, by_rank_[static_cast<size_t>(r)], kBucketBytes, r);
  }
  broadcast_ms_ = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return {};
}

void ShardedOptimizer::attach(std::shared_ptr<ParameterShards> parameters) {
  parameters_ = std::move(parameters);
  keeper_.clear();
  for (size_t i = 0; parameters_ && i < params_.size(); ++i) keeper_.emplace(params_[i].unsafeGetTensorImpl(), owners_[i]);
}

int64_t ShardedOptimizer::keeper_of(const at::Tensor& param) const {
  const auto it = keeper_.find(param.unsafeGetTensorImpl());
  return it == keeper_.end() ? -1 : it->second;
}

void ShardedOptimizer::gather_parameters() const {
  if (parameters_) parameters_->gather_all();
}

void ShardedOptimizer::release_parameters() const {
  if (parameters_) parameters_->release_all();
}

bool ShardedOptimizer::parameters_whole() const { return !parameters_ || parameters_->all_whole(); }

at::Device ShardedOptimizer::shard_device() const {
  // Where the backend sends from: the parameters' device (NCCL needs the GPU).
  return params_.empty() ? at::Device(at::kCPU) : params_.front().device();
}

std::vector<at::Tensor> ShardedOptimizer::gather_shards() const {
  torch::serialize::OutputArchive archive;
  shard_->save(archive);
  std::ostringstream os;
  archive.save_to(os);
  const std::string bytes = os.str();
  at::Tensor mine = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(mine.data_ptr(), bytes.data(), bytes.size());
  std::vector<at::Tensor> shards(static_cast<size_t>(world_));
  shards[static_cast<size_t>(rank_)] = mine;
  const auto group = world_ > 1 ? comm_.process_group() : c10::intrusive_ptr<c10d::ProcessGroup>();
  if (!group) return shards;
  // Each rank's size, then each share sent to rank 0 in turn (point to point: no rank but 0 ever
  // holds more than its own share).
  auto sizes = at::zeros({world_}, at::kLong);
  sizes[rank_] = static_cast<int64_t>(bytes.size());
  comm_.all_reduce(sizes);
  const at::Device device = shard_device();
  for (int r = 1; r < world_; ++r) {
    if (rank_ == r) {
      std::vector<at::Tensor> out{mine.to(device)};
      group->send(out, 0, r)->wait();
    } else if (rank_ == 0) {
      std::vector<at::Tensor> in{at::empty({sizes[r].item<int64_t>()}, at::TensorOptions(at::kByte).device(device))};
      group->recv(in, r, r)->wait();
      shards[static_cast<size_t>(r)] = in[0].cpu();
    }
  }
  return shards;
}

void ShardedOptimizer::save(torch::serialize::OutputArchive& archive) const {
  const auto shards = gather_shards();
  if (rank_ != 0) return;
  archive.write(kWorldKey, at::tensor(std::vector<int64_t>{world_}), /*is_buffer=*/true);
  archive.write(kOwnersKey, at::tensor(std::vector<int64_t>(owners_.begin(), owners_.end())), /*is_buffer=*/true);
  for (int r = 0; r < world_; ++r) archive.write(shard_key(r), shards[static_cast<size_t>(r)], /*is_buffer=*/true);
}

void ShardedOptimizer::adopt(torch::optim::Optimizer& from) {
  auto& src = from.state();
  auto& dst = shard_->state();
  for (const auto& p : by_rank_[static_cast<size_t>(rank_)]) {
    auto it = src.find(compat::optimizer_state_key(src, p));
    if (it != src.end()) dst[compat::optimizer_state_key(dst, p)] = std::move(it->second);
  }
}

void ShardedOptimizer::load(torch::serialize::InputArchive& archive) {
  at::Tensor saved_world;
  if (!archive.try_read(kWorldKey, saved_world, /*is_buffer=*/true)) {
    // An unsharded optimizer's state (a checkpoint of stage 0, or without the shard plugin): the whole optimizer over
    // every parameter, in model order.
    auto whole = make_(params_);
    whole->load(archive);
    adopt(*whole);
    return;
  }
  const int64_t world = saved_world.item<int64_t>();
  const at::Tensor owners = read_tensor(archive, kOwnersKey);
  const std::vector<int64_t> saved(owners.data_ptr<int64_t>(), owners.data_ptr<int64_t>() + owners.numel());
  load_resharded(world, saved, [&](int64_t r, torch::optim::Optimizer& into) {
    const at::Tensor bytes = read_tensor(archive, shard_key(static_cast<int>(r))).contiguous();
    torch::serialize::InputArchive share;
    share.load_from(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.numel()));
    into.load(share);
  });
}

void ShardedOptimizer::save_share(torch::serialize::OutputArchive& share) const { shard_->save(share); }

void ShardedOptimizer::save_layout(torch::serialize::OutputArchive& layout) const {
  layout.write(kWorldKey, at::tensor(std::vector<int64_t>{world_}), /*is_buffer=*/true);
  layout.write(kOwnersKey, at::tensor(std::vector<int64_t>(owners_.begin(), owners_.end())), /*is_buffer=*/true);
}

void ShardedOptimizer::load_shares(torch::serialize::InputArchive& layout, int64_t count, const ShareReader& read) {
  const int64_t world = read_tensor(layout, kWorldKey).item<int64_t>();
  if (world != count)
    throw Error("the checkpoint holds " + std::to_string(count) + " shares of the optimizer state for a world of " +
                std::to_string(world) + " ranks: it is damaged");
  const at::Tensor owners = read_tensor(layout, kOwnersKey).to(at::kLong).contiguous();
  const std::vector<int64_t> saved(owners.data_ptr<int64_t>(), owners.data_ptr<int64_t>() + owners.numel());
  load_resharded(world, saved, [&](int64_t r, torch::optim::Optimizer& into) {
    torch::serialize::InputArchive share;
    read(r, share);
    into.load(share);
  });
}

void ShardedOptimizer::load_resharded(int64_t world, const std::vector<int64_t>& saved,
                                      const std::function<void(int64_t, torch::optim::Optimizer&)>& load_share) {
  if (saved.size() != params_.size())
    throw Error("the sharded optimizer state in the checkpoint covers " + std::to_string(saved.size()) +
                " parameters; this model has " + std::to_string(params_.size()) + " trainable ones");
  for (int64_t owner : saved)
    if (owner < 0 || owner >= world)
      throw Error("the sharded optimizer state in the checkpoint gives a parameter to rank " + std::to_string(owner) +
                  " of " + std::to_string(world) + ": it is damaged");
  if (world == world_ && std::equal(saved.begin(), saved.end(), owners_.begin())) {
    load_share(rank_, *shard_);
    return;
  }
  // Another world (or partition): each saved share that holds one of this rank's parameters is
  // loaded into an optimizer over that share's parameters, and their states move here.
  for (int64_t r = 0; r < world; ++r) {
    std::vector<at::Tensor> theirs;
    bool needed = false;
    for (size_t i = 0; i < params_.size(); ++i)
      if (saved[i] == r) {
        theirs.push_back(params_[i]);
        needed = needed || owners_[i] == rank_;
      }
    if (!needed) continue;
    auto share = make_(theirs);
    load_share(r, *share);
    adopt(*share);
  }
}

}  // namespace tk::shard
