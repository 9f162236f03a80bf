#pragma once
// Local multi-process launch for `tk-run --nproc N`.
#include <string>
#include <vector>

namespace tk {

struct LaunchOptions {
  int nproc = 1;
  int master_port = 0;        ///< 0: pick a free port on loopback
  double stop_grace_s = 10.0; ///< after a rank fails, seconds the others get to stop before SIGKILL
  int only_rank = -1;         ///< >= 0: start only this rank of the world (a dry run prints its plan)
};

/// Runs `argv` (this program, without --nproc) as `nproc` workers with RANK, WORLD_SIZE,
/// LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT set. Forwards their output
/// line by line with a "[rank i]" prefix. When a worker fails (non-zero exit or a signal), stops the
/// others (SIGTERM, then SIGKILL after the grace period) and returns non-zero with that rank's
/// error (2 when that rank refused the run before training, else 1); never waits forever. When the first failure is a timeout, the ranks that never failed
/// by themselves and had to be killed are named as the ones that hung. SIGINT/SIGTERM/SIGHUP to
/// tk-run are forwarded to the workers; the workers die with the launcher (PR_SET_PDEATHSIG).
int launch_local(const std::vector<std::string>& argv, const LaunchOptions& opts);

/// Writes the current CLOCK_MONOTONIC time and `kind` ("error", or "timeout" for a collective that
/// timed out waiting for a peer) to `file`: a worker's moment of failure, which the launcher
/// compares across ranks (the clock is the same for every process on the machine).
void record_failure(const std::string& file, const std::string& kind);

/// A TCP port on 127.0.0.1 that was free a moment ago.
int free_port();

}  // namespace tk
