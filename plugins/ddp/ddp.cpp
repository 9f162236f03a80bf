// Distributed data parallel on PyTorch's c10d: a TCPStore rendezvous, ProcessGroupGloo on CPU
// (ProcessGroupNCCL on CUDA where LibTorch was built with it).
//
// Every rank starts from rank 0's parameters and buffers, reads its own shard of each epoch (the
// core strides the shared shuffle by rank) and accumulates gradients locally. At the boundary, once
// per window and before normalization, unscaling and clipping (its contract says so), the
// gradients are summed across ranks in a few flat buckets, together with the window's totals
// (micro-batches, samples, tokens, loss), so that normalization divides by the global counts and
// the step equals the single-process step on the global window.
//
// The world comes from the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
// MASTER_PORT) or Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, with MASTER_ADDR and
// MASTER_PORT given); `tk-run --nproc N` sets the former. Without them the world is one process.
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
#include <tk/abi.h>
#include <tk/compat.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
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

class Ddp final : public tk::Plugin {
 public:
  void bind(tk::OptionBinder& o) override {
    o.add("backend", backend_, "collective backend: gloo (CPU), nccl (CUDA), auto", {"auto", "gloo", "nccl"});
    o.add("timeout_s", timeout_s_, "seconds a collective may take before the run fails");
    o.add("rendezvous_timeout_s", rendezvous_timeout_s_, "seconds to wait for every rank to join");
    o.add("bucket_mb", bucket_mb_, "size of the flat gradient buckets all-reduced together");
    o.add("check_every", check_every_, "every N steps, verify that all ranks hold the same parameters (0: never)");
  }

  void init() override {
    if (!(timeout_s_ > 0)) fail_option(timeout_s_, "must be > 0");
    if (!(rendezvous_timeout_s_ > 0)) fail_option(rendezvous_timeout_s_, "must be > 0");
    if (!(bucket_mb_ > 0)) fail_option(bucket_mb_, "must be > 0");
    if (check_every_ < 0) fail_option(check_every_, "must be >= 0");
    timeout_ = std::chrono::milliseconds(static_cast<int64_t>(timeout_s_ * 1000));
    rdv_timeout_ = std::chrono::milliseconds(static_cast<int64_t>(rendezvous_timeout_s_ * 1000));
    bucket_bytes_ = static_cast<int64_t>(bucket_mb_ * 1024 * 1024);
  }

  tk::Contract contract() const override {
    tk::Contract c;
    c.provides = {tk::cap::kGradsSynced, tk::cap::kWorld};
    return c;
  }

  void configure(tk::RunPlan& plan) override {
    world_ = detect_world();  // here, not in init: a launcher reads the plugins before any world exists
    plan.set_world(world_.size, world_.rank);
    // Without a normalizer, a mean loss is averaged over ranks here, as single-process training
    // would average it over the global batch; a sum loss stays a sum.
    average_ = !plan.has(tk::cap::kGradsNormalized) && plan.reduction() == tk::Reduction::Mean;
    if (backend_ == "auto") backend_ = plan.device() == at::kCUDA ? "nccl" : "gloo";
    if (backend_ == "nccl" && plan.device() != at::kCUDA) fail_option(backend_, "nccl needs the run on CUDA (run.device)");
#ifndef USE_C10D_NCCL
    if (backend_ == "nccl") fail_option(backend_, "this LibTorch was built without NCCL; use gloo");
#endif
  }

  void on_fit_start(tk::Context& ctx) override { start(ctx); }
  void on_boundary(tk::Context& ctx) override { sync(ctx); }
  void on_step_end(tk::Context& ctx) override {
    if (!pg_ || check_every_ == 0) return decline(tk::Event::StepEnd);
    if (ctx.counters().step % check_every_ == 0) check_same(ctx);
  }
  void on_fit_end(tk::Context&) override {
    pg_.reset();
    store_.reset();
  }

  tk::StateDict state() const override {
    return {{"syncs", torch::tensor(syncs_)}, {"allreduces", torch::tensor(allreduces_)}};
  }
  void load_state(const tk::StateDict& s) override {
    syncs_ = s.at("syncs").item<int64_t>();
    allreduces_ = s.at("allreduces").item<int64_t>();
  }

 private:
  void start(tk::Context& ctx) {
    if (world_.size == 1) return;
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
      const bool loopback = world_.addr == "127.0.0.1" || world_.addr == "localhost";
      opts->devices.push_back(loopback ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                                       : c10d::ProcessGroupGloo::createDefaultDevice());
      pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store_, world_.rank, world_.size, opts);
    }
#ifdef USE_C10D_NCCL
    if (backend_ == "nccl") {
      auto opts = c10d::ProcessGroupNCCL::Options::create();
      opts->timeout = timeout_;
      pg_ = c10::make_intrusive<c10d::ProcessGroupNCCL>(store_, world_.rank, world_.size, opts);
    }
#endif
    ctx.info("rank " + std::to_string(world_.rank) + " of " + std::to_string(world_.size) + " joined (" + backend_ +
             ", " + world_.source + ", rendezvous " + world_.addr + ":" + std::to_string(world_.port) + ")");
    // Every rank must step with the same window; a micro-batch picked by memory was measured by
    // each rank on its own.
    const tk::RunPlan& plan = ctx.plan();
    auto shape = torch::tensor({plan.micro_batch(), plan.accumulation(), -plan.micro_batch(), -plan.accumulation()},
                               torch::kLong);
    {
      std::vector<torch::Tensor> v{shape};
      c10d::AllreduceOptions ao;
      ao.reduceOp = c10d::ReduceOp::MAX;
      pg_->allreduce(v, ao)->wait();
    }
    if (shape[0].item<int64_t>() != -shape[2].item<int64_t>() || shape[1].item<int64_t>() != -shape[3].item<int64_t>())
      throw std::runtime_error("the ranks planned different windows (rank " + std::to_string(world_.rank) + ": " +
                               std::to_string(plan.micro_batch()) + " x " + std::to_string(plan.accumulation()) +
                               " micro-batches; over all ranks the micro-batch ranges from " +
                               std::to_string(-shape[2].item<int64_t>()) + " to " + std::to_string(shape[0].item<int64_t>()) +
                               "): give [data] micro_batch, or the same memory_budget on every rank");
    // Every rank starts from rank 0's parameters and buffers.
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> state;
    for (const auto& p : ctx.model().parameters()) state.push_back(p);
    for (const auto& b : ctx.model().buffers()) state.push_back(b);
    for (auto& bucket : buckets(state)) {
      auto flat = flatten(bucket);
      std::vector<torch::Tensor> v{flat};
      c10d::BroadcastOptions bo;
      bo.rootRank = 0;
      pg_->broadcast(v, bo)->wait();
      unflatten(flat, bucket);
    }
  }

  void sync(tk::Context& ctx) {
    if (!pg_) return;
    torch::NoGradGuard no_grad;
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<torch::Tensor> grads;
    for (const auto& p : ctx.model().parameters())
      if (p.grad().defined()) grads.push_back(p.grad());
    for (auto& bucket : buckets(grads)) {
      auto flat = flatten(bucket);
      allreduce(flat);
      if (average_) flat.div_(world_.size);
      unflatten(flat, bucket);
    }
    // The window's counts and its loss (still on the device) in one all-reduce; the counts come
    // back to the host (normalization needs them there), the loss stays for the core's read.
    tk::WindowTotals& t = ctx.mutable_totals();
    const at::Device device = grads.empty() ? at::Device(at::kCPU) : grads.front().device();
    auto totals = torch::tensor({static_cast<double>(t.micro_batches), static_cast<double>(t.samples),
                                 static_cast<double>(t.tokens), 0.0},
                                torch::kDouble)
                      .to(device);
    if (t.loss.defined()) totals.select(0, 3).copy_(t.loss);
    allreduce(totals);
    const std::vector<double> counts = ctx.read(totals.slice(0, 0, 3));
    t.micro_batches = std::llround(counts[0]);
    t.samples = std::llround(counts[1]);
    t.tokens = std::llround(counts[2]);
    t.loss = totals.select(0, 3);
    ++syncs_;
    ctx.metric("ddp_sync_ms", std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    ctx.metric("ddp_syncs", static_cast<double>(syncs_));
    ctx.metric("ddp_allreduces", static_cast<double>(allreduces_));
  }

  /// Fails the run when the ranks no longer hold the same parameters.
  void check_same(tk::Context& ctx) {
    torch::NoGradGuard no_grad;
    double sum = 0.0;
    for (const auto& p : ctx.model().parameters()) sum += p.to(torch::kDouble).sum().item<double>();
    auto lo = torch::tensor({sum}, torch::kDouble), hi = lo.clone();
    std::vector<torch::Tensor> vl{lo}, vh{hi};
    c10d::AllreduceOptions mn, mx;
    mn.reduceOp = c10d::ReduceOp::MIN;
    mx.reduceOp = c10d::ReduceOp::MAX;
    pg_->allreduce(vl, mn)->wait();
    pg_->allreduce(vh, mx)->wait();
    if (lo.item<double>() != hi.item<double>()) {
      std::ostringstream m;
      m.precision(17);
      m << "ranks diverged after step " << ctx.counters().step << ": parameter checksums range from " << lo.item<double>()
        << " to " << hi.item<double>();
      throw std::runtime_error(m.str());
    }
  }

  void allreduce(torch::Tensor& t) {
    std::vector<torch::Tensor> v{t};
    pg_->allreduce(v)->wait();
    ++allreduces_;
  }

  std::vector<std::vector<torch::Tensor>> buckets(const std::vector<torch::Tensor>& ts) const {
    std::vector<std::vector<torch::Tensor>> out;
    int64_t bytes = 0;
    for (const auto& t : ts) {
      const int64_t tb = t.numel() * static_cast<int64_t>(t.element_size());
      if (out.empty() || bytes + tb > bucket_bytes_ || out.back().front().scalar_type() != t.scalar_type()) {
        out.emplace_back();
        bytes = 0;
      }
      out.back().push_back(t);
      bytes += tb;
    }
    return out;
  }

  static torch::Tensor flatten(const std::vector<torch::Tensor>& ts) {
    std::vector<torch::Tensor> flat;
    for (const auto& t : ts) flat.push_back(t.reshape({-1}));
    return torch::cat(flat);
  }

  static void unflatten(const torch::Tensor& flat, std::vector<torch::Tensor>& ts) {
    int64_t off = 0;
    for (auto& t : ts) {
      t.copy_(flat.slice(0, off, off + t.numel()).view_as(t));
      off += t.numel();
    }
  }

  // Options, with their defaults.
  std::string backend_ = "auto";
  double timeout_s_ = 300.0, rendezvous_timeout_s_ = 300.0, bucket_mb_ = 25.0;
  int64_t check_every_ = 0;
  // Derived from them, and state.
  World world_;
  std::chrono::milliseconds timeout_{300000}, rdv_timeout_{300000};
  int64_t bucket_bytes_ = 25 << 20;
  bool average_ = false;
  int64_t syncs_ = 0, allreduces_ = 0;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<tk::compat::CollectiveGroup> pg_;
};

}  // namespace

TK_PLUGIN(Ddp, "ddp", "0.2.0", "data parallel on c10d: gradients summed across ranks once per window")
