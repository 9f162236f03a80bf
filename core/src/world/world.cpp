// The processes of a run (world.h): their placement from the environment, the rendezvous and the
// process group, and the collectives every plugin may use.
#include "world/world.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <cstdlib>
#include <future>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include <spdlog/spdlog.h>

#include "tk/compat.h"
#include "tk/error.h"

namespace tk {

World::~World() = default;

c10::intrusive_ptr<c10d::ProcessGroup> World::side_group(const std::string& purpose) {
  if (!process_group()) return {};
  throw Error("this world (" + backend() + ") makes no second process group, which " + purpose + " needs");
}

int64_t World::max(int64_t v) {
  auto t = at::tensor({v}, at::kLong);
  all_reduce(t, ReduceOp::Max);
  return t.item<int64_t>();
}

double World::max(double v) {
  auto t = at::tensor({v}, at::kDouble);
  all_reduce(t, ReduceOp::Max);
  return t.item<double>();
}

}  // namespace tk

namespace tk::detail {
namespace {

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
std::shared_ptr<::gloo::transport::Device> gloo_device(const Placement& p) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
    const std::string first = std::string(ifname).substr(0, std::string(ifname).find(','));
    return c10d::ProcessGroupGloo::createDeviceForInterface(first);
  }
  const std::string mine = local_address_towards(p.addr, p.port);
  if (mine.empty())
    throw Error("no address of this machine routes to the rendezvous host " + p.addr +
                " (MASTER_ADDR); set GLOO_SOCKET_IFNAME to the network interface to use");
  return c10d::ProcessGroupGloo::createDeviceForHostname(mine);
}

c10d::ReduceOp c10d_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Max: return c10d::ReduceOp::MAX;
    case ReduceOp::Min: return c10d::ReduceOp::MIN;
    case ReduceOp::Sum: break;
  }
  return c10d::ReduceOp::SUM;
}

std::chrono::milliseconds millis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(std::min(seconds, 1e9) * 1000));
}

}  // namespace

OptionSpecs world_specs() {
  return {opt_string("backend", "auto", "collective backend: gloo (CPU), nccl (CUDA), auto (nccl on CUDA, else gloo)",
                     {"auto", "gloo", "nccl"}),
          opt_float("timeout_s", 300.0, "seconds a collective may wait for the other ranks before the run fails"),
          opt_float("rendezvous_timeout_s", 300.0, "seconds to wait for every rank to join")};
}

ProcessWorld::ProcessWorld(Placement placement) : p_(std::move(placement)) {}
ProcessWorld::~ProcessWorld() { leave(); }

WorldWaits world_waits(const Options& o) {
  // A bounded wait: more than a week is a typo, and inf would overflow the milliseconds c10d takes.
  constexpr double kWeek = 7 * 24 * 3600.0;
  for (const char* key : {"timeout_s", "rendezvous_timeout_s"}) {
    const double v = o.get_float(key);
    if (!(v > 0 && v <= kWeek))
      o.fail(key, "must be > 0 and at most a week (604800 seconds), got " + c10::str(v));
  }
  return {o.get_float("timeout_s"), o.get_float("rendezvous_timeout_s")};
}

void ProcessWorld::configure(const Options& o, at::Device device, bool may_join) {
  const WorldWaits waits = world_waits(o);
  std::string backend = o.get_string("backend");
  if (backend == "auto") backend = device.is_cuda() ? "nccl" : "gloo";
  if (backend == "nccl" && !device.is_cuda()) o.fail("backend", "nccl needs the run on CUDA (run.device)");
#ifndef USE_C10D_NCCL
  if (backend == "nccl") o.fail("backend", "this LibTorch was built without NCCL; use gloo");
#endif
  timeout_ = millis(waits.collective);
  rendezvous_timeout_ = millis(waits.rendezvous);
  device_ = device;
  may_join_ = may_join && p_.size > 1;
  if (p_.size > 1) backend_ = backend;
}

namespace {

/// The rendezvous stores of this process, by where they meet, kept for the process's life: a
/// process may run one Trainer after another in the same world (the plugin contract does), and each
/// joins again over the store its first join made, under a prefix of its own (the join's number,
/// the same on every rank, since every rank runs the same sequence). Remaking the store instead
/// would race: rank 0's next server could not bind the port before its last one closed, and a
/// quick rank could reach the server that is about to close.
struct Rendezvous {
  c10::intrusive_ptr<c10d::Store> store;
  int64_t joins = 0;
};

/// Held while a join makes or uses its store: a join given up (a stop) may still be making it on
/// its thread when the process joins again.
std::mutex& rendezvous_mutex() {
  static auto* mutex = new std::mutex();  // never destroyed, as the stores
  return *mutex;
}

Rendezvous& rendezvous_at(const std::string& where) {
  static auto* stores = new std::map<std::string, Rendezvous>();  // never destroyed: servers close at exit
  return (*stores)[where];
}

/// This join's store: the process's rendezvous store at MASTER_ADDR:MASTER_PORT (made, and met by
/// every rank, on the first join) under a prefix that numbers the joins.
c10::intrusive_ptr<c10d::Store> rendezvous(const Placement& p, std::chrono::milliseconds timeout) {
  // Under torchrun's static rendezvous its agent already serves a store at MASTER_PORT and says so
  // (TORCHELASTIC_USE_AGENT_STORE=True): every rank joins it as a client, under a prefix of this
  // restart's own, as PyTorch's workers do.
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  const bool agent_store = agent != nullptr && std::string(agent) == "True";
  const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const std::string restart = agent_store ? "/worker/attempt_" + std::string(attempt ? attempt : "0") : "";
  std::lock_guard<std::mutex> lock(rendezvous_mutex());
  Rendezvous& r = rendezvous_at(p.addr + ":" + std::to_string(p.port) + restart + " rank " + std::to_string(p.rank) +
                                " of " + std::to_string(p.size));
  if (!r.store) {
    c10d::TCPStoreOptions so;
    so.port = static_cast<std::uint16_t>(p.port);
    so.isServer = p.rank == 0 && !agent_store;
    so.numWorkers = static_cast<std::size_t>(p.size);
    so.waitWorkers = true;
    so.timeout = timeout;
    compat::use_classic_tcpstore(so, 0);
    r.store = c10::make_intrusive<c10d::TCPStore>(p.addr, so);
    if (agent_store) r.store = c10::make_intrusive<c10d::PrefixStore>(restart, r.store);
  }
  r.store->setTimeout(timeout);
  return c10::make_intrusive<c10d::PrefixStore>("tk/join-" + std::to_string(++r.joins), r.store);
}

/// A process group of `backend` over `store` for the rank `p` places.
c10::intrusive_ptr<c10d::ProcessGroup> group_over(const c10::intrusive_ptr<c10d::Store>& store, const Placement& p,
                                                  const std::string& backend, std::chrono::milliseconds timeout) {
  if (backend == "gloo") {
    auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
    opts->devices.push_back(gloo_device(p));
    auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, p.rank, p.size, opts);
    return compat::process_group(gloo, store, p.rank, p.size, false);
  }
#ifdef USE_C10D_NCCL
  if (backend == "nccl") {
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = timeout;
    auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, p.rank, p.size, opts);
    return compat::process_group(nccl, store, p.rank, p.size, true);
  }
#endif
  return {};
}

/// What a join met: the store and the process group, or where and why it failed.
struct Met {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  std::string failed_at;  ///< "rendezvous" or "group" when it failed
  std::string error;
};

/// The rendezvous and the process group, made with copies of what they need: the thread that
/// makes them may outlive the world that asked (a run stopped while it waits).
/// Why this join failed, the same on every rank, or "" when every rank came by `deadline`. Rank 0's
/// store server stops waiting for its clients at the rendezvous's timeout without a word, and the
/// process group would then wait out the collectives' timeout (minutes) for a rank that never came.
/// Each rank adds 1 to a count as it comes; the one that makes it the world's size tells all. A rank
/// whose wait ends first adds size + 1 (more than any arrival makes it): a rank that comes after
/// learns that the join was given up, and the rank that gave up reads in the sum (modulo size + 1)
/// whether the last rank came just before.
std::string join_failure(c10d::Store& store, const Placement& p, std::chrono::steady_clock::time_point deadline,
                         std::chrono::milliseconds timeout) {
  const int64_t n = p.size, gave_up = n + 1;
  store.set("came/" + std::to_string(p.rank), std::vector<uint8_t>{1});
  const int64_t arrived = store.add("came", 1);
  if (arrived == n) store.set("all-came", std::vector<uint8_t>{1});
  const std::string within = "within [world] rendezvous_timeout_s = " + c10::str(timeout.count() / 1000.0) + " s";
  if (arrived > n) return "the other ranks had given up waiting for it " + within;
  // Asked, not waited for: a store wait that times out leaves its answer to come on the connection.
  for (;;) {
    if (store.check({"all-came"})) return "";
    if (std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (store.add("came", gave_up) % gave_up == n) return "";
  std::string missing;
  int count = 0;
  for (int r = 0; r < p.size; ++r)
    if (!store.check({"came/" + std::to_string(r)}) && ++count <= 8) missing += (count > 1 ? ", " : "") + std::to_string(r);
  if (count > 8) missing += " and " + std::to_string(count - 8) + " more";
  if (count == 0) return "the last rank came only as the wait for it ended, " + within;
  return (count == 1 ? "rank " : "ranks ") + missing + " did not join " + within +
         " (was each started, with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE?)";
}

Met meet(Placement p, std::string backend, std::chrono::milliseconds rendezvous_timeout,
         std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + rendezvous_timeout;
  Met m;
  try {
    m.store = rendezvous(p, rendezvous_timeout);
    const std::string failed = join_failure(*m.store, p, deadline, rendezvous_timeout);
    if (!failed.empty()) return {{}, {}, "rendezvous", failed};
  } catch (const std::exception& err) {
    return {{}, {}, "rendezvous", message_of(err)};
  }
  try {
    m.group = group_over(m.store, p, backend, timeout);
  } catch (const std::exception& err) {
    return {{}, {}, "group", message_of(err)};
  }
  return m;
}

}  // namespace

void ProcessWorld::join() {
  if (joined() || !may_join_) return;
  // The rendezvous waits for every rank, minutes for one that is slow to start (or never comes):
  // it runs on a thread of its own, and this one gives up the wait as soon as the run is asked to
  // stop. The thread is left to end with the process; it holds nothing of this world.
  std::packaged_task<Met()> task([p = p_, backend = backend_, rt = rendezvous_timeout_, t = timeout_] {
    return meet(p, backend, rt, t);
  });
  std::future<Met> met = task.get_future();
  std::thread(std::move(task)).detach();
  const std::string at = p_.addr + ":" + std::to_string(p_.port);
  const std::string who = "rank " + std::to_string(p_.rank) + " of " + std::to_string(p_.size);
  while (met.wait_for(std::chrono::milliseconds(100)) != std::future_status::ready)
    if (stop_ && stop_())
      throw RunRefused("stopped while waiting for the other ranks at " + at + " (" + who +
                       "): nothing was trained, nothing written");
  Met m = met.get();
  if (m.failed_at == "rendezvous") throw Error("rendezvous at " + at + " failed for " + who + ": " + m.error);
  if (m.failed_at == "group")
    throw Error(who + " met the others at " + at + " but could not make the " + backend_ +
                " process group: " + m.error);
  store_ = std::move(m.store);
  group_ = std::move(m.group);
  spdlog::info("world: {} joined", describe());
}

c10::intrusive_ptr<c10d::ProcessGroup> ProcessWorld::make_group(const c10::intrusive_ptr<c10d::Store>& store) {
  return group_over(store, p_, backend_, timeout_);
}

c10::intrusive_ptr<c10d::ProcessGroup> ProcessWorld::side_group(const std::string& purpose) {
  join();
  if (!joined()) return {};
  auto& group = side_groups_[purpose];
  if (group) return group;
  try {
    group = make_group(c10::make_intrusive<c10d::PrefixStore>("side/" + purpose, store_));
  } catch (const std::exception& err) {
    side_groups_.erase(purpose);
    throw Error("rank " + std::to_string(p_.rank) + " could not make the " + backend_ + " process group for " + purpose +
                ": " + err.what());
  }
  return group;
}

void ProcessWorld::leave() noexcept {
  side_groups_.clear();
  group_.reset();
  store_.reset();
}

std::string ProcessWorld::describe() const {
  std::string s = "rank " + std::to_string(p_.rank) + " of " + std::to_string(p_.size);
  if (p_.size == 1) return s + " (" + p_.source + ")";
  return s + " (" + p_.source + ", " + backend_ + ", rendezvous " + p_.addr + ":" + std::to_string(p_.port) + ")" +
         (may_join_ ? "" : "; not joined: a dry run plans this rank alone");
}

c10::intrusive_ptr<c10d::ProcessGroup> ProcessWorld::process_group() {
  join();
  return group_;
}

// The collectives join the world when first called. Unjoined (a world of one, a dry run) each
// leaves its input as it is. Small
// tensors go where the backend runs (NCCL: the GPU) and come back to where they were.

void ProcessWorld::all_reduce(at::Tensor& t, ReduceOp op) {
  join();
  if (!joined()) return;
  std::vector<at::Tensor> v{t.to(device_)};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d_op(op);
  group_->allreduce(v, o)->wait();
  if (!v[0].is_same(t)) t.copy_(v[0]);
}

void ProcessWorld::broadcast(at::Tensor& t, int root) {
  join();
  if (!joined()) return;
  if (root < 0 || root >= p_.size)
    throw Error("broadcast from rank " + std::to_string(root) + " in a world of " + std::to_string(p_.size));
  std::vector<at::Tensor> v{t.to(device_)};
  c10d::BroadcastOptions o;
  o.rootRank = root;
  group_->broadcast(v, o)->wait();
  if (!v[0].is_same(t)) t.copy_(v[0]);
}

at::Tensor ProcessWorld::all_gather(const at::Tensor& t) {
  join();
  if (!joined()) return at::cat(std::vector<at::Tensor>(static_cast<size_t>(p_.size), t));  // its own, size() times
  std::vector<at::Tensor> in{t.to(device_).contiguous()};
  std::vector<std::vector<at::Tensor>> out(1);
  for (int r = 0; r < p_.size; ++r) out[0].push_back(at::empty_like(in[0]));
  group_->allgather(out, in)->wait();
  return at::cat(out[0]).to(t.device());
}

at::Tensor ProcessWorld::reduce_scatter(const at::Tensor& t, ReduceOp op) {
  if (t.dim() == 0 || t.size(0) % p_.size != 0)
    throw Error("reduce_scatter of a tensor of " + std::to_string(t.dim() == 0 ? 0 : t.size(0)) + " rows over " +
                std::to_string(p_.size) + " ranks: the first dimension must divide evenly");
  const int64_t part = t.size(0) / p_.size;
  join();
  if (!joined()) return t.slice(0, part * p_.rank, part * (p_.rank + 1)).clone();
  if (backend_ != "gloo") {  // the native collective
    std::vector<at::Tensor> out{at::empty_like(t.slice(0, 0, part), t.options().device(device_))};
    std::vector<std::vector<at::Tensor>> in(1);
    const at::Tensor whole = t.to(device_).contiguous();
    for (int r = 0; r < p_.size; ++r) in[0].push_back(whole.slice(0, part * r, part * (r + 1)));
    c10d::ReduceScatterOptions o;
    o.reduceOp = c10d_op(op);
    group_->reduce_scatter(out, in, o)->wait();
    return out[0].to(t.device());
  }
  // Gloo has no reduce-scatter: the whole tensor all-reduced, then this rank's part.
  at::Tensor whole = t.clone();
  all_reduce(whole, op);
  return whole.slice(0, part * p_.rank, part * (p_.rank + 1)).clone();
}

void ProcessWorld::barrier() {
  join();
  if (!joined()) return;
  group_->barrier()->wait();
}

}  // namespace tk::detail
