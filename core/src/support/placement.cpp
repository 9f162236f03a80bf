// Where this process sits in a run's world, as its launcher's environment says (support.h): tk-run
// and torchrun's RANK/WORLD_SIZE, or a task of an srun step. Nothing here connects.
#include "support/support.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>

#include "tk/error.h"

namespace tk::detail {
namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

int env_int(const char* name, int fallback) {
  const char* v = env(name);
  if (!v) return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < -(1L << 30) || x > (1L << 30))
    throw Error(std::string("environment variable ") + name + "=" + v + " is not an integer");
  return static_cast<int>(x);
}

/// Whether this process is a task of an srun step (a batch script's own shell, with no step, is
/// one process, whatever the job's task count).
bool in_srun_step() { return env("SLURM_NTASKS") && (env("SLURM_STEP_ID") || env("SLURM_STEPID")); }

/// A count at the start of `at` (1 or more), with where it ends; none for anything else (no
/// digits, a sign, a number too large for a long).
std::optional<long> count_at(const char* at, const char** end) {
  if (*at < '0' || *at > '9') return std::nullopt;
  errno = 0;
  char* stop = nullptr;
  const long v = std::strtol(at, &stop, 10);
  *end = stop;
  if (errno == ERANGE || v < 1) return std::nullopt;
  return v;
}

}  // namespace

std::string first_host(const std::string& list) {
  // The first entry: up to the first comma outside brackets.
  std::string entry;
  int depth = 0;
  for (char ch : list) {
    if (ch == ',' && depth == 0) break;
    depth += ch == '[' ? 1 : ch == ']' ? -1 : 0;
    entry += ch;
  }
  // Each bracketed range set becomes its first value, its zero padding kept: "n[01-04,07]" -> "n01".
  std::string host;
  for (size_t i = 0; i < entry.size(); ++i) {
    if (entry[i] != '[') {
      host += entry[i];
      continue;
    }
    const size_t close = entry.find(']', i);
    if (close == std::string::npos) throw Error("cannot read the Slurm node list '" + list + "': a '[' is not closed");
    const std::string first = entry.substr(i + 1, entry.find_first_of(",-]", i + 1) - i - 1);
    if (first.empty() || first.find_first_not_of("0123456789") != std::string::npos)
      throw Error("cannot read the Slurm node list '" + list + "': '" + entry.substr(i, close - i + 1) +
                  "' is not a range of numbers");
    host += first;
    i = close;
  }
  return host;
}

long slurm_tasks_on_node(const std::string& list, long node) {
  long first = 0;  // the first node the entry covers
  for (const char* at = list.c_str(); *at != '\0';) {
    const char* end = nullptr;
    const auto tasks = count_at(at, &end);
    if (!tasks) return 1;
    long times = 1;
    if (std::strncmp(end, "(x", 2) == 0) {
      const auto repeat = count_at(end + 2, &end);
      if (!repeat || *end != ')') return 1;
      times = *repeat;
      ++end;
    }
    if (*end != ',' && *end != '\0') return 1;
    if (node - first < times) return *tasks;  // node >= first here: no sum that could overflow
    first += times;
    if (*end == '\0') return 1;
    at = end + 1;
  }
  return 1;
}

int local_rank_from_environment() {
  if (env("LOCAL_RANK")) return env_int("LOCAL_RANK", 0);
  if (env("WORLD_SIZE")) return env_int("RANK", 0);
  if (env("SLURM_LOCALID") && in_srun_step()) return env_int("SLURM_LOCALID", 0);
  return -1;
}

int local_world_size_from_environment(int world_size) {
  long n = 1;
  if (env("WORLD_SIZE")) {
    if (const char* v = env("LOCAL_WORLD_SIZE")) n = std::strtol(v, nullptr, 10);
  } else if (in_srun_step()) {
    if (const char* list = env("SLURM_STEP_TASKS_PER_NODE")) {
      const long node = env("SLURM_NODEID") ? std::strtol(env("SLURM_NODEID"), nullptr, 10) : 0;
      n = node < 0 ? 1 : slurm_tasks_on_node(list, node);
    }
  }
  return static_cast<int>(std::clamp<long>(n, 1, std::max(world_size, 1)));
}

int local_world_size_from_environment() {
  try {
    return local_world_size_from_environment(placement_from_environment().size);
  } catch (const Error&) {
    return 1;
  }
}

Placement placement_from_environment() {
  Placement p;
  if (env("WORLD_SIZE")) {
    p.size = env_int("WORLD_SIZE", 1);
    p.rank = env_int("RANK", 0);
    p.local_rank = env_int("LOCAL_RANK", p.rank);
    p.source = "RANK/WORLD_SIZE";
  } else if (in_srun_step()) {
    p.size = env_int("SLURM_NTASKS", 1);
    p.rank = env_int("SLURM_PROCID", 0);
    p.local_rank = env_int("SLURM_LOCALID", 0);
    p.source = "SLURM_PROCID/SLURM_NTASKS";
    if (const char* node = env("SLURM_NODEID")) p.source += ", node " + std::string(node);
    // The rendezvous is on the step's first node, unless MASTER_ADDR says otherwise.
    const char* nodes = env("SLURM_STEP_NODELIST") ? env("SLURM_STEP_NODELIST") : env("SLURM_JOB_NODELIST");
    if (p.size > 1 && !env("MASTER_ADDR")) {
      if (!nodes) throw Error("under Slurm without SLURM_JOB_NODELIST, set MASTER_ADDR (the first node's address)");
      p.addr = first_host(nodes);
      p.source += ", rendezvous on the first node of " + std::string(nodes);
    }
  }
  if (const char* a = env("MASTER_ADDR")) p.addr = a;
  p.port = env_int("MASTER_PORT", 29500);
  if (p.size < 1 || p.rank < 0 || p.rank >= p.size)
    throw Error("rank " + std::to_string(p.rank) + " is outside a world of " + std::to_string(p.size) + " (" + p.source +
                ")");
  if (p.port < 1 || p.port > 65535) throw Error("MASTER_PORT=" + std::to_string(p.port) + " is not a port");
  return p;
}

}  // namespace tk::detail
