// tk-run: trains what a recipe describes.
//
//   tk-run recipe.toml [--set key=value]... [--dry-run] [--verify-accumulation] [--resume CKPT] [--overwrite] [--nproc N] ...
#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <tk/abi.h>
#include <tk/capabilities.h>
#include <tk/compat.h>
#include <tk/loader.h>
#include <tk/options.h>
#include <tk/trainer.h>

#include "../cli_parse.h"
#include "launch.h"
#include "report.h"

#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

namespace {

volatile std::sig_atomic_t g_stop_signal = 0;
/// Set once the process has said why it ends: a stop signal then adds nothing to what it said.
volatile std::sig_atomic_t g_said_why = 0;

/// An error for the person who started the run, as the launcher knows one ("tk-run: error: ...").
void print_error(const char* what) {
  g_said_why = 1;  // a launcher stopping the ranks that refused alike must find their errors alike
  std::fprintf(stderr, "tk-run%s%s\n", tk::kErrorMark, what);
}
/// Whether a second stop signal stops at once. Not in a rank of a launch (tk-run --nproc's,
/// torchrun's; WORLD_SIZE set): a terminal's Ctrl-C reaches the launcher and every rank, and the
/// launcher passes the stop on again; the launcher kills its ranks itself when it is to stop at once.
volatile std::sig_atomic_t g_repeat_stops_now = 1;

/// First SIGINT/SIGTERM/SIGHUP/SIGUSR1 (Slurm's warning before a preemption or the time limit,
/// sbatch --signal=USR1@SECONDS): stop at the next boundary with a checkpoint, exit 128 + the
/// signal. Second: stop now (alone; a launched rank keeps to the first).
void on_stop_signal(int sig) {
  if (g_stop_signal) {
    if (!g_repeat_stops_now) return;
    std::signal(sig, SIG_DFL);
    std::raise(sig);
  }
  g_stop_signal = sig;
}

/// A stop signal while the run is still being set up (plugins loaded, the plan made): nothing
/// written yet, nothing to keep: out at once, saying so (async-signal-safe).
void on_early_stop(int sig) {
  static const char kSaid[] = "tk-run: stopped by a signal before training began: nothing was trained, nothing written\n";
  if (!g_said_why && write(STDERR_FILENO, kSaid, sizeof kSaid - 1) < 0) {
  }
  // Ended by the signal itself: a launcher tells a stopped worker (exit 128 + signal, a checkpoint
  // taken) from one a signal ended before it trained.
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

constexpr int kExitFailed = 1;  // the run started and failed
/// Whether this process has gone on to train: a failure before is a refusal (exit 2).
bool g_fitting = false;
constexpr int kExitUsage = 2;   // bad command line, recipe or plugin: nothing was trained

/// Whether an error is a collective's timeout (a peer that stopped answering), as Gloo and NCCL say it.
bool is_timeout(const std::string& what) {
  std::string low = what;
  for (auto& ch : low) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return low.find("timed out") != std::string::npos || low.find("timeout") != std::string::npos;
}

/// `arg` as a shell reads it back: bare when safe, else in single quotes.
std::string shell_quote(const std::string& arg) {
  const bool safe = !arg.empty() && arg.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                                           "0123456789_./=:,+-@%") == std::string::npos;
  if (safe) return arg;
  std::string out = "'";
  for (char ch : arg) out += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return out + "'";
}

/// argv without the options in `drop` (with their values: "--opt V" and "--opt=V") and the flags
/// in `drop_flags`.
std::vector<std::string> args_without(int argc, char** argv, const std::vector<std::string>& drop,
                                      const std::vector<std::string>& drop_flags) {
  std::vector<std::string> out;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    bool skip = std::find(drop_flags.begin(), drop_flags.end(), a) != drop_flags.end();
    for (const auto& d : drop) {
      if (a == d) {
        skip = true;
        ++i;  // its value
        break;
      }
      if (a.rfind(d + "=", 0) == 0) skip = true;
    }
    if (!skip) out.push_back(a);
  }
  return out;
}

/// The launcher's options, which its workers do not get.
const std::vector<std::string> kLaunchOptions = {"--nproc", "--nnodes", "--node-rank", "--master-addr", "--master-port",
                                                 "--max-restarts"};

void print_specs(const tk::OptionSpecs& specs) {
  for (const auto& s : specs) {
    std::printf("      %-20s %-18s default %s\n", s.name.c_str(), tk::to_string(s.type),
                tk::to_toml(s.default_value).c_str());
    std::printf("      %-20s %s\n", "", s.doc.c_str());
    if (!s.choices.empty())
      std::printf("      %-20s one of: %s\n", "", tk::join(s.choices.data(), s.choices.data() + s.choices.size()).c_str());
  }
}

/// What a plugin provides, runs after, needs and refuses, with its default options (a run's
/// options may change it).
void print_contract(const tk::Registry& registry, const std::string& name) {
  std::string line;
  try {
    const tk::Contract c = tk::plugin_contract(registry, name);
    for (const auto& [what, caps] : {std::pair{"provides ", &c.provides}, std::pair{"runs after ", &c.after},
                                     std::pair{"requires ", &c.requires_}, std::pair{"conflicts with ", &c.conflicts}}) {
      if (caps->empty()) continue;
      std::vector<std::string> names;
      for (const auto& cap : *caps) names.push_back(cap.name());
      line += (line.empty() ? "" : "; ") + std::string(what) + tk::join(names.data(), names.data() + names.size());
    }
    if (line.empty()) line = "provides nothing";
  } catch (const std::exception& e) {  // options without defaults, say: its contract depends on them
    line = "cannot be told: " + std::string(e.what());
  }
  std::printf("      %-20s %s\n", "(at its defaults)", line.c_str());
}

template <class Maker>
void list_components(const char* section, const std::vector<tk::Component<Maker>>& list) {
  std::printf("[%s]\n", section);
  for (const auto& c : list) {
    std::printf("  name = \"%s\"  %s\n", c.name.c_str(), c.doc.c_str());
    std::printf("      %-20s %s\n", "(from)", c.library.c_str());
    print_specs(c.specs);
  }
}

/// Every library on the plugin path, loaded into one registry: what recipes can name.
int list_all() {
  tk::PluginLoader loader(tk::PluginLoader::default_dirs());
  tk::Registry registry;
  std::vector<std::string> broken;
  for (const auto& name : loader.available()) {
    try {
      loader.load(loader.find(name), registry);
    } catch (const std::exception& e) {
      broken.push_back(name + ": cannot load: " + e.what());
    }
  }
  list_components("model", registry.models());
  list_components("data", registry.data());
  list_components("loss", registry.losses());
  list_components("optimizer", registry.optimizers());
  list_components("schedule", registry.schedules());
  std::printf("[[plugins]]\n");
  for (const auto& c : registry.plugins()) {
    std::printf("  name = \"%s\"  %s\n", c.name.c_str(), c.doc.c_str());
    std::printf("      %-20s %s\n", "(from)", c.library.c_str());
    print_contract(registry, c.name);
    print_specs(c.specs);
  }
  for (const auto& b : broken) std::printf("  %s\n", b.c_str());
  return 0;
}

/// The verifier's report: the worst parameters, what explains a difference, the verdict.
int print_accumulation_check(const tk::AccumulationCheck& c) {
  std::printf("accumulation check: the first step as %lld micro-batches of %lld vs one batch of %lld, in float64\n",
              static_cast<long long>(c.micro_batches), static_cast<long long>(c.micro_batch),
              static_cast<long long>(c.micro_batches * c.micro_batch));
  auto params = c.parameters;
  std::stable_sort(params.begin(), params.end(),
                   [](const auto& a, const auto& b) { return a.relative_difference > b.relative_difference; });
  const size_t shown = std::min<size_t>(params.size(), 10);
  std::printf("  %-40s %s\n", "parameter", "max relative difference");
  for (size_t i = 0; i < shown; ++i)
    std::printf("  %-40s %.3g%s\n", params[i].name.c_str(), params[i].relative_difference,
                params[i].relative_difference > c.tolerance ? "  (over)" : "");
  if (params.size() > shown) std::printf("  ... and %zu more parameters, none larger\n", params.size() - shown);
  for (const auto& f : c.findings) std::printf("  found: %s\n", f.c_str());
  if (c.exact()) {
    std::printf("exact: largest difference %.3g, within the tolerance %.0e of the run's dtype\n", c.max_difference, c.tolerance);
    return 0;
  }
  std::printf("NOT exact: largest difference %.3g, over the tolerance %.0e of the run's dtype; k x m micro-batches do "
              "not take the step one batch of k*m would\n", c.max_difference, c.tolerance);
  return kExitFailed;
}

/// --report: the run's page (tk-report), written into its output folder however the run ended.
void write_report(const tk::Trainer& trainer) {
  const std::filesystem::path dir = trainer.output_dir();
  if (dir.empty() || tk::launch_rank() != 0 || !std::filesystem::exists(dir / "metrics.jsonl")) return;
  try {
    const auto written = tk::report::write({dir}, dir / "report.html");
    for (const auto& w : written.warnings) spdlog::warn("report: {}", w);
    std::printf("report: %s\n", written.file.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tk-run: could not write the report: %s\n", e.what());
  }
}

/// The stop signals, as a set.
sigset_t stop_signals() {
  sigset_t s;
  sigemptyset(&s);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGUSR1}) sigaddset(&s, sig);
  return s;
}

/// OpenMP worker threads that spin after each parallel region fight OpenBLAS's own threads for the
/// cores: measured on 2 cores, a GPT step took 10x longer under LibTorch 2.6 and a CNN step 1.4x
/// under 1.13 (docs/benchmarks.md). libgomp reads OMP_WAIT_POLICY when it is loaded, before main,
/// so tk-run sets it to PASSIVE and runs itself again, once; a value the user set is kept.
void prefer_passive_openmp(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
  // A stop that comes while the program starts again (its libraries load for a second or so)
  // waits, blocked, for main's handlers: an exec would otherwise let it kill the process unsaid.
  const sigset_t stops = stop_signals();
  sigprocmask(SIG_BLOCK, &stops, nullptr);
  execv("/proc/self/exe", argv);  // returns only on failure: then run with what we have
  sigprocmask(SIG_UNBLOCK, &stops, nullptr);
}

/// glibc gives a freed block above its mmap threshold back to the kernel (the threshold starts at
/// 128 KiB), and shrinks the heap when 128 KiB are free at its top: the next micro-batch's
/// activations then fault every page in anew, zeroed. Measured on 40 steps of gpt-tiny: 8x the
/// minor page faults and 1.5x the time in the kernel (docs/benchmarks.md). tk-run keeps freed
/// memory for reuse, as a caching allocator does: blocks up to 32 MiB (glibc's largest threshold)
/// from the heap, and up to 1 GiB free at its top. Either threshold the user set (GLIBC_TUNABLES, MALLOC_*_ variables) is kept.
void keep_freed_memory() {
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  auto user_set = [&](const char* tunable, const char* variable) {
    return (tunables != nullptr && std::strstr(tunables, tunable) != nullptr) || std::getenv(variable) != nullptr;
  };
  if (!user_set("glibc.malloc.mmap_threshold", "MALLOC_MMAP_THRESHOLD_")) mallopt(M_MMAP_THRESHOLD, 32 << 20);
  if (!user_set("glibc.malloc.trim_threshold", "MALLOC_TRIM_THRESHOLD_")) mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

/// What the command line asked for.
struct Cli {
  std::string recipe_path, level = "info", progress = "auto", resume;
  std::vector<std::string> overrides;
  bool dry_run = false, list = false, version = false, verify = false, report = false;
  tk::TrainerOptions topts;
  tk::LaunchOptions launch;
  bool worker = std::getenv("TK_WORKER") != nullptr;
};

void add_options(CLI::App& app, Cli& c) {
  app.add_option("recipe", c.recipe_path, "the recipe (TOML) to train");
  app.add_option("--set", c.overrides,
                 "override a recipe value (repeatable), e.g. --set optimizer.lr=0.01, --set "
                 "batch.accumulation=8; VALUE is TOML (strings may be bare)")
      ->type_name("KEY=VALUE")
      ->allow_extra_args(false);
  app.add_flag("--dry-run", c.dry_run, "validate the recipe, load the plugins, print the resolved plan; no training");
  app.add_flag("--verify-accumulation", c.verify,
               "compare the first step's gradient accumulated over its micro-batches with one batch of the same "
               "examples (float64, the recipe's model and data), name what makes them differ; exit 1 when they "
               "differ beyond the dtype's tolerance; no training");
  app.add_flag("--report", c.report,
               "when the run ends (completed, stopped or failed), write report.html into its output folder: its "
               "charts and summary (tk-report)");
  app.add_option("--resume", c.resume,
                 "continue a run from a checkpoint folder, \"latest\" (of the recipe's output), or \"auto\" (the "
                 "newest checkpoint of the recipe's output when there is one, else start: right for a job's first "
                 "start and its restarts; a restart under torchrun or tk-run --max-restarts does this by itself); "
                 "with the same recipe, the result is bit-identical to an uninterrupted run")
      ->type_name("CKPT");
  app.add_flag("--overwrite", c.topts.overwrite,
               "start over in an output folder that holds another run, deleting that run's metrics, checkpoints, "
               "weights and plugin files (without it, such a run is refused)");
  app.add_option("--allow-change", c.topts.allow_changes,
                 "with --resume: let recipe KEY (or a whole section, or \"all\") differ from the checkpoint's "
                 "run (repeatable); any other difference is refused")
      ->type_name("KEY")
      ->allow_extra_args(false);
  app.add_option("--nproc", c.launch.nproc,
                 "train with N processes on this machine (needs a plugin that sums gradients across them, such as "
                 "ddp); "
                 "each worker's output is prefixed with its rank; one failing stops them all")
      ->type_name("N")
      ->check(CLI::Range(1, 4096));
  app.add_option("--nnodes", c.launch.nnodes,
                 "train on N machines, each running this command with its own --node-rank (and --nproc workers, "
                 "ranks node-rank x nproc ...); a failure on one stops them all")
      ->type_name("N")
      ->check(CLI::Range(1, 4096));
  app.add_option("--node-rank", c.launch.node_rank, "this machine's place among --nnodes, from 0")
      ->type_name("R")
      ->check(CLI::Range(0, 4095));
  app.add_option("--master-addr", c.launch.master_addr,
                 "the address of node 0, where the rendezvous runs (default 127.0.0.1)")
      ->type_name("HOST");
  app.add_option("--master-port", c.launch.master_port,
                 "rendezvous port (default with one node: a free one); with --nnodes the launchers also use the "
                 "port after it")
      ->type_name("PORT")
      ->check(CLI::Range(1, 65534));
  app.add_option("--max-restarts", c.launch.max_restarts,
                 "when a worker fails, start every worker again, up to N times (as torchrun's --max-restarts); each "
                 "restart resumes the run from its newest checkpoint (--resume auto); one node only")
      ->type_name("N")
      ->check(CLI::Range(0, 1000000));
  app.add_option("--log-level", c.level, "trace, debug, info (default), warn, error or off")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "off"}));
  app.add_option("--progress", c.progress, "auto (default: a live line on a terminal), bar, plain or none")
      ->check(CLI::IsMember({"auto", "bar", "plain", "none"}));
  app.add_flag("--list", c.list, "list the components and plugins found, with their options");
  app.add_flag("--version", c.version, "print versions and exit");
}

int die_usage(const std::string& msg) {
  std::fprintf(stderr, "tk-run: error: %s\nRun with --help for more information.\n", msg.c_str());
  return kExitUsage;
}

/// Which restart of its job this process is (TORCHELASTIC_RESTART_COUNT, or TK_RESTART_COUNT of
/// tk-run's own launcher): 0 for a first start.
int restart_count() {
  for (const char* name : {"TK_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"})
    if (const char* v = std::getenv(name); v && *v) return std::atoi(v);
  return 0;
}

/// The options that only make sense together, checked; "" when they do.
std::string check_combination(Cli& c) {
  if (c.recipe_path.empty()) return "no recipe given";
  // What trains nothing takes no option of a run that trains: each would be ignored.
  for (const auto& [given, name] : {std::pair{c.verify, "--verify-accumulation"}, std::pair{c.dry_run, "--dry-run"}}) {
    if (!given) continue;
    for (const auto& [other, what] : {std::pair{c.verify && c.dry_run, "--dry-run"}, std::pair{c.report, "--report"},
                                      std::pair{c.topts.overwrite, "--overwrite"},
                                      std::pair{c.verify && !c.resume.empty(), "--resume"}})
      if (other) return std::string(name) + " trains nothing: " + what + " would be ignored";
  }
  // A restart of the job (torchrun's, or tk-run --max-restarts') continues what the first start wrote.
  if (const int restart = restart_count(); restart > 0 && (c.resume.empty() || c.resume == "latest")) {
    c.topts.overwrite = false;  // it applied to the first start; this one continues it
    c.resume = "auto";
  } else if (restart > 0 && c.resume != "auto") {
    std::fprintf(stderr, "tk-run: warning: restart %d resumes %s again, as given; --resume auto continues from the "
                 "run's newest checkpoint\n", restart, c.resume.c_str());
  }
  if (!c.resume.empty()) c.topts.resume = c.resume;
  c.topts.join_world = !c.dry_run;  // a dry run plans alone (under --nproc, rank 0 alone is started)
  if (!c.topts.allow_changes.empty() && c.resume.empty()) return "--allow-change needs --resume";
  if (c.topts.overwrite && !c.resume.empty()) return "--overwrite starts a run over; it cannot go with --resume";
  if ((c.launch.nproc > 1 || c.launch.nnodes > 1 || c.launch.max_restarts > 0) && c.worker)
    return "--nproc, --nnodes or --max-restarts inside a worker";
  if (c.launch.max_restarts > 0 && c.launch.nnodes > 1)
    return "--max-restarts restarts the workers of one node; across nodes, launch with torchrun --max-restarts";
  if (c.launch.node_rank >= c.launch.nnodes)
    return "--node-rank " + std::to_string(c.launch.node_rank) + " is outside --nnodes " +
           std::to_string(c.launch.nnodes) + " (node ranks go from 0 to " + std::to_string(c.launch.nnodes - 1) + ")";
  if (c.launch.nnodes > 1 && c.launch.master_port == 0)
    return "--nnodes " + std::to_string(c.launch.nnodes) + " needs --master-port (the same on every node)";
  c.topts.progress = c.progress == "bar"     ? tk::ProgressMode::Bar
                     : c.progress == "plain" ? tk::ProgressMode::Plain
                     : c.progress == "none"  ? tk::ProgressMode::None
                                             : tk::ProgressMode::Auto;
  return "";
}

void set_up_log(const Cli& c) {
  auto logger = spdlog::stderr_color_mt("tk");
  const char* rank = std::getenv("RANK");
  const char* world = std::getenv("WORLD_SIZE");
  if (rank && world && std::strcmp(world, "1") != 0 && !c.dry_run && !c.worker)
    logger->set_pattern(std::string("[%H:%M:%S] [rank ") + rank + "] [%^%l%$] %v");
  else
    logger->set_pattern("[%H:%M:%S] [%^%l%$] %v");
  spdlog::set_default_logger(logger);
  spdlog::set_level(spdlog::level::from_str(c.level));
  // LibTorch's own warnings in the run's log, one line each.
  static tk::compat::WarningForwarder torch_warnings([](const std::string& msg) { spdlog::warn("LibTorch: {}", msg); });
  torch_warnings.install();
}

int print_dry_run(const std::string& plan) {
  std::printf("%s", plan.c_str());
  std::printf("dry run: the recipe is valid and every plugin loaded; nothing was trained\n");
  return 0;
}

/// --nproc N: a plugin of the recipe must sum the gradients across the world (each worker would
/// otherwise train its own run), learnt from the plugins alone; then the workers (for a dry run,
/// rank 0 of that world prints its plan).
int launch(int argc, char** argv, Cli& c, const tk::Recipe& recipe) {
  tk::machine_memory_bytes();  // a bad TK_MACHINE_MEMORY refused once, before any worker starts
  const auto caps = tk::plugin_capabilities(recipe, c.topts);
  if (c.launch.nproc * c.launch.nnodes > 1 && !caps.count(tk::cap::kGradsSynced.name())) {
    // The recipe's fault, not the command line's.
    const int copies = c.launch.nproc * c.launch.nnodes;
    const std::string flags = "--nproc " + std::to_string(c.launch.nproc) +
                              (c.launch.nnodes > 1 ? " --nnodes " + std::to_string(c.launch.nnodes) : "");
    std::fprintf(stderr, "tk-run%s%s: %s needs a plugin that sums the gradients across the processes (%s), "
                 "such as ddp: add [[plugins]] name = \"ddp\" to the recipe; this one would train %d independent "
                 "copies of the run\n", tk::kErrorMark, recipe.source().c_str(), flags.c_str(), tk::cap::kGradsSynced.name().c_str(), copies);
    return kExitUsage;
  }
  // The launchers of several nodes wait for one another as long as the ranks would.
  c.launch.node_timeout_s = tk::rendezvous_timeout_s(recipe);
  setenv("TK_WORKER", "1", 1);
  std::vector<std::string> worker_argv = {argv[0]};
  for (auto& a : args_without(argc, argv, kLaunchOptions, {})) worker_argv.push_back(a);
  if (c.dry_run) c.launch.only_rank = 0;
  try {
    return tk::launch_workers(worker_argv, c.launch);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tk-run: cannot start the workers: %s\n", e.what());
    return kExitFailed;
  }
}

/// What a failure of this process is, for its exit code and its launcher's record: "refused"
/// (exit 2: the same command would be refused again; a recipe's or a resume's refusal, and anything
/// before training but a timeout), "timeout" (a collective's or the rendezvous's: a peer gone
/// quiet; exit 1, a restart may get through) or "error" (exit 1).
std::string failure_kind(const std::exception& e) {
  if (dynamic_cast<const tk::RunRefused*>(&e) || (!g_fitting && dynamic_cast<const tk::RecipeError*>(&e)))
    return "refused";
  if (is_timeout(e.what())) return "timeout";
  return g_fitting ? "error" : "refused";
}

/// A worker under --nproc records the moment and the kind of its failure for the launcher (the
/// kind says its exit code while it is still on its way out).
void record_failures_for_launcher(tk::TrainerOptions& topts) {
  const char* dir = std::getenv("TK_FAILURE_DIR");
  if (!dir) return;
  const char* rank = std::getenv("RANK");
  const std::string file = std::string(dir) + "/" + (rank ? rank : "0");
  topts.on_failure = [file] {
    std::string kind = "error";
    if (auto current = std::current_exception()) {
      try {
        std::rethrow_exception(current);
      } catch (const std::exception& e) {
        kind = failure_kind(e);
      } catch (...) {
      }
    }
    // For tests (TK_FAULT=refused-linger, a job's first start only): a refusing rank 0 that does
    // not get out before the launcher stops it, its peers refusing after it.
    const char* fault = std::getenv("TK_FAULT");
    const bool linger =
        kind == "refused" && fault && std::strcmp(fault, "refused-linger") == 0 && restart_count() == 0;
    const std::string first = file.substr(0, file.rfind('/') + 1) + "0";
    if (linger && file != first)
      for (int i = 0; i < 100 && !std::filesystem::exists(first); ++i) usleep(100000);
    tk::record_failure(file, kind);
    if (linger && file == first) pause();
  };
}

/// The launch options of a worker's world, for the command that continues its run ("" outside
/// a launch): --nproc, and with several nodes the node options, this node's.
std::string same_world(const Cli& c) {
  const char* world = std::getenv("WORLD_SIZE");
  if (!c.worker || !world || std::strcmp(world, "1") == 0) return "";
  const char* per_node = std::getenv("LOCAL_WORLD_SIZE");
  const char* nodes = std::getenv("GROUP_WORLD_SIZE");
  if (!per_node || !nodes || std::strcmp(nodes, "1") == 0) return std::string(" --nproc ") + world;
  return std::string(" --nnodes ") + nodes + " --node-rank " + std::getenv("GROUP_RANK") + " --master-addr " +
         shell_quote(std::getenv("MASTER_ADDR")) + " --master-port " + std::getenv("MASTER_PORT") + " --nproc " +
         per_node;
}

/// What a finished run prints: its summary, the files it wrote, how to continue a stopped one.
int report_fit(int argc, char** argv, const Cli& c, const tk::Trainer& trainer, const tk::FitResult& r) {
  const std::string files = r.files.empty() ? "" : tk::join(r.files.data(), r.files.data() + r.files.size(), ",");
  if (r.already_complete) {
    // A rank but 0 writes no outputs: its folder is rank 0's.
    const std::string where = r.output_dir.empty() ? "" : " in " + r.output_dir.string();
    std::printf("the run%s is already complete (step %lld, checkpoint %s); nothing was trained\n", where.c_str(),
                static_cast<long long>(r.steps), r.checkpoint.c_str());
    if (!files.empty()) std::printf("wrote again what was missing: %s/{%s}\n", r.output_dir.c_str(), files.c_str());
    if (c.report) write_report(trainer);
    return 0;
  }
  // What this process trained, in the time it took; a resumed run says from where.
  const long long steps = r.steps - r.resumed_at_step, micro = r.micro_steps - r.resumed_at_micro_step;
  std::printf("trained %lld optimizer step%s (%lld micro-batch%s) in %s", steps, steps == 1 ? "" : "s", micro,
              micro == 1 ? "" : "es", tk::format_duration(r.seconds).c_str());
  if (r.resumed_at_step > 0 && r.steps > r.resumed_at_step)
    std::printf(", steps %lld to %lld of the run", static_cast<long long>(r.resumed_at_step + 1),
                static_cast<long long>(r.steps));
  if (!r.window_losses.empty()) std::printf("; loss %.4f -> %.4f", r.window_losses.front(), r.window_losses.back());
  if (!r.validation_losses.empty()) std::printf("; validation loss %.4f", r.validation_losses.back());
  if (const long long skipped = r.skipped_steps - r.resumed_skipped_steps; skipped > 0)
    std::printf("; %lld step%s skipped", skipped, skipped == 1 ? "" : "s");
  std::printf("; peak resident memory %.0f MiB (the process)\n", r.peak_rss_mib);
  if (!r.output_dir.empty() && !files.empty()) std::printf("wrote %s/{%s}\n", r.output_dir.c_str(), files.c_str());
  if (c.report) write_report(trainer);
  if (r.stopped.empty()) return 0;
  // The command that continues this very run: the same recipe, overrides and world.
  std::string cmd = shell_quote(argv[0]);
  std::vector<std::string> drop = kLaunchOptions;
  drop.push_back("--resume");
  for (const auto& a : args_without(argc, argv, drop, {"--overwrite"})) cmd += " " + shell_quote(a);
  cmd += same_world(c);
  // Rank 0 wrote the checkpoint; the other ranks have none to name.
  const std::string where = r.checkpoint.empty() ? std::string() : "; checkpoint " + r.checkpoint.string();
  std::printf("stopped early (%s) after step %lld%s; continue with: %s --resume latest\n",
              r.stopped == "signal" ? "signal" : "max_time", static_cast<long long>(r.steps), where.c_str(),
              cmd.c_str());
  // A rank the world stopped for another rank's signal ends well: the launcher tells the stop by that rank.
  return r.stopped == "signal" && g_stop_signal ? 128 + static_cast<int>(g_stop_signal) : 0;
}

/// Rank 0 under tk-run --nproc tells its launcher where status.json is: the launcher puts there the
/// cause of a failure no rank could record (a rank killed outright).
void tell_launcher_the_output(const tk::Trainer& trainer) {
  const char* dir = std::getenv("TK_FAILURE_DIR");
  if (!dir || tk::launch_rank() != 0 || trainer.output_dir().empty()) return;
  std::error_code ec;
  std::ofstream(std::string(dir) + "/output") << std::filesystem::absolute(trainer.output_dir(), ec).string() << "\n";
}

/// A refusal that a stop signal caused (the wait for the other ranks given up): said as a stop, and
/// out at once, since the rendezvous's thread may still be waiting and nothing was written to keep.
[[noreturn]] void exit_stopped(const std::exception& e) {
  std::fprintf(stderr, "tk-run: %s (signal %d)\n", e.what(), static_cast<int>(g_stop_signal));
  std::fflush(nullptr);
  std::_Exit(128 + static_cast<int>(g_stop_signal));
}

/// This process trains (or verifies, or plans) the run.
int train(int argc, char** argv, Cli& c, tk::Recipe recipe) {
  record_failures_for_launcher(c.topts);
  c.topts.stop_requested = [] { return g_stop_signal != 0; };
  std::unique_ptr<tk::Trainer> trainer;
  try {
    trainer = std::make_unique<tk::Trainer>(std::move(recipe), c.topts);
    if (c.verify) return print_accumulation_check(trainer->verify_accumulation());
    const std::string plan = trainer->describe();
    if (c.dry_run) return print_dry_run(plan);
    // Rank 0's alone: every rank's is the same run (a launch of 4 printed it 4 times).
    if (tk::launch_rank() == 0) spdlog::info("plan:\n{}", plan);
    tell_launcher_the_output(*trainer);
  } catch (const std::exception& e) {
    if (g_stop_signal && dynamic_cast<const tk::RunRefused*>(&e)) exit_stopped(e);
    print_error(e.what());
    return failure_kind(e) == "refused" ? kExitUsage : kExitFailed;  // a timed-out rendezvous may pass again
  }
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGUSR1}) std::signal(sig, on_stop_signal);
  g_fitting = true;
  try {
    return report_fit(argc, argv, c, *trainer, trainer->fit());
  } catch (const std::exception& e) {
    if (failure_kind(e) == "refused") {  // a resume's refusal: nothing was trained, nothing changed
      // A stop while the world was still meeting (a job stopped as it starts) is a stop, not an error.
      if (g_stop_signal) exit_stopped(e);
      print_error(e.what());
      return kExitUsage;
    }
    spdlog::error("{}", e.what());
    std::error_code ec;
    const std::filesystem::path out = trainer->output_dir();
    if (!out.empty() && std::filesystem::exists(out / "status.json", ec))
      std::fprintf(stderr, "tk-run: the run failed; what it wrote so far is kept in %s\n", out.c_str());
    else
      std::fprintf(stderr, "tk-run: the run failed before it wrote anything\n");
    if (c.report) write_report(*trainer);
    return kExitFailed;
  }
}

}  // namespace

int main(int argc, char** argv) {
  // A rank of a launch (tk-run --nproc's worker, torchrun's, even of one process): its launcher
  // passes a stop on, so a second one is no reason to stop at once.
  g_repeat_stops_now = !std::getenv("TK_WORKER") && !std::getenv("WORLD_SIZE") && !std::getenv("TORCHELASTIC_RUN_ID");
  // Slurm's warning may come while the run is still being set up: it stops at the first boundary.
  std::signal(SIGUSR1, on_stop_signal);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) std::signal(sig, on_early_stop);
  const sigset_t stops = stop_signals();
  sigprocmask(SIG_UNBLOCK, &stops, nullptr);  // one held across the exec below comes now
  prefer_passive_openmp(argv);
  keep_freed_memory();
  // Past a file-size limit (ulimit -f) a write fails with EFBIG, which the run reports like a full
  // disk (exit 1, the file named, status.json "failed"), instead of the process being killed.
  std::signal(SIGXFSZ, SIG_IGN);
  CLI::App app{"Trains the run a TOML recipe describes and writes it to the recipe's output folder.", "tk-run"};
  Cli c;
  add_options(app, c);
  if (const auto rc = tk::parse_command_line(app, argc, argv, "tk-run")) return *rc;
  if (c.version) {
    std::printf("tk-run %s (LibTorch %s, plugin ABI %u)\n", TK_VERSION_STRING, TORCH_VERSION, TK_PLUGIN_ABI_VERSION);
    return 0;
  }
  if (c.list) return list_all();
  if (const std::string wrong = check_combination(c); !wrong.empty()) return die_usage(wrong);
  set_up_log(c);
  std::optional<tk::Recipe> recipe;
  try {
    recipe.emplace(tk::Recipe::from_file(c.recipe_path));
    for (const auto& o : c.overrides) recipe->apply_override(o);
    if (c.launch.nproc > 1 || c.launch.nnodes > 1 || c.launch.max_restarts > 0) return launch(argc, argv, c, *recipe);
  } catch (const std::exception& e) {
    print_error(e.what());
    return kExitUsage;
  }
  return train(argc, argv, c, std::move(*recipe));
}
