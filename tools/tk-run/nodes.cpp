#include "nodes.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <tk/compat.h>

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace tk {

int64_t realtime_ns() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

namespace {

using Clock = std::chrono::steady_clock;

constexpr double kBeatEvery_s = 0.5;  // a node's heartbeat
constexpr double kGoneAfter_s = 3.0;  // a node whose heartbeat stopped this long ago is gone

std::string key(const char* what, int node) { return std::string("tk-launch/") + what + "/" + std::to_string(node); }

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

std::string encode(const NodeFailure& f) {
  return std::to_string(f.kind) + " " + std::to_string(f.time_ns) + " " + std::to_string(f.node) + " " +
         std::to_string(f.exit_code) + "\n" + f.what;
}

NodeFailure decode(const std::string& s) {
  NodeFailure f;
  std::istringstream in(s.substr(0, s.find('\n')));
  in >> f.kind >> f.time_ns >> f.node >> f.exit_code;
  f.what = s.find('\n') == std::string::npos ? "" : s.substr(s.find('\n') + 1);
  return f;
}

/// What a launcher knows of another node.
struct Peer {
  std::string beat;  // its last heartbeat seen
  Clock::time_point beat_seen = Clock::now();
  bool failure_seen = false, done = false, gone = false;
};

}  // namespace

struct NodeLink::Impl {
  std::string addr;
  int port = 0, nnodes = 0, me = 0;
  c10::intrusive_ptr<c10d::TCPStore> store;
  std::vector<Peer> peers;
  int64_t beats = 0;
  Clock::time_point last_beat{};
  bool store_lost = false;

  std::string where() const { return addr + ":" + std::to_string(port); }

  void beat() {
    if (Clock::now() - last_beat < std::chrono::duration<double>(kBeatEvery_s)) return;
    last_beat = Clock::now();
    store->set(key("beat", me), bytes(std::to_string(++beats)));
  }

  /// Another node, looked at once: its published failure, its end, its heartbeat.
  void look_at(int n, std::vector<NodeFailure>& out) {
    Peer& p = peers[static_cast<size_t>(n)];
    if (p.gone || p.done) return;
    if (!p.failure_seen && store->check({key("failed", n)})) {
      p.failure_seen = true;
      out.push_back(decode(text(store->get(key("failed", n)))));
    }
    if (store->check({key("done", n)})) {
      p.done = true;
      return;
    }
    const std::string b = store->check({key("beat", n)}) ? text(store->get(key("beat", n))) : "";
    if (b != p.beat) {
      p.beat = b;
      p.beat_seen = Clock::now();
    } else if (Clock::now() - p.beat_seen > std::chrono::duration<double>(kGoneAfter_s)) {
      p.gone = true;
      out.push_back({NodeFailure::NodeGone, realtime_ns(), n, 1,
                     "node " + std::to_string(n) + " stopped answering (no heartbeat for " +
                         std::to_string(static_cast<int>(kGoneAfter_s)) + " s): its launcher ended or its machine "
                         "is unreachable"});
    }
  }
};

namespace {

/// This launcher takes its node rank: two launchers given one --node-rank would make a world with a
/// rank twice and another missing. A launcher of this machine that held it and is gone (stopped
/// while it waited, and started again) gives it up.
void claim(c10d::TCPStore& store, int node_rank, int nnodes) {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const std::string me = std::string(host) + " " + std::to_string(::getpid());
  if (store.add(key("claimed", node_rank), 1) > 1) {
    const std::string holder = text(store.get(key("holder", node_rank)));  // set by the first, right after its add
    const size_t space = holder.rfind(' ');
    const std::string their_host = holder.substr(0, space);
    const pid_t their_pid = static_cast<pid_t>(std::atol(holder.c_str() + space + 1));
    const bool gone = their_host == host && their_pid > 0 && ::kill(their_pid, 0) != 0 && errno == ESRCH;
    if (!gone)
      throw std::runtime_error("another launcher (process " + std::to_string(their_pid) + " on " + their_host +
                               ") was given --node-rank " + std::to_string(node_rank) + " too: each launcher of a run "
                               "needs its own node rank, 0 to " + std::to_string(nnodes - 1));
  }
  store.set(key("holder", node_rank), bytes(me));
}

/// The launchers' store: served here on node 0, else reached there, within the rendezvous timeout
/// (`waited` names it).
c10::intrusive_ptr<c10d::TCPStore> connect(const std::string& addr, const c10d::TCPStoreOptions& so, int node_rank,
                                           const std::string& waited) {
  try {
    return c10::make_intrusive<c10d::TCPStore>(addr, so);
  } catch (const std::exception& e) {
    const std::string why = e.what();
    if (node_rank == 0 && why.find("in use") != std::string::npos)
      throw std::runtime_error("port " + std::to_string(so.port) + " is taken on this machine: another launcher was "
                               "given --node-rank 0 (each launcher of a run needs its own), or another program "
                               "holds the port (give another --master-port; the launchers use it and the next one)");
    if (node_rank != 0)
      throw std::runtime_error("node 0's launcher did not answer within " + waited + " (" + why +
                               "): start it with --node-rank 0 and --master-addr this address");
    throw;
  }
}

/// Waits until every node has said how many workers it starts, each counted once however often it
/// started; past `until`, names the nodes that did not.
void wait_for_nodes(c10d::TCPStore& store, int nnodes, Clock::time_point until, const std::string& waited) {
  std::vector<std::string> every_node;
  for (int n = 0; n < nnodes; ++n) every_node.push_back(key("nproc", n));
  while (!store.check(every_node)) {
    if (Clock::now() >= until) {
      std::vector<int> missing;
      for (int n = 0; n < nnodes; ++n)
        if (!store.check({key("nproc", n)})) missing.push_back(n);
      std::string list;
      for (int n : missing) list += (list.empty() ? "" : ", ") + std::to_string(n);
      throw std::runtime_error((missing.size() == 1 ? "node " : "nodes ") + list + " did not join within " + waited +
                               ": start a launcher with " + (missing.size() == 1 ? "that" : "each") +
                               " --node-rank, the same --nnodes, --master-addr and --master-port, or raise the timeout");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

NodeLink::NodeLink(const std::string& addr, int port, int nnodes, int node_rank, int nproc, double timeout_s)
    : impl_(std::make_unique<Impl>()) {
  Impl& i = *impl_;
  i.addr = addr;
  i.port = port;
  i.nnodes = nnodes;
  i.me = node_rank;
  i.peers.resize(static_cast<size_t>(nnodes));
  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(port);
  so.isServer = node_rank == 0;
  so.numWorkers = static_cast<std::size_t>(nnodes);
  so.waitWorkers = false;  // the barrier below waits, and names the nodes that do not come
  so.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  compat::use_classic_tcpstore(so, 0);
  std::ostringstream waited_text;
  waited_text << "[world] rendezvous_timeout_s = " << timeout_s << " s";
  const std::string waited = waited_text.str();
  try {
    i.store = connect(addr, so, node_rank, waited);
    claim(*i.store, node_rank, nnodes);
    // Every node in before any heartbeat counts (a client's constructor does not wait for the
    // others), and every node with as many workers.
    i.store->set(key("nproc", node_rank), bytes(std::to_string(nproc)));
    const auto until = Clock::now() + std::chrono::milliseconds(so.timeout);
    wait_for_nodes(*i.store, nnodes, until, waited);
    const auto barrier = [&](const char* name) {
      i.store->add(name, 1);
      while (i.store->add(name, 0) < nnodes) {
        if (Clock::now() >= until) throw std::runtime_error("not every node went on within " + waited);
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    };
    std::string uneven;
    for (int n = 0; n < nnodes && uneven.empty(); ++n) {
      const std::string theirs = text(i.store->get(key("nproc", n)));
      if (theirs != std::to_string(nproc))
        uneven = "node " + std::to_string(n) + " starts " + theirs + " workers and node " + std::to_string(node_rank) +
                 " " + std::to_string(nproc) + ": give every node the same --nproc";
    }
    try {
      barrier("tk-launch/checked");  // node 0's store stays until every node has read it
    } catch (const std::exception&) {
      if (uneven.empty()) throw;  // else node 0 may have gone with the same finding
    }
    if (!uneven.empty()) throw std::runtime_error(uneven);
    // From here on a store that does not answer within seconds is a node gone, not a slow one.
    i.store->setTimeout(std::chrono::seconds(5));
    i.beat();
  } catch (const std::exception& e) {
    throw std::runtime_error("the launchers' rendezvous at " + i.where() + " failed for node " +
                             std::to_string(node_rank) + " of " + std::to_string(nnodes) + ": " + e.what());
  }
  for (auto& p : i.peers) p.beat_seen = Clock::now();
}

NodeLink::~NodeLink() = default;

void NodeLink::publish(const NodeFailure& f) {
  try {
    impl_->store->set(key("failed", impl_->me), bytes(encode(f)));
  } catch (const std::exception&) {
    impl_->store_lost = true;  // poll() reports node 0 gone
  }
}

std::vector<NodeFailure> NodeLink::poll() {
  Impl& i = *impl_;
  std::vector<NodeFailure> out;
  if (i.store_lost && i.peers[0].gone) return out;
  try {
    if (i.store_lost) throw std::runtime_error("it stopped answering");
    i.beat();
    for (int n = 0; n < i.nnodes; ++n)
      if (n != i.me) i.look_at(n, out);
  } catch (const std::exception& e) {
    // Only node 0's store can stop answering: that node is gone.
    i.store_lost = true;
    if (!i.peers[0].gone && !i.peers[0].done) {
      i.peers[0].gone = true;
      out.push_back({NodeFailure::NodeGone, realtime_ns(), 0, 1,
                     "node 0 stopped answering (the launchers' store at " + i.where() + ": " + e.what() +
                         "): its launcher ended or its machine is unreachable"});
    }
  }
  return out;
}

std::vector<NodeFailure> NodeLink::finish(bool ok) {
  Impl& i = *impl_;
  std::vector<NodeFailure> seen;
  try {
    i.store->set(key("done", i.me), bytes(ok ? "ok" : "failed"));
    if (i.me != 0) return seen;
    // The store lives in this process: it stays (beating, so that it is not taken for gone) until
    // every other node has ended or is gone, for at most a minute.
    const auto until = Clock::now() + std::chrono::seconds(60);
    for (;;) {
      bool all = true;
      for (int n = 1; n < i.nnodes; ++n) {
        i.look_at(n, seen);
        all &= i.peers[static_cast<size_t>(n)].done || i.peers[static_cast<size_t>(n)].gone;
      }
      if (all || Clock::now() >= until) break;
      i.beat();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  } catch (const std::exception&) {
  }
  return seen;
}

}  // namespace tk
