#include "launch.h"

#include "nodes.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/prctl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <tk/output.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <optional>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <thread>
#include <vector>

namespace tk {
namespace {

volatile sig_atomic_t g_signal = 0, g_signals = 0;  // the last stop signal; how many came
void on_signal(int sig) {
  g_signal = sig;  // set before it is counted: a count the step loop reads has its signal
  g_signals = g_signals + 1;
}

struct Worker {
  pid_t pid = -1;
  // Set by the worker's reaper thread: when it ended, and how.
  std::atomic<bool> ended{false};
  std::chrono::steady_clock::time_point ended_at;
  int fd = -1;           // read end of the worker's stdout+stderr
  std::string partial;   // output not yet ended by a newline
  std::deque<std::string> tail;  // its last lines, for the failure report
  std::vector<std::string> error;  // its error as it came so far ("PROGRAM: error: " and what follows)
  std::chrono::steady_clock::time_point error_at;  // when its first line came
  bool running = true;
  int status = 0;
};

/// The workers' output, line by line with each one's rank. An error a worker prints (its last
/// words: "PROGRAM: error: " and the lines after it) is held for a moment, until its output ends
/// or kHold has passed, so that ranks that refused the run alike (a recipe every rank reads) print
/// it once: the others say theirs is the same.
class Output {
 public:
  explicit Output(const std::string& program) : marker_(program + kErrorMark) {}

  /// Reads what `w` has written; returns false at the end of its output (or on a read error).
  bool drain(int rank, Worker& w) {
    char buf[4096];
    for (;;) {
      ssize_t n = read(w.fd, buf, sizeof buf);
      if (n > 0) {
        w.partial.append(buf, static_cast<size_t>(n));
        size_t pos;
        while ((pos = w.partial.find('\n')) != std::string::npos) {
          std::string line = w.partial.substr(0, pos);
          if (!line.empty() && line.back() == '\r') line.pop_back();
          // A live progress line rewrites itself with \r; keep the last state of it.
          size_t cr = line.rfind('\r');
          emit(rank, w, cr == std::string::npos ? line : line.substr(cr + 1));
          w.partial.erase(0, pos + 1);
        }
        continue;
      }
      return n < 0 && (errno == EAGAIN || errno == EINTR);
    }
  }

  /// The end of `w`'s output: what is left of it printed, and its pipe closed.
  void close_output(int rank, Worker& w) {
    if (!w.partial.empty()) emit(rank, w, w.partial);
    w.partial.clear();
    flush(rank, w);
    close(w.fd);
    w.fd = -1;
  }

  /// Prints the errors held for kHold (a worker that lingers after its error, in a collective's
  /// teardown, say, has it shown all the same).
  void flush_held(int rank, Worker& w) {
    if (!w.error.empty() && std::chrono::steady_clock::now() - w.error_at >= kHold) flush(rank, w);
  }

 private:
  static constexpr std::chrono::seconds kHold{1};

  void emit(int rank, Worker& w, const std::string& line) {
    w.tail.push_back(line);
    if (w.tail.size() > 8) w.tail.pop_front();
    if (w.error.empty() && line.rfind(marker_, 0) != 0) {
      print(rank, line);
      return;
    }
    if (w.error.empty()) w.error_at = std::chrono::steady_clock::now();
    w.error.push_back(line);
  }

  void flush(int rank, Worker& w) {
    if (w.error.empty()) return;
    const auto same = std::find_if(printed_.begin(), printed_.end(), [&](const auto& e) { return e.first == w.error; });
    if (same != printed_.end()) {
      print(rank, marker_ + "the same as rank " + std::to_string(same->second) + "'s above");
    } else {
      for (const auto& line : w.error) print(rank, line);
      printed_.emplace_back(w.error, rank);
    }
    w.error.clear();
  }

  static void print(int rank, const std::string& line) { std::printf("[rank %d] %s\n", rank, line.c_str()); }

  std::string marker_;
  std::vector<std::pair<std::vector<std::string>, int>> printed_;  // each error printed, and whose
};

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    int s = WTERMSIG(status);
    return "was killed by signal " + std::to_string(s) + " (" + strsignal(s) + ")";
  }
  return "stopped";
}

int64_t now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

/// What rank `r` recorded when it failed: when, and "error", "timeout" or "refused" (the worker
/// exits 2); {-1, ""} if nothing.
std::pair<int64_t, std::string> failure_record(const std::string& dir, int r) {
  std::ifstream in(dir + "/" + std::to_string(r));
  int64_t t = -1;
  std::string kind;
  if (in >> t >> kind) return {t, kind};
  return {-1, ""};
}

/// A worker that stopped at a checkpoint on a signal sent to it alone: tk-run exits 128 + the
/// signal then, and the world stopped with it at the same boundary (a stop, not a failure).
bool stopped_on_signal(const Worker& w) {
  if (w.running || !WIFEXITED(w.status)) return false;
  const int code = WEXITSTATUS(w.status);
  return code == 128 + SIGINT || code == 128 + SIGTERM || code == 128 + SIGHUP || code == 128 + SIGUSR1;
}

/// Whether a worker that ended did so as it should: done, or stopped on a signal.
bool ended_well(const Worker& w) {
  return !w.running && ((WIFEXITED(w.status) && WEXITSTATUS(w.status) == 0) || stopped_on_signal(w));
}

/// status.json of a launch whose first failure was a rank killed outright (SIGKILL, the OOM
/// killer), which could not say so itself: rank 0 recorded what it saw after (a peer gone, "Connection
/// reset by peer"), or, killed itself, nothing past "running". The cause goes first. Only the file
/// that `writer` (rank 0's process) wrote, in the folder rank 0 told the launcher (`output`).
void put_cause_in_status(const std::string& output, pid_t writer, const std::string& cause) {
  if (output.empty()) return;
  const std::filesystem::path file = std::filesystem::path(output) / "status.json";
  std::ifstream in(file);
  nlohmann::json s = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!s.is_object() || !s.contains("pid") || !s["pid"].is_number_integer() || s["pid"].get<int64_t>() != writer)
    return;
  const std::string state = s.contains("status") && s["status"].is_string() ? s["status"].get<std::string>() : "";
  if (state != "failed" && state != "running") return;
  const std::string seen = s.contains("detail") && s["detail"].is_string() ? s["detail"].get<std::string>() : "";
  s["status"] = "failed";
  s["detail"] = cause + (seen.empty() ? std::string() : "; rank 0 then failed: " + seen);
  try {
    write_atomic(file, s.dump() + "\n");
  } catch (const std::exception&) {  // the launch's own report says it all the same
  }
}

/// When rank `r` failed: the time it recorded, or when it ended (killed by a signal, say);
/// -1 while it has neither failed nor ended badly.
int64_t failure_time(const std::string& dir, int r, const Worker& w) {
  const int64_t t = failure_record(dir, r).first;  // r: the worker's rank in the world
  if (t >= 0) return t;
  if (w.running || ended_well(w)) return -1;
  return std::chrono::duration_cast<std::chrono::nanoseconds>(w.ended_at.time_since_epoch()).count();
}

/// The worker (an index into `workers`, whose ranks start at `base`) that failed first, or -1. A worker killed by a signal before the launcher sent any is
/// a cause (its peers only notice it is gone); otherwise the earliest recorded failure wins.
int first_failure(const std::string& dir, const std::vector<Worker>& workers, int base,
                  std::chrono::steady_clock::time_point stop_sent) {
  int first = -1;
  int64_t best = 0;
  for (int r = 0; r < static_cast<int>(workers.size()); ++r) {
    const Worker& w = workers[static_cast<size_t>(r)];
    if (w.running || !WIFSIGNALED(w.status) || w.ended_at >= stop_sent) continue;
    if (first < 0 || w.ended_at < workers[static_cast<size_t>(first)].ended_at) first = r;
  }
  if (first >= 0) return first;
  for (int r = 0; r < static_cast<int>(workers.size()); ++r) {
    const int64_t t = failure_time(dir, base + r, workers[static_cast<size_t>(r)]);
    if (t >= 0 && (first < 0 || t < best)) {
      first = r;
      best = t;
    }
  }
  return first;
}

}  // namespace

void record_failure(const std::string& file, const std::string& kind) {
  if (std::ifstream(file).good()) return;  // the first record of this rank's failure stands
  // Whole or absent to the launcher reading it: written aside, then renamed into place.
  const std::string part = file + ".part";
  std::ofstream(part) << now_ns() << " " << kind << "\n";
  std::rename(part.c_str(), file.c_str());
}

int free_port() {
  int s = socket(AF_INET, SOCK_STREAM, 0);
  if (s < 0) throw std::runtime_error("cannot open a socket to find a free port");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      getsockname(s, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    close(s);
    throw std::runtime_error("cannot bind a socket on 127.0.0.1 to find a free port");
  }
  int port = ntohs(a.sin_port);
  close(s);
  return port;
}

namespace {

using Clock = std::chrono::steady_clock;

/// After the first failure anywhere, how long the launchers of a multi-node world keep listening
/// for the other nodes' accounts before they name the cause (a node gone needs its heartbeat to
/// stop for 3 s).
constexpr auto kSettle = std::chrono::milliseconds(5000);

/// The workers of one node's launch, from their start to the report of how they ended.
class Launch {
 public:
  Launch(const std::vector<std::string>& argv, const LaunchOptions& opts)
      : argv_(argv), opts_(opts), n_(opts.nproc), base_(opts.node_rank * opts.nproc),
        world_(opts.nnodes * opts.nproc), workers_(static_cast<size_t>(opts.nproc)) {}
  ~Launch() {
    for (auto& t : reapers_)
      if (t.joinable()) t.join();
  }

  int run() {
    start();
    while (step()) {
    }
    for (auto& t : reapers_) t.join();
    std::fflush(stdout);
    const int rc = report();
    if (!link_) return rc;
    // Node 0 stays for the others; a failure they publish meanwhile is the world's.
    for (const auto& f : link_->finish(rc == 0))
      if (rc == 0) {
        std::fprintf(stderr, "%s: this node's ranks ended, then the world failed: %s\n", opts_.program.c_str(),
                     f.headline().c_str());
        return f.exit_code;
      }
    return rc;
  }

 private:
  bool started(int r) const { return opts_.only_rank < 0 || r == opts_.only_rank; }
  Worker& worker(int r) { return workers_[static_cast<size_t>(r)]; }
  int rank(int r) const { return base_ + r; }  // worker r's rank in the world

  void start() {
    port_ = opts_.master_port > 0 ? opts_.master_port : free_port();
    const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
    threads_ = std::to_string(std::max(1u, hw / static_cast<unsigned>(n_)));
    if (opts_.nnodes > 1 && opts_.only_rank < 0) {
      std::fprintf(stderr, "%s: node %d of %d: waiting for the other launchers at %s:%d\n", opts_.program.c_str(),
                   opts_.node_rank,
                   opts_.nnodes, opts_.master_addr.c_str(), port_ + 1);
      std::fflush(stderr);
      link_ = std::make_unique<NodeLink>(opts_.master_addr, port_ + 1, opts_.nnodes, opts_.node_rank, n_,
                                         opts_.node_timeout_s);
      const std::string ranks = n_ == 1 ? "rank " + std::to_string(base_)
                                        : "ranks " + std::to_string(base_) + "-" + std::to_string(base_ + n_ - 1);
      std::fprintf(stderr, "%s: node %d of %d: starting %s of %d, rendezvous on %s:%d\n", opts_.program.c_str(),
                   opts_.node_rank, opts_.nnodes, ranks.c_str(), world_, opts_.master_addr.c_str(), port_);
    } else if (opts_.only_rank < 0) {
      std::fprintf(stderr, "%s: starting %d workers, rendezvous on %s:%d\n", opts_.program.c_str(),
                   n_, opts_.master_addr.c_str(), port_);
    }
    std::fflush(stderr);
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigfillset(&sa.sa_mask);  // one handler at a time: none lost
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGUSR1}) sigaction(sig, &sa, nullptr);
    char dir_template[] = "/tmp/tk-run-XXXXXX";
    if (!mkdtemp(dir_template)) throw std::runtime_error("cannot make a temporary folder");
    failure_dir_ = dir_template;
    setenv("TK_FAILURE_DIR", failure_dir_.c_str(), 1);
    try {
      for (int r = 0; r < n_; ++r) {
        if (started(r)) {
          spawn(r);
        } else {
          worker(r).running = false;  // never started: neither failed nor running
          worker(r).ended.store(true);
        }
      }
    } catch (...) {
      stop_all(SIGKILL);  // the ranks started so far would wait for the others in their rendezvous
      throw;
    }
  }

  /// Starts worker `r` with the world's variables (torchrun's names), its output into a pipe, and
  /// a thread that reaps it.
  void spawn(int r) {
    int fds[2];
    if (pipe(fds) != 0) throw std::runtime_error("pipe() failed");
    const pid_t launcher = getpid();
    const pid_t pid = fork();
    if (pid < 0) throw std::runtime_error("fork() failed");
    if (pid == 0) {
      // A worker dies with its launcher, however the launcher ends; checked after setting it, in
      // case the launcher ended before.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != launcher) _exit(1);
      dup2(fds[1], STDOUT_FILENO);
      dup2(fds[1], STDERR_FILENO);
      close(fds[0]);
      close(fds[1]);
      setenv("RANK", std::to_string(rank(r)).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(world_).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(n_).c_str(), 1);
      setenv("GROUP_RANK", std::to_string(opts_.node_rank).c_str(), 1);
      setenv("GROUP_WORLD_SIZE", std::to_string(opts_.nnodes).c_str(), 1);
      setenv("MASTER_ADDR", opts_.master_addr.c_str(), 1);
      setenv("MASTER_PORT", std::to_string(port_).c_str(), 1);
      setenv("TK_RESTART_COUNT", std::to_string(opts_.restart).c_str(), 1);
      setenv("OMP_NUM_THREADS", threads_.c_str(), 0);  // share the cores unless told otherwise
      std::vector<char*> args;
      for (const auto& a : argv_) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      execv("/proc/self/exe", args.data());
      std::fprintf(stderr, "cannot start worker: %s\n", std::strerror(errno));
      _exit(127);
    }
    close(fds[1]);
    fcntl(fds[0], F_SETFL, O_NONBLOCK);
    worker(r).pid = pid;
    worker(r).fd = fds[0];
    // Each worker is reaped the moment it ends, so that the first failure is known precisely
    // (the others often fail a moment later, when their collectives lose the peer).
    // The stop signals go to the main thread alone, which reads them in its step loop.
    sigset_t stops, before;
    sigemptyset(&stops);
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGUSR1}) sigaddset(&stops, sig);
    pthread_sigmask(SIG_BLOCK, &stops, &before);
    reapers_.emplace_back([w = &worker(r)] {
      int status = 0;
      while (waitpid(w->pid, &status, 0) < 0 && errno == EINTR) {
      }
      w->status = status;
      w->ended_at = Clock::now();
      w->ended.store(true);
    });
    pthread_sigmask(SIG_SETMASK, &before, nullptr);
  }

  void stop_all(int sig) {
    if (stop_sent_ == Clock::time_point::max()) stop_sent_ = Clock::now();
    for (auto& w : workers_)
      if (w.pid > 0 && !w.ended.load()) kill(w.pid, sig);  // never -1: that would be every process
  }

  /// Forwards what the workers wrote, line by line, for up to 100 ms.
  void pump_output() {
    std::vector<pollfd> pfds;
    std::vector<int> index;
    for (int r = 0; r < n_; ++r)
      if (worker(r).fd >= 0) {
        pfds.push_back({worker(r).fd, POLLIN, 0});
        index.push_back(r);
      }
    if (!pfds.empty()) poll(pfds.data(), pfds.size(), 100);
    else std::this_thread::sleep_for(std::chrono::milliseconds(100));  // settling: no output left
    for (size_t i = 0; i < pfds.size(); ++i) {
      if (!pfds[i].revents) continue;
      if (!output_.drain(rank(index[i]), worker(index[i]))) output_.close_output(rank(index[i]), worker(index[i]));
    }
    for (int r = 0; r < n_; ++r) output_.flush_held(rank(r), worker(r));
    std::fflush(stdout);
  }

  /// This node's first failure as the other nodes get it.
  NodeFailure local_account() {
    const Worker& w = worker(failed_rank_);
    NodeFailure f;
    const std::string kind = failure_record(failure_dir_, rank(failed_rank_)).second;
    f.kind = kind == "timeout" ? NodeFailure::Timeout
             : kind.empty() && !w.running && WIFSIGNALED(w.status) && w.ended_at < stop_sent_ ? NodeFailure::Signal
                                                                                               : NodeFailure::Error;
    // When it failed, by this machine's real-time clock (the records use the monotonic one).
    const int64_t mono = failure_time(failure_dir_, rank(failed_rank_), w);
    f.time_ns = mono >= 0 ? realtime_ns() - (now_ns() - mono) : failure_real_ns_;
    f.node = opts_.node_rank;
    // A rank that refused the run exits 2: said by its record while it is still on its way out.
    f.exit_code = (!w.running && WIFEXITED(w.status) && WEXITSTATUS(w.status) == 2) || kind == "refused" ? 2 : 1;
    f.what = "rank " + std::to_string(rank(failed_rank_)) + " failed" +
             (w.running ? std::string() : " (" + describe_status(w.status) + ")") + " on node " +
             std::to_string(opts_.node_rank);
    for (const auto& line : w.tail) f.what += "\n" + line;
    return f;
  }

  /// The first failure, once: the others are asked to stop (and, across nodes, told).
  void notice_failure() {
    if (failed_rank_ >= 0 || forwarded_ || (stopping_ && !link_)) return;
    bool someone_failed = false;
    for (const auto& w : workers_) someone_failed |= !w.running && !ended_well(w);
    if (someone_failed) failed_rank_ = first_failure(failure_dir_, workers_, base_, stop_sent_);
    if (failed_rank_ < 0) return;
    failure_real_ns_ = realtime_ns();
    if (stopping_) {  // another node's account stopped this one: what fails here follows from it
      local_follows_ = true;
      return;
    }
    if (link_) link_->publish(local_account());
    const Worker& w = worker(failed_rank_);  // it may have recorded its failure and still be ending
    std::fprintf(stderr, "%s: rank %d %s; stopping the other ranks\n", opts_.program.c_str(), rank(failed_rank_),
                 w.running ? "failed" : describe_status(w.status).c_str());
    stop(Clock::now());
  }

  /// SIGTERM to this node's workers, SIGKILL after the grace period; across nodes, the accounts
  /// are gathered until `kSettle` after `first`.
  void stop(Clock::time_point first) {
    stopping_ = true;
    stop_all(SIGTERM);
    kill_at_ = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(opts_.stop_grace_s * 1000));
    if (link_ && settle_until_ == Clock::time_point::max()) settle_until_ = first + kSettle;
  }

  /// What the other nodes said this round; the first failure anywhere stops this node.
  void listen_to_nodes() {
    if (!link_) return;
    for (auto& f : link_->poll()) {
      if (!stopping_) {
        std::fprintf(stderr, "%s: %s; stopping this node's ranks\n", opts_.program.c_str(), f.headline().c_str());
        stop(Clock::now());
      }
      remote_.push_back(std::move(f));
    }
  }

  /// One round: output, failures, signals, the grace period; false once every worker is done
  /// (and, across nodes, the accounts of a failure are in).
  bool step() {
    pump_output();
    bool any_running = false;
    for (auto& w : workers_) {
      if (w.running && w.ended.load()) w.running = false;
      any_running |= w.running;
    }
    notice_failure();
    listen_to_nodes();
    const sig_atomic_t signals = g_signals;  // read once: a signal coming during this round is the next round's
    if (signals > 0 && !forwarded_) {
      std::fprintf(stderr, "%s: got signal %d; stopping the workers\n", opts_.program.c_str(),
                   static_cast<int>(g_signal));
      if (link_ && !stopping_)
        link_->publish({NodeFailure::Signal, realtime_ns(), opts_.node_rank, 128 + static_cast<int>(g_signal),
                        "node " + std::to_string(opts_.node_rank) + "'s launcher got signal " +
                            std::to_string(static_cast<int>(g_signal)) + " and stopped its ranks"});
      stop_all(g_signal);
      forwarded_ = stopping_ = true;
      kill_at_ = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(opts_.stop_grace_s * 1000));
      signals_forwarded_ = signals;
    } else if (forwarded_ && signals > signals_forwarded_ && any_running) {
      // Another signal (a second Ctrl-C): stop at once. The ranks keep to the first stop they got.
      std::fprintf(stderr, "%s: got signal %d again; killing the workers\n", opts_.program.c_str(),
                   static_cast<int>(g_signal));
      signals_forwarded_ = signals;
      kill_at_ = Clock::now();
    }
    if (stopping_ && any_running && Clock::now() >= kill_at_) {
      stop_all(SIGKILL);
      kill_at_ = Clock::now() + std::chrono::hours(1);
    }
    bool any_output = false;
    for (const auto& w : workers_) any_output |= w.fd >= 0;
    const bool settling = link_ && stopping_ && !forwarded_ && Clock::now() < settle_until_;
    if (!any_running && !any_output) return settling;
    if (!any_running)  // drain what is left, without waiting on pipes held open elsewhere
      for (int r = 0; r < n_; ++r)
        if (worker(r).fd >= 0) {
          output_.drain(rank(r), worker(r));
          output_.close_output(rank(r), worker(r));
        }
    return true;
  }

  /// A rank that timed out waited for a peer. Healthy peers time out too, by themselves; the ones
  /// that never failed and had to be killed are the ones that hung.
  std::vector<int> hung_ranks(bool remote_timeout) {
    std::vector<int> hung;
    if (!remote_timeout && (failed_rank_ < 0 || failure_record(failure_dir_, rank(failed_rank_)).second != "timeout"))
      return hung;
    for (int r = 0; r < n_; ++r) {
      const Worker& w = worker(r);
      if (started(r) && failure_record(failure_dir_, rank(r)).first < 0 && WIFSIGNALED(w.status) &&
          WTERMSIG(w.status) == SIGKILL && w.ended_at >= stop_sent_)
        hung.push_back(r);
    }
    return hung;
  }

  /// Across nodes: another node's account, when it names the cause rather than this node's.
  std::optional<NodeFailure> remote_cause() {
    std::optional<NodeFailure> best;
    for (const auto& f : remote_)
      if (!best || f.before(*best)) best = f;
    if (!best) return best;
    if (failed_rank_ >= 0 && !local_follows_) {
      const NodeFailure mine = local_account();
      if (!best->before(mine)) return std::nullopt;
    }
    return best;
  }

  int report() {
    // With every rank's record in, the first failure is known for sure.
    if (failed_rank_ >= 0) failed_rank_ = first_failure(failure_dir_, workers_, base_, stop_sent_);
    const std::optional<NodeFailure> remote = forwarded_ ? std::nullopt : remote_cause();
    const bool remote_timeout = remote && remote->kind == NodeFailure::Timeout;
    const std::vector<int> hung = remote && !remote_timeout ? std::vector<int>{} : hung_ranks(remote_timeout);
    // A worker that refused the run may be stopped on its way out: its record still says so.
    const bool refused = failed_rank_ >= 0 && failure_record(failure_dir_, rank(failed_rank_)).second == "refused";
    const bool killed_outright = failed_rank_ >= 0 && failure_record(failure_dir_, rank(failed_rank_)).first < 0 &&
                                 !worker(failed_rank_).running && WIFSIGNALED(worker(failed_rank_).status);
    std::string output;  // where rank 0 writes status.json, when it is on this node and said so
    std::getline(std::ifstream(failure_dir_ + "/output"), output);
    std::error_code ec;
    std::filesystem::remove_all(failure_dir_, ec);
    for (int r : hung)
      if (remote_timeout) {
        std::fprintf(stderr, "%s: rank %d hung: a rank of another node timed out waiting in a collective, and "
                     "it neither failed nor stopped when asked, so it was killed. Its last output:\n", opts_.program.c_str(),
                     rank(r));
        for (const auto& line : worker(r).tail) std::fprintf(stderr, "  %s\n", line.c_str());
      }
    if (remote) {
      std::fprintf(stderr, "%s: the world failed: %s. Its last output:\n", opts_.program.c_str(),
                   remote->headline().c_str());
      const std::string& what = remote->what;
      for (size_t at = what.find('\n'); at != std::string::npos;) {
        const size_t next = what.find('\n', at + 1);
        std::fprintf(stderr, "  %s\n", what.substr(at + 1, next - at - 1).c_str());
        at = next;
      }
      return remote->exit_code;
    }
    for (int r : hung) {
      std::fprintf(stderr, "%s: rank %d hung: rank %d timed out waiting for it in a collective, and it neither "
                   "failed nor stopped when asked, so it was killed. Its last output:\n", opts_.program.c_str(), rank(r),
                   rank(failed_rank_));
      for (const auto& line : worker(r).tail) std::fprintf(stderr, "  %s\n", line.c_str());
    }
    if (failed_rank_ >= 0) {
      const Worker& w = worker(failed_rank_);
      const bool exited_2 = WIFEXITED(w.status) && WEXITSTATUS(w.status) == 2;
      const std::string how = refused && !exited_2 ? "refused the run and " + describe_status(w.status) + " on its way out"
                                                   : describe_status(w.status);
      std::fprintf(stderr, "%s: rank %d failed (%s)%s. Its last output:\n", opts_.program.c_str(), rank(failed_rank_),
                   how.c_str(), hung.empty() ? "" : ", timed out waiting for the rank that hung");
      for (const auto& line : w.tail) std::fprintf(stderr, "  %s\n", line.c_str());
      if (killed_outright && base_ == 0)
        put_cause_in_status(output, worker(0).pid,
                            "rank " + std::to_string(rank(failed_rank_)) + " " + describe_status(w.status));
      // A worker that refused the run before training (exit 2) makes the launch a refusal too, as
      // the other nodes are told.
      return exited_2 || refused ? 2 : 1;
    }
    if (g_signal) return 128 + g_signal;
    // A signal sent to one worker stopped the world at a checkpoint: the launch ends as that worker did.
    for (int r = 0; r < n_; ++r)
      if (stopped_on_signal(worker(r))) {
        std::fprintf(stderr, "%s: rank %d got signal %d and the world stopped with it at a checkpoint\n", opts_.program.c_str(),
                     rank(r),
                     WEXITSTATUS(worker(r).status) - 128);
        return WEXITSTATUS(worker(r).status);
      }
    return 0;
  }

  const std::vector<std::string>& argv_;
  const LaunchOptions& opts_;
  const int n_, base_, world_;
  std::vector<Worker> workers_;
  Output output_{opts_.program};
  std::vector<std::thread> reapers_;
  std::string failure_dir_, threads_;
  int port_ = 0, failed_rank_ = -1;
  int64_t failure_real_ns_ = 0;
  Clock::time_point kill_at_{}, stop_sent_ = Clock::time_point::max();  // when the launcher first signalled
  Clock::time_point settle_until_ = Clock::time_point::max();
  bool stopping_ = false, forwarded_ = false;
  sig_atomic_t signals_forwarded_ = 0;  // the signals that had come when the last was dealt with
  bool local_follows_ = false;  // this node's first failure came after another node's account
  std::unique_ptr<NodeLink> link_;  // the other nodes' launchers, with --nnodes > 1
  std::vector<NodeFailure> remote_;
};

}  // namespace

int launch_workers(const std::vector<std::string>& argv, const LaunchOptions& opts) {
  LaunchOptions attempt = opts;
  for (;; ++attempt.restart) {
    const int rc = Launch(argv, attempt).run();
    // Done, refused (the same recipe would be refused again), or stopped on a signal: no restart.
    if (rc != 1 || g_signal || attempt.restart >= opts.max_restarts) return rc;
    std::fprintf(stderr, "%s: restart %d of %d: starting the %d workers again; they resume from the run's newest "
                 "checkpoint\n", opts.program.c_str(), attempt.restart + 1, opts.max_restarts, opts.nproc);
    std::fflush(stderr);
  }
}

}  // namespace tk
