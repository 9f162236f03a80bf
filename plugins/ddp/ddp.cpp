// Distributed data parallel on PyTorch's c10d: a TCPStore rendezvous, ProcessGroupGloo on CPU
// (ProcessGroupNCCL on CUDA where LibTorch was built with it), and c10d's Reducer, the bucketed
// gradient all-reduce that PyTorch's DistributedDataParallel runs on.
//
// Every rank starts from rank 0's parameters and buffers (after checking that every rank built
// the same model), reads its own shard of each epoch (the core strides the shared shuffle by
// rank) and accumulates gradients locally over a window's micro-batches. The window's last
// backward is the one the reducer is armed for: as each bucket of gradients becomes ready, its
// sum over ranks is launched while backward goes on computing the rest, so communication
// overlaps computation. Parameters a rank did not use get zeros from it (the unused-parameter
// search, on by default), so ranks may take different branches of a model. At the boundary the
// window's totals (micro-batches, samples, tokens, loss) are summed too, so that normalization
// divides by the global counts and the step equals the single-process step on the global window.
//
// The world comes from the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
// MASTER_PORT) or Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, with MASTER_ADDR and
// MASTER_PORT given); `tk-run --nproc N` sets the former. Without them the world is one process.
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
#include <tk/abi.h>
#include <tk/compat.h>

#include "sharded.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <sstream>

namespace {

struct World {
  int rank = 0, size = 1, local_rank = 0;
  std::string addr = "127.0.0.1";
  int port = 29500;
  std::string source = "single process";
};

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

int env_int(const char* name, int fallback) {
  const char* v = env(name);
  if (!v) return fallback;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  if (*end != '\0') throw tk::Error(std::string("environment variable ") + name + "=" + v + " is not an integer");
  return static_cast<int>(x);
}

World detect_world() {
  World w;
  if (env("WORLD_SIZE")) {
    w.size = env_int("WORLD_SIZE", 1);
    w.rank = env_int("RANK", 0);
    w.local_rank = env_int("LOCAL_RANK", w.rank);
    w.source = "RANK/WORLD_SIZE";
  } else if (env("SLURM_NTASKS")) {
    w.size = env_int("SLURM_NTASKS", 1);
    w.rank = env_int("SLURM_PROCID", 0);
    w.local_rank = env_int("SLURM_LOCALID", 0);
    w.source = "SLURM_PROCID/SLURM_NTASKS";
    if (w.size > 1 && !env("MASTER_ADDR"))
      throw tk::Error("under Slurm, set MASTER_ADDR (e.g. the first host of $SLURM_JOB_NODELIST) and MASTER_PORT");
  }
  if (const char* a = env("MASTER_ADDR")) w.addr = a;
  w.port = env_int("MASTER_PORT", 29500);
  if (w.size < 1 || w.rank < 0 || w.rank >= w.size)
    throw tk::Error("rank " + std::to_string(w.rank) + " is outside a world of " + std::to_string(w.size) + " (" +
                    w.source + ")");
  if (w.port < 1 || w.port > 65535) throw tk::Error("MASTER_PORT=" + std::to_string(w.port) + " is not a port");
  return w;
}

using Clock = std::chrono::steady_clock;

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

/// When the reducer launched the all-reduces of the current window's last backward. The reducer
/// calls its communication hook from autograd's thread (the caller's on the CPU, a device thread
/// on CUDA); the plugin reads these after backward has returned.
struct Launches {
  std::mutex m;
  Clock::time_point first, last;
  int64_t count = 0;

  void reset() {
    std::lock_guard<std::mutex> lock(m);
    count = 0;
  }
  void launched() {
    std::lock_guard<std::mutex> lock(m);
    last = Clock::now();
    if (count++ == 0) first = last;
  }
};

/// The reducer's communication hook: each bucket summed over ranks, in place. (Without a hook the
/// reducer divides by the world size; trainkit's normalization divides by the window's global
/// counts instead.)
class SumHook final : public c10d::CommHookInterface {
 public:
  SumHook(c10::intrusive_ptr<c10d::ProcessGroup> group, std::shared_ptr<Launches> launches)
      : group_(std::move(group)), launches_(std::move(launches)) {}
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    launches_->launched();
    std::vector<at::Tensor> tensors{bucket.getBufferRef()};
    return group_->allreduce(tensors)->getFuture();
  }
  /// The all-reduce's future holds the list of tensors it reduced: one, the bucket.
  at::Tensor parseHookResult(const c10::IValue& result) override {
    return result.isTensor() ? result.toTensor() : result.toTensorVector().at(0);
  }

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::shared_ptr<Launches> launches_;
};

/// c10d's Reducer, told which parameters a window's earlier micro-batches used. LibTorch 1.x's
/// reducer records use only in the backward it is armed for (a window's last; 2.x records it in
/// the window's other backwards too, and marking again changes nothing), so a parameter used in an
/// earlier micro-batch and not in the last would count as unused everywhere: its gradient left
/// unsummed on the ranks that have one, absent on the others. Marking every parameter that holds
/// a gradient as used gives it the sum over ranks, zeros for the ranks without one.
class WindowReducer final : public c10d::Reducer {
 public:
  using c10d::Reducer::Reducer;
  /// After prepare_for_backward, before backward (its used-map is cleared when a backward ends).
  void mark_used(const std::vector<int64_t>& indices) {
    if (indices.empty() || !local_used_map_.defined()) return;
    local_used_map_.index_fill_(0, torch::tensor(indices, torch::kLong), 1);
  }
};

/// 64-bit FNV-1a of a name, to compare names across ranks as numbers.
int64_t name_hash(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return static_cast<int64_t>(h >> 1);
}

/// One parameter's or buffer's description, the same width for every tensor: its name's hash,
/// dtype, dimensions (up to kDims; more are folded into the last) and trainability.
constexpr int kDims = 8;
constexpr int kWidth = kDims + 4;

void describe(const std::string& name, const at::Tensor& t, std::vector<int64_t>& out) {
  out.push_back(name_hash(name));
  out.push_back(static_cast<int64_t>(t.scalar_type()));
  out.push_back(t.dim());
  for (int d = 0; d < kDims; ++d) {
    int64_t v = d < t.dim() ? t.size(d) : -1;
    for (int64_t e = kDims; d == kDims - 1 && e < t.dim(); ++e) v = v * 1000003 + t.size(e);
    out.push_back(v);
  }
  out.push_back(t.requires_grad() ? 1 : 0);
}

std::string shape_of(const int64_t* row) {
  std::ostringstream s;
  s << "[";
  for (int64_t d = 0; d < std::min<int64_t>(row[2], kDims); ++d) s << (d ? ", " : "") << row[3 + d];
  if (row[2] > kDims) s << ", ...";
  s << "] " << c10::toString(static_cast<at::ScalarType>(row[1])) << (row[3 + kDims] ? "" : ", frozen");
  return s.str();
}

/// The address of this machine that routes to `host` (a UDP socket connected there sends
/// nothing); "" when it cannot be found.
std::string local_address_towards(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0 || !found) return "";
  std::string out;
  for (addrinfo* a = found; a && out.empty(); a = a->ai_next) {
    const int s = socket(a->ai_family, SOCK_DGRAM, 0);
    if (s < 0) continue;
    sockaddr_storage mine{};
    socklen_t len = sizeof mine;
    char text[INET6_ADDRSTRLEN] = {0};
    if (connect(s, a->ai_addr, a->ai_addrlen) == 0 && getsockname(s, reinterpret_cast<sockaddr*>(&mine), &len) == 0) {
      const void* ip = mine.ss_family == AF_INET ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&mine)->sin_addr)
                                                 : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&mine)->sin6_addr);
      if (inet_ntop(mine.ss_family, ip, text, sizeof text)) out = text;
    }
    close(s);
  }
  freeaddrinfo(found);
  return out;
}

/// The network device Gloo uses on this rank: GLOO_SOCKET_IFNAME's interface when it is set (as
/// in PyTorch), else the address that routes to the rendezvous host (127.0.0.1 for a world on
/// loopback). The host name's address would often be 127.0.1.1 (Debian's /etc/hosts), which
/// other machines cannot reach.
std::shared_ptr<::gloo::transport::Device> gloo_device(const World& w) {
  if (const char* ifname = env("GLOO_SOCKET_IFNAME")) {
    const std::string first = std::string(ifname).substr(0, std::string(ifname).find(','));
    return c10d::ProcessGroupGloo::createDeviceForInterface(first);
  }
  const std::string mine = local_address_towards(w.addr, w.port);
  if (mine.empty())
    throw std::runtime_error("no address of this machine routes to the rendezvous host " + w.addr +
                             " (MASTER_ADDR); set GLOO_SOCKET_IFNAME to the network interface to use");
  return c10d::ProcessGroupGloo::createDeviceForHostname(mine);
}

class Ddp final : public tk::Plugin {
 public:
  void bind(tk::OptionBinder& o) override {
    o.add("backend", backend_, "collective backend: gloo (CPU), nccl (CUDA), auto", {"auto", "gloo", "nccl"});
    o.add("timeout_s", timeout_s_, "seconds a collective may take before the run fails");
    o.add("rendezvous_timeout_s", rendezvous_timeout_s_, "seconds to wait for every rank to join");
    o.add("bucket_mb", bucket_mb_, "size of the gradient buckets all-reduced together (PyTorch DDP's bucket_cap_mb)");
    o.add("first_bucket_mb", first_bucket_mb_,
          "size of the first bucket, the one launched earliest in backward (PyTorch DDP uses 1 MiB)");
    o.add("find_unused_parameters", find_unused_,
          "search each window's last backward for parameters that get no gradient and count them as zero on that "
          "rank; false skips the search for models that use every parameter, and a parameter that turns out unused "
          "is then an error");
    o.add("check_every", check_every_, "every N steps, verify that all ranks hold the same parameters (0: never)");
    o.add("zero_stage", zero_stage_,
          "1: shard the optimizer's state across the ranks (ZeRO stage 1): each rank keeps and updates the state of "
          "its share of the parameters, then broadcasts them; 0: every rank keeps all of it");
  }

  void init() override {
    if (!(timeout_s_ > 0)) fail_option(timeout_s_, "must be > 0");
    if (!(rendezvous_timeout_s_ > 0)) fail_option(rendezvous_timeout_s_, "must be > 0");
    if (!(bucket_mb_ > 0)) fail_option(bucket_mb_, "must be > 0");
    if (!(first_bucket_mb_ > 0)) fail_option(first_bucket_mb_, "must be > 0");
    if (check_every_ < 0) fail_option(check_every_, "must be >= 0");
    if (zero_stage_ != 0 && zero_stage_ != 1)
      fail_option(zero_stage_, "must be 0 or 1 (stage 1 shards the optimizer state; gradients and parameters stay "
                               "whole), got " + std::to_string(zero_stage_));
    timeout_ = std::chrono::milliseconds(static_cast<int64_t>(timeout_s_ * 1000));
    rdv_timeout_ = std::chrono::milliseconds(static_cast<int64_t>(rendezvous_timeout_s_ * 1000));
    bucket_bytes_ = static_cast<int64_t>(std::min(bucket_mb_ * 1024 * 1024, 1e15));
    first_bucket_bytes_ = static_cast<int64_t>(std::min(first_bucket_mb_ * 1024 * 1024, 1e15));
  }

  tk::Contract contract() const override {
    tk::Contract c;
    c.provides = {tk::cap::kGradsSynced, tk::cap::kWorld};
    return c;
  }

  void configure(tk::RunPlan& plan) override {
    world_ = detect_world();  // here, not in init: a launcher reads the plugins before any world exists
    plan.set_world(world_.size, world_.rank);
    // Whether to stop (out of time, a signal) is one decision for the world: a rank that stopped
    // alone would leave the others waiting in their next collective.
    plan.set_world_agreement([this](int64_t v) {
      if (!group_) return v;
      auto t = torch::tensor({v}, torch::kLong);
      allreduce(t, c10d::ReduceOp::MAX);
      return t.item<int64_t>();
    });
    // Without a normalizer, a mean loss is averaged over ranks here, as single-process training
    // would average it over the global batch; a sum loss stays a sum.
    average_ = !plan.has(tk::cap::kGradsNormalized) && plan.reduction() == tk::Reduction::Mean;
    if (backend_ == "auto") backend_ = plan.device() == at::kCUDA ? "nccl" : "gloo";
    if (backend_ == "nccl" && plan.device() != at::kCUDA) fail_option(backend_, "nccl needs the run on CUDA (run.device)");
#ifndef USE_C10D_NCCL
    if (backend_ == "nccl") fail_option(backend_, "this LibTorch was built without NCCL; use gloo");
#endif
  }

  /// With zero_stage = 1 the run's optimizer is the recipe's over this rank's share only.
  void setup(tk::SetupContext& setup) override {
    if (zero_stage_ == 0) return;
    const int rank = world_.rank, size = world_.size;
    setup.wrap_optimizer([rank, size, comm = comm_](std::vector<at::Tensor> trainable, const tk::OptimizerFactory& inner)
                             -> std::unique_ptr<torch::optim::Optimizer> {
      return tk::ddp::ShardedOptimizer::make(std::move(trainable), rank, size, inner, comm);
    });
  }

  void on_fit_start(tk::Context& ctx) override {
    if (auto* sharded = dynamic_cast<tk::ddp::ShardedOptimizer*>(&ctx.optimizer())) describe_shards(ctx, *sharded);
    if (world_.size == 1) return;
    const auto model_params = ctx.model().parameters();
    if (!model_params.empty()) device_ = model_params.front().device();
    join(ctx);
    agree_on_window(ctx.plan());
    check_same_model(ctx.model());
    broadcast_from_rank0(ctx.model());
    build_reducer(ctx);
    comm_->group = group_;
    comm_->device = device_;
    comm_->bucket_bytes = static_cast<size_t>(std::min<int64_t>(bucket_bytes_, 256 << 20));
  }

  void on_loss(tk::Context& ctx) override {
    if (!reducer_) return decline(tk::Event::Loss);
    if (!ctx.window().is_last()) return;  // the window's other micro-batches accumulate locally
    // The buckets are never rebuilt in the order gradients became ready (PyTorch does so once,
    // after the first iteration, without the unused-parameter search): a resumed run then sums in
    // the same buckets, so the same order, as the run it continues.
    std::vector<int64_t> used;
    for (size_t i = 0; i < params_.size(); ++i)
      if (params_[i].grad().defined()) used.push_back(static_cast<int64_t>(i));
    launches_->reset();
    std::fill(got_grad_->begin(), got_grad_->end(), 0);
    const auto t0 = Clock::now();
    reducer_->prepare_for_backward({ctx.loss()});
    reducer_->mark_used(used);
    backward_start_ = Clock::now();
    prepare_ms_ = ms_between(t0, backward_start_);
  }

  void on_backward(tk::Context& ctx) override {
    if (!reducer_) return decline(tk::Event::Backward);
    if (!ctx.window().is_last()) return;
    const auto end = Clock::now();
    std::lock_guard<std::mutex> lock(launches_->m);
    if (launches_->count != buckets_) throw std::runtime_error(unused_message(ctx));
    unused_ = std::count(got_grad_->begin(), got_grad_->end(), 0);
    backward_ms_ = ms_between(backward_start_, end);
    overlap_ms_ = ms_between(launches_->first, launches_->last);
    wait_ms_ = ms_between(launches_->last, end);
  }

  void on_boundary(tk::Context& ctx) override {
    if (!group_) return decline(tk::Event::Boundary);
    const auto t0 = Clock::now();
    torch::NoGradGuard no_grad;
    if (average_)
      for (auto& p : params_)
        if (p.grad().defined()) p.mutable_grad().div_(world_.size);
    // The window's counts and its loss (still on the device) in one all-reduce; the counts come
    // back to the host (normalization needs them there), the loss stays for the core's read.
    tk::WindowTotals& t = ctx.mutable_totals();
    auto totals = torch::tensor({static_cast<double>(t.micro_batches), static_cast<double>(t.samples),
                                 static_cast<double>(t.tokens), 0.0},
                                torch::kDouble)
                      .to(params_.front().device());
    if (t.loss.defined()) totals.select(0, 3).copy_(t.loss);
    allreduce(totals);
    const std::vector<double> counts = ctx.read(totals.slice(0, 0, 3));
    t.micro_batches = std::llround(counts[0]);
    t.samples = std::llround(counts[1]);
    t.tokens = std::llround(counts[2]);
    t.loss = totals.select(0, 3);
    ++syncs_;
    // The buckets, the used-map the unused-parameter search sums, and the totals.
    allreduces_ += buckets_ + (find_unused_ ? 1 : 0) + 1;
    ctx.metric("ddp_boundary_ms", ms_between(t0, Clock::now()));
    ctx.metric("ddp_backward_ms", backward_ms_);
    ctx.metric("ddp_overlap_ms", overlap_ms_);
    ctx.metric("ddp_wait_ms", wait_ms_);
    ctx.metric("ddp_prepare_ms", prepare_ms_);
    ctx.metric("ddp_buckets", static_cast<double>(buckets_));
    ctx.metric("ddp_unused", static_cast<double>(unused_));
    ctx.metric("ddp_syncs", static_cast<double>(syncs_));
    ctx.metric("ddp_allreduces", static_cast<double>(allreduces_));
  }

  void on_step_end(tk::Context& ctx) override {
    const auto* sharded = dynamic_cast<const tk::ddp::ShardedOptimizer*>(&ctx.optimizer());
    if (!group_ || (check_every_ == 0 && !sharded)) return decline(tk::Event::StepEnd);
    if (sharded && !ctx.step_vetoed()) ctx.metric("ddp_param_broadcast_ms", sharded->broadcast_ms());
    if (check_every_ > 0 && ctx.counters().step % check_every_ == 0) check_same(ctx);
  }
  void on_fit_end(tk::Context&) override { leave(); }
  ~Ddp() override { leave(); }

  tk::StateDict state() const override {
    return {{"syncs", torch::tensor(syncs_)}, {"allreduces", torch::tensor(allreduces_)}};
  }
  void load_state(const tk::StateDict& s) override {
    syncs_ = s.at("syncs").item<int64_t>();
    allreduces_ = s.at("allreduces").item<int64_t>();
  }

 private:
  void join(tk::Context& ctx) {
    c10d::TCPStoreOptions so;
    so.port = static_cast<std::uint16_t>(world_.port);
    so.isServer = world_.rank == 0;
    so.numWorkers = static_cast<std::size_t>(world_.size);
    so.waitWorkers = true;
    so.timeout = rdv_timeout_;
    tk::compat::use_classic_tcpstore(so, 0);
    try {
      store_ = c10::make_intrusive<c10d::TCPStore>(world_.addr, so);
    } catch (const std::exception& err) {
      throw std::runtime_error("rendezvous at " + world_.addr + ":" + std::to_string(world_.port) + " failed for rank " +
                               std::to_string(world_.rank) + " of " + std::to_string(world_.size) + ": " + err.what());
    }
    if (backend_ == "gloo") {
      auto opts = c10d::ProcessGroupGloo::Options::create(timeout_);
      opts->devices.push_back(gloo_device(world_));
      auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store_, world_.rank, world_.size, opts);
      group_ = tk::compat::process_group(gloo, store_, world_.rank, world_.size, false);
    }
#ifdef USE_C10D_NCCL
    if (backend_ == "nccl") {
      auto opts = c10d::ProcessGroupNCCL::Options::create();
      opts->timeout = timeout_;
      auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(store_, world_.rank, world_.size, opts);
      group_ = tk::compat::process_group(nccl, store_, world_.rank, world_.size, true);
    }
#endif
    ctx.info("rank " + std::to_string(world_.rank) + " of " + std::to_string(world_.size) + " joined (" + backend_ +
             ", " + world_.source + ", rendezvous " + world_.addr + ":" + std::to_string(world_.port) + ")");
  }

  void describe_shards(tk::Context& ctx, const tk::ddp::ShardedOptimizer& sharded) const {
    int64_t total = 0;
    for (int r = 0; r < world_.size; ++r) total += sharded.owned_bytes(r);
    const auto& owners = sharded.owners();
    std::ostringstream m;
    m << "zero_stage = 1: the optimizer state is sharded over " << world_.size << " rank" << (world_.size == 1 ? "" : "s")
      << "; this rank updates " << std::count(owners.begin(), owners.end(), world_.rank) << " of " << owners.size()
      << " tensors (" << sharded.owned_bytes(world_.rank) << " of " << total << " bytes of parameters)";
    ctx.info(m.str());
  }

  /// Every rank must step with the same window; a micro-batch picked by memory was measured by
  /// each rank on its own, as was the level of a memory lever (recomputed blocks) picked with it.
  void agree_on_window(const tk::RunPlan& plan) {
    const int64_t level = plan.memory_level();
    auto shape = torch::tensor({plan.micro_batch(), plan.accumulation(), level, -plan.micro_batch(), -plan.accumulation(), -level},
                               torch::kLong);
    allreduce(shape, c10d::ReduceOp::MAX);
    auto at = [&](int64_t i) { return shape[i].item<int64_t>(); };
    if (at(0) != -at(3) || at(1) != -at(4))
      throw std::runtime_error("the ranks planned different windows (rank " + std::to_string(world_.rank) + ": " +
                               std::to_string(plan.micro_batch()) + " x " + std::to_string(plan.accumulation()) +
                               " micro-batches; over all ranks the micro-batch ranges from " + std::to_string(-at(3)) +
                               " to " + std::to_string(at(0)) +
                               "): give [data] micro_batch, or the same memory_budget on every rank");
    if (at(2) != -at(5))
      throw std::runtime_error("the ranks' memory planners picked different levels of the memory lever (rank " +
                               std::to_string(world_.rank) + ": " + std::to_string(level) + "; over all ranks from " +
                               std::to_string(-at(5)) + " to " + std::to_string(at(2)) +
                               "): set it by hand (the recompute plugin's modules), or give the same memory_budget on "
                               "every rank");
  }

  /// Refuses ranks whose models differ from rank 0's (the count of parameters and buffers, each
  /// one's name, dtype, shape and trainability): the rank that differs names the first difference;
  /// the others say which rank it is.
  void check_same_model(tk::Model& model) {
    std::vector<std::string> names;
    std::vector<int64_t> rows;
    for (const auto& p : model.named_parameters()) names.push_back("parameter '" + p.key() + "'"), describe(p.key(), p.value(), rows);
    for (const auto& b : model.named_buffers()) names.push_back("buffer '" + b.key() + "'"), describe(b.key(), b.value(), rows);
    const int64_t n_params = static_cast<int64_t>(model.parameters().size());
    auto counts = torch::tensor({n_params, static_cast<int64_t>(names.size()) - n_params}, torch::kLong);
    const auto mine = counts.clone();
    broadcast(counts);
    // Where any rank's counts differ, no rank compares descriptors (they would not line up).
    auto counts_differ = torch::tensor({counts.equal(mine) ? int64_t{0} : int64_t{1}}, torch::kLong);
    allreduce(counts_differ, c10d::ReduceOp::MAX);
    std::string why;
    if (!counts.equal(mine)) {
      why = std::to_string(mine[0].item<int64_t>()) + " parameters and " + std::to_string(mine[1].item<int64_t>()) +
            " buffers here, " + std::to_string(counts[0].item<int64_t>()) + " and " +
            std::to_string(counts[1].item<int64_t>()) + " on rank 0";
    } else if (counts_differ.item<int64_t>() == 0) {
      auto theirs = torch::tensor(rows, torch::kLong);
      broadcast(theirs);
      const int64_t* r0 = theirs.data_ptr<int64_t>();
      for (size_t i = 0; i < names.size() && why.empty(); ++i) {
        const int64_t* a = rows.data() + i * kWidth;
        const int64_t* b = r0 + i * kWidth;
        if (std::equal(a, a + kWidth, b)) continue;
        why = a[0] != b[0] ? names[i] + " (number " + std::to_string(i) + ") has another name on rank 0"
                           : names[i] + " is " + shape_of(a) + " here and " + shape_of(b) + " on rank 0";
      }
    }
    // Every rank learns the lowest rank that differs (-size: none), so that none goes on to wait
    // for it.
    const int64_t none = -static_cast<int64_t>(world_.size);
    auto first = torch::tensor({why.empty() ? none : -static_cast<int64_t>(world_.rank)}, torch::kLong);
    allreduce(first, c10d::ReduceOp::MAX);
    if (!why.empty())
      throw std::runtime_error("the model on rank " + std::to_string(world_.rank) + " differs from rank 0's: " + why +
                               "; every rank must build the same model");
    if (first.item<int64_t>() != none)
      throw std::runtime_error("the model on rank " + std::to_string(-first.item<int64_t>()) +
                               " differs from rank 0's (that rank's error names the difference)");
  }

  /// Every rank starts from rank 0's parameters and buffers.
  void broadcast_from_rank0(tk::Model& model) {
    torch::NoGradGuard no_grad;
    std::vector<at::Tensor> state;
    for (const auto& p : model.parameters()) state.push_back(p);
    for (const auto& b : model.buffers()) state.push_back(b);
    c10d::broadcast_coalesced(group_, state, static_cast<size_t>(std::min<int64_t>(bucket_bytes_, 256 << 20)), 0);
  }

  void build_reducer(tk::Context& ctx) {
    std::unordered_map<size_t, std::string> names;
    for (const auto& p : ctx.model().named_parameters())
      if (p.value().requires_grad()) {
        names[params_.size()] = p.key();
        param_names_.push_back(p.key());
        params_.push_back(p.value());
      }
    if (params_.empty()) throw std::runtime_error("the model has no trainable parameter: nothing for data parallel to sum");
    // Buckets in the reverse order of definition, which approximates the order gradients become
    // ready in backward: the first (small) bucket is launched earliest.
    std::vector<at::Tensor> reversed(params_.rbegin(), params_.rend());
    std::vector<int64_t> order(params_.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(order.size() - 1 - i);
    const std::vector<bool> sparse(params_.size(), false);
    auto assigned = c10d::compute_bucket_assignment_by_size(
        reversed, {static_cast<size_t>(first_bucket_bytes_), static_cast<size_t>(bucket_bytes_)}, sparse, order);
    auto& buckets = std::get<0>(assigned);
    buckets_ = static_cast<int64_t>(buckets.size());
    reducer_ = std::make_unique<WindowReducer>(params_, buckets, std::get<1>(assigned), group_, sparse, bucket_bytes_,
                                               find_unused_, /*gradient_as_bucket_view=*/true, names, first_bucket_bytes_);
    reducer_->register_comm_hook(std::make_unique<SumHook>(group_, launches_));
    // Which parameters got a gradient in the last backward: counted in the step's record, and
    // named when the search is off and one did not.
    got_grad_ = std::make_shared<std::vector<char>>(params_.size(), 0);
    for (size_t i = 0; i < params_.size(); ++i)
      hooks_.push_back(params_[i].register_hook([flags = got_grad_, i](const at::Tensor&) { (*flags)[i] = 1; }));
    std::ostringstream m;
    m << params_.size() << " parameters in " << buckets_ << " bucket" << (buckets_ == 1 ? "" : "s") << " (first "
      << first_bucket_mb_ << " MiB, then " << bucket_mb_ << " MiB), unused-parameter search "
      << (find_unused_ ? "on" : "off");
    ctx.info(m.str());
  }

  std::string unused_message(const tk::Context& ctx) const {
    std::string missing;
    int64_t count = 0;
    for (size_t i = 0; got_grad_ && i < params_.size(); ++i)
      if (!(*got_grad_)[i] && count++ < 5) missing += (missing.empty() ? "'" : ", '") + param_names_[i] + "'";
    if (!find_unused_ && count > 0)
      return "parameter" + std::string(count == 1 ? " " : "s ") + missing + (count > 5 ? " and others" : "") +
             " got no gradient in the last backward of step " + std::to_string(ctx.counters().step + 1) + " on rank " +
             std::to_string(world_.rank) + ", and find_unused_parameters = false: set it to true (the default) for a "
             "model that does not use every parameter in every micro-batch";
    return "the reducer launched " + std::to_string(launches_->count) + " of its " + std::to_string(buckets_) +
           " buckets in the last backward of step " + std::to_string(ctx.counters().step + 1) + " on rank " +
           std::to_string(world_.rank);
  }

  void leave() {
    comm_->group.reset();
    for (size_t i = 0; i < hooks_.size(); ++i) params_[i].remove_hook(hooks_[i]);
    hooks_.clear();
    reducer_.reset();
    params_.clear();
    group_.reset();
    store_.reset();
  }

  /// Fails the run when the ranks no longer hold the same parameters.
  void check_same(tk::Context& ctx) {
    torch::NoGradGuard no_grad;
    double sum = 0.0;
    for (const auto& p : ctx.model().parameters()) sum += p.to(torch::kDouble).sum().item<double>();
    auto lo = torch::tensor({sum}, torch::kDouble), hi = lo.clone();
    allreduce(lo, c10d::ReduceOp::MIN);
    allreduce(hi, c10d::ReduceOp::MAX);
    if (lo.item<double>() != hi.item<double>()) {
      std::ostringstream m;
      m.precision(17);
      m << "ranks diverged after step " << ctx.counters().step << ": parameter checksums range from " << lo.item<double>()
        << " to " << hi.item<double>();
      throw std::runtime_error(m.str());
    }
  }

  /// The small collectives (counts, descriptors, checksums) run on the run's device, which NCCL
  /// requires; `t` comes back with the result wherever it was.
  void allreduce(at::Tensor& t, c10d::ReduceOp op = c10d::ReduceOp::SUM) {
    std::vector<at::Tensor> v{t.to(device_)};
    c10d::AllreduceOptions o;
    o.reduceOp = op;
    group_->allreduce(v, o)->wait();
    if (!v[0].is_same(t)) t.copy_(v[0]);
  }

  void broadcast(at::Tensor& t) {
    std::vector<at::Tensor> v{t.to(device_)};
    c10d::BroadcastOptions o;
    o.rootRank = 0;
    group_->broadcast(v, o)->wait();
    if (!v[0].is_same(t)) t.copy_(v[0]);
  }

  // Options, with their defaults.
  std::string backend_ = "auto";
  double timeout_s_ = 300.0, rendezvous_timeout_s_ = 300.0, bucket_mb_ = 25.0, first_bucket_mb_ = 1.0;
  bool find_unused_ = true;
  int64_t check_every_ = 0, zero_stage_ = 0;
  // Derived from them, and state.
  World world_;
  std::chrono::milliseconds timeout_{300000}, rdv_timeout_{300000};
  at::Device device_ = at::kCPU;  // the run's (the model's)
  int64_t bucket_bytes_ = 25 << 20, first_bucket_bytes_ = 1 << 20;
  bool average_ = false;
  int64_t syncs_ = 0, allreduces_ = 0;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  // What the sharded optimizer (zero_stage = 1) broadcasts and gathers over, once joined.
  std::shared_ptr<tk::ddp::ShardComm> comm_ = std::make_shared<tk::ddp::ShardComm>();
  // The reducer, the parameters it sums (trainable ones, in model order) and their names.
  std::unique_ptr<WindowReducer> reducer_;
  std::vector<at::Tensor> params_;
  std::vector<std::string> param_names_;
  int64_t buckets_ = 0;
  std::shared_ptr<Launches> launches_ = std::make_shared<Launches>();
  std::shared_ptr<std::vector<char>> got_grad_;
  std::vector<unsigned> hooks_;
  // The last window's figures, for its step's record.
  Clock::time_point backward_start_;
  double prepare_ms_ = 0, backward_ms_ = 0, overlap_ms_ = 0, wait_ms_ = 0;
  int64_t unused_ = 0;  // trainable parameters without a gradient in the last backward, here
};


}  // namespace

TK_PLUGIN(Ddp, "ddp", "0.4.0", "data parallel on c10d's Reducer: gradients summed across ranks during each window's last backward")
