#pragma once
// What the launchers of a multi-node `tk-run --nnodes N` tell one another, through a c10d TCPStore
// that node 0's launcher hosts on the port after the workers' rendezvous port: each node's first
// failure, a heartbeat, and the end of each node's launch.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tk {

/// One node's account of why its launch fails. The cause of a world's failure is the account with
/// the lowest kind, then the earliest time: a node gone, then a rank killed by a signal the
/// launcher did not send (or a launcher stopped by one), then a rank's error, then a collective
/// timeout (a rank that waited). A node stopped by another's account publishes none.
struct NodeFailure {
  enum Kind { NodeGone = 0, Signal = 1, Error = 2, Timeout = 3 };
  int kind = Error;
  int64_t time_ns = 0;  ///< CLOCK_REALTIME, so that nodes can be compared
  int node = -1;
  int exit_code = 1;  ///< what every launcher exits with: 2 when a rank refused the run before training
  std::string what;  ///< "rank 3 failed (was killed by signal 9 (Killed))", then its last lines

  bool before(const NodeFailure& o) const { return kind != o.kind ? kind < o.kind : time_ns < o.time_ns; }
  /// The first line of `what`.
  std::string headline() const { return what.substr(0, what.find('\n')); }
};

int64_t realtime_ns();

class NodeLink {
 public:
  /// Joins the launchers' rendezvous at addr:port (node 0 hosts it), waiting up to `timeout_s`
  /// for every node; refuses nodes that start different numbers of workers.
  NodeLink(const std::string& addr, int port, int nnodes, int node_rank, int nproc, double timeout_s);
  ~NodeLink();
  NodeLink(const NodeLink&) = delete;
  NodeLink& operator=(const NodeLink&) = delete;

  /// This node's first failure, for the others.
  void publish(const NodeFailure& f);
  /// Called every round of the launcher: sends this node's heartbeat and returns what is new: the
  /// failures other nodes published, and nodes gone (no heartbeat for `gone_after_s`, or, for
  /// node 0, its store no longer answering).
  std::vector<NodeFailure> poll();
  /// This node's launch ended; node 0, which hosts the store, waits (bounded) for the others and
  /// returns the failures they published meanwhile.
  std::vector<NodeFailure> finish(bool ok);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tk
