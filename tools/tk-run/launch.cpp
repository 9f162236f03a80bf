#include "launch.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/prctl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <thread>

namespace tk {
namespace {

volatile sig_atomic_t g_signal = 0;
void on_signal(int sig) { g_signal = sig; }

struct Worker {
  pid_t pid = -1;
  // Set by the worker's reaper thread: when it ended, and how.
  std::atomic<bool> ended{false};
  std::chrono::steady_clock::time_point ended_at;
  int fd = -1;           // read end of the worker's stdout+stderr
  std::string partial;   // output not yet ended by a newline
  std::deque<std::string> tail;  // its last lines, for the failure report
  bool running = true;
  int status = 0;
};

void emit(int rank, Worker& w, const std::string& line) {
  std::printf("[rank %d] %s\n", rank, line.c_str());
  w.tail.push_back(line);
  if (w.tail.size() > 8) w.tail.pop_front();
}

/// Reads what is available; returns false at end of file.
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
    if (n == 0) {
      if (!w.partial.empty()) emit(rank, w, w.partial);
      w.partial.clear();
      return false;
    }
    return errno == EAGAIN || errno == EINTR;
  }
}

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

/// What rank `r` recorded when it failed: when, and "error" or "timeout"; {-1, ""} if nothing.
std::pair<int64_t, std::string> failure_record(const std::string& dir, int r) {
  std::ifstream in(dir + "/" + std::to_string(r));
  int64_t t = -1;
  std::string kind;
  if (in >> t >> kind) return {t, kind};
  return {-1, ""};
}

/// When rank `r` failed: the time it recorded, or when it ended (killed by a signal, say);
/// -1 while it has neither failed nor ended badly.
int64_t failure_time(const std::string& dir, int r, const Worker& w) {
  const int64_t t = failure_record(dir, r).first;
  if (t >= 0) return t;
  const bool ok = WIFEXITED(w.status) && WEXITSTATUS(w.status) == 0;
  if (w.running || ok) return -1;
  return std::chrono::duration_cast<std::chrono::nanoseconds>(w.ended_at.time_since_epoch()).count();
}

/// The rank that failed first, or -1. A worker killed by a signal before the launcher sent any is
/// a cause (its peers only notice it is gone); otherwise the earliest recorded failure wins.
int first_failure(const std::string& dir, const std::vector<Worker>& workers,
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
    const int64_t t = failure_time(dir, r, workers[static_cast<size_t>(r)]);
    if (t >= 0 && (first < 0 || t < best)) {
      first = r;
      best = t;
    }
  }
  return first;
}

}  // namespace

void record_failure(const std::string& file, const std::string& kind) {
  std::ofstream(file) << now_ns() << " " << kind << "\n";
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

/// The workers of one launch, from their start to the report of how they ended.
class Launch {
 public:
  Launch(const std::vector<std::string>& argv, const LaunchOptions& opts)
      : argv_(argv), opts_(opts), n_(opts.nproc), workers_(static_cast<size_t>(opts.nproc)) {}
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
    return report();
  }

 private:
  bool started(int r) const { return opts_.only_rank < 0 || r == opts_.only_rank; }
  Worker& worker(int r) { return workers_[static_cast<size_t>(r)]; }

  void start() {
    port_ = opts_.master_port > 0 ? opts_.master_port : free_port();
    const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
    threads_ = std::to_string(std::max(1u, hw / static_cast<unsigned>(n_)));
    if (opts_.only_rank < 0) std::fprintf(stderr, "tk-run: starting %d workers, rendezvous on 127.0.0.1:%d\n", n_, port_);
    std::fflush(stderr);
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaction(sig, &sa, nullptr);
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

  /// Starts rank `r` with the world's variables, its output into a pipe, and a thread that reaps it.
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
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(n_).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(n_).c_str(), 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", std::to_string(port_).c_str(), 1);
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
    reapers_.emplace_back([w = &worker(r)] {
      int status = 0;
      while (waitpid(w->pid, &status, 0) < 0 && errno == EINTR) {
      }
      w->status = status;
      w->ended_at = Clock::now();
      w->ended.store(true);
    });
  }

  void stop_all(int sig) {
    if (stop_sent_ == Clock::time_point::max()) stop_sent_ = Clock::now();
    for (auto& w : workers_)
      if (w.pid > 0 && !w.ended.load()) kill(w.pid, sig);  // never -1: that would be every process
  }

  /// Forwards what the workers wrote, line by line, for up to 100 ms.
  void pump_output() {
    std::vector<pollfd> pfds;
    std::vector<int> ranks;
    for (int r = 0; r < n_; ++r)
      if (worker(r).fd >= 0) {
        pfds.push_back({worker(r).fd, POLLIN, 0});
        ranks.push_back(r);
      }
    if (!pfds.empty()) poll(pfds.data(), pfds.size(), 100);
    for (size_t i = 0; i < pfds.size(); ++i) {
      if (!pfds[i].revents) continue;
      Worker& w = worker(ranks[i]);
      if (!drain(ranks[i], w)) {
        close(w.fd);
        w.fd = -1;
      }
    }
    std::fflush(stdout);
  }

  /// The first failure, once: the others are asked to stop.
  void notice_failure() {
    if (failed_rank_ >= 0 || stopping_) return;
    bool someone_failed = false;
    for (const auto& w : workers_) someone_failed |= !w.running && !(WIFEXITED(w.status) && WEXITSTATUS(w.status) == 0);
    if (someone_failed) failed_rank_ = first_failure(failure_dir_, workers_, stop_sent_);
    if (failed_rank_ < 0) return;
    std::fprintf(stderr, "tk-run: rank %d %s; stopping the other ranks\n", failed_rank_,
                 describe_status(worker(failed_rank_).status).c_str());
    stopping_ = true;
    stop_all(SIGTERM);
    kill_at_ = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(opts_.stop_grace_s * 1000));
  }

  /// One round: output, failures, signals, the grace period; false once every worker is done.
  bool step() {
    pump_output();
    bool any_running = false;
    for (auto& w : workers_) {
      if (w.running && w.ended.load()) w.running = false;
      any_running |= w.running;
    }
    notice_failure();
    if (g_signal && !forwarded_) {
      std::fprintf(stderr, "tk-run: got signal %d; stopping the workers\n", static_cast<int>(g_signal));
      stop_all(g_signal);
      forwarded_ = stopping_ = true;
      kill_at_ = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(opts_.stop_grace_s * 1000));
    }
    if (stopping_ && any_running && Clock::now() >= kill_at_) {
      stop_all(SIGKILL);
      kill_at_ = Clock::now() + std::chrono::hours(1);
    }
    bool any_output = false;
    for (const auto& w : workers_) any_output |= w.fd >= 0;
    if (!any_running && !any_output) return false;
    if (!any_running)  // drain what is left, without waiting on pipes held open elsewhere
      for (int r = 0; r < n_; ++r)
        if (worker(r).fd >= 0) {
          drain(r, worker(r));
          close(worker(r).fd);
          worker(r).fd = -1;
        }
    return true;
  }

  /// A rank that timed out waited for a peer. Healthy peers time out too, by themselves; the ones
  /// that never failed and had to be killed are the ones that hung.
  std::vector<int> hung_ranks() {
    std::vector<int> hung;
    if (failed_rank_ < 0 || failure_record(failure_dir_, failed_rank_).second != "timeout") return hung;
    for (int r = 0; r < n_; ++r) {
      const Worker& w = worker(r);
      if (started(r) && failure_record(failure_dir_, r).first < 0 && WIFSIGNALED(w.status) &&
          WTERMSIG(w.status) == SIGKILL && w.ended_at >= stop_sent_)
        hung.push_back(r);
    }
    return hung;
  }

  int report() {
    // With every rank's record in, the first failure is known for sure.
    if (failed_rank_ >= 0) failed_rank_ = first_failure(failure_dir_, workers_, stop_sent_);
    const std::vector<int> hung = hung_ranks();
    std::error_code ec;
    std::filesystem::remove_all(failure_dir_, ec);
    for (int r : hung) {
      std::fprintf(stderr, "tk-run: rank %d hung: rank %d timed out waiting for it in a collective, and it neither "
                   "failed nor stopped when asked, so it was killed. Its last output:\n", r, failed_rank_);
      for (const auto& line : worker(r).tail) std::fprintf(stderr, "  %s\n", line.c_str());
    }
    if (failed_rank_ >= 0) {
      const Worker& w = worker(failed_rank_);
      std::fprintf(stderr, "tk-run: rank %d failed (%s)%s. Its last output:\n", failed_rank_,
                   describe_status(w.status).c_str(), hung.empty() ? "" : ", timed out waiting for the rank that hung");
      for (const auto& line : w.tail) std::fprintf(stderr, "  %s\n", line.c_str());
      // A worker that refused the run before training (exit 2) makes the launch a refusal too.
      return WIFEXITED(w.status) && WEXITSTATUS(w.status) == 2 ? 2 : 1;
    }
    return g_signal ? 128 + g_signal : 0;
  }

  const std::vector<std::string>& argv_;
  const LaunchOptions& opts_;
  const int n_;
  std::vector<Worker> workers_;
  std::vector<std::thread> reapers_;
  std::string failure_dir_, threads_;
  int port_ = 0, failed_rank_ = -1;
  Clock::time_point kill_at_{}, stop_sent_ = Clock::time_point::max();  // when the launcher first signalled
  bool stopping_ = false, forwarded_ = false;
};

}  // namespace

int launch_local(const std::vector<std::string>& argv, const LaunchOptions& opts) { return Launch(argv, opts).run(); }

}  // namespace tk
