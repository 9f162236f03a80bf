#pragma once
// Multi-process launch for `tk-run --nproc N`, on one node or, with --nnodes, on several.
#include <string>
#include <vector>

namespace tk {

/// What follows a worker's program name where it prints an error ("tk-run: error: ..."): the
/// launcher knows a worker's error by it, to print an error every rank makes once.
inline constexpr const char* kErrorMark = ": error: ";

struct LaunchOptions {
  int nproc = 1;              ///< workers on this node
  int nnodes = 1;             ///< nodes, each with its own launcher and nproc workers
  int node_rank = 0;          ///< this node: its workers are ranks node_rank * nproc ...
  std::string master_addr = "127.0.0.1";  ///< where rank 0's rendezvous (and node 0's launcher) listens
  int master_port = 0;        ///< 0: pick a free port on loopback (one node only); nodes use the next port
  double node_timeout_s = 300.0;  ///< seconds the launchers wait for every node to join ([world] rendezvous_timeout_s)
  double stop_grace_s = 10.0; ///< after a rank fails, seconds the others get to stop before SIGKILL
  int only_rank = -1;         ///< >= 0: start only this rank of the world (a dry run prints its plan)
  std::string program = "tk-run";  ///< who speaks in the launcher's own lines ("tk-run: rank 1 failed ...")
  int max_restarts = 0;       ///< times the workers are started again after a failure (one node)
  int restart = 0;            ///< which start this is (TK_RESTART_COUNT of the workers)
};

/// Runs `argv` (this program, without the launch options) as `nproc` workers with torchrun's
/// variables set (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE,
/// MASTER_ADDR, MASTER_PORT). With nnodes > 1, the node's launcher first meets the others' (node
/// 0 hosts a c10d TCPStore on master_port + 1); a failure on any node stops every node, and each
/// names the cause: the first rank that failed, or a node that stopped answering. Forwards their output
/// line by line with a "[rank i]" prefix. When a worker fails (non-zero exit or a signal), stops the
/// others (SIGTERM, then SIGKILL after the grace period) and returns non-zero with that rank's
/// error (2 when that rank refused the run before training, else 1); never waits forever. When the first failure is a timeout, the ranks that never failed
/// by themselves and had to be killed are named as the ones that hung. SIGINT/SIGTERM/SIGHUP/SIGUSR1 to
/// tk-run are forwarded to the workers; the workers die with the launcher (PR_SET_PDEATHSIG).
/// With max_restarts > 0, a failed launch (exit 1: not a refusal, not a stop on a signal) starts
/// every worker again, up to that many times, each with TK_RESTART_COUNT = its restart, as
/// torchrun's --max-restarts does; a worker of a restart resumes the run by itself.
int launch_workers(const std::vector<std::string>& argv, const LaunchOptions& opts);

/// Writes the current CLOCK_MONOTONIC time and `kind` ("error", or "timeout" for a collective that
/// timed out waiting for a peer) to `file`: a worker's moment of failure, which the launcher
/// compares across ranks (the clock is the same for every process on the machine).
void record_failure(const std::string& file, const std::string& kind);

/// A TCP port on 127.0.0.1 that was free a moment ago.
int free_port();

}  // namespace tk
