// tk-run: trains what a recipe describes.
//
//   tk-run recipe.toml [--set key=value]... [--dry-run] [--log-level LEVEL] [--progress MODE]
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <tk/abi.h>
#include <tk/trainer.h>

#include "launch.h"

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

namespace {

volatile std::sig_atomic_t g_stop_signal = 0;

/// First SIGINT/SIGTERM: stop at the next boundary with a checkpoint. Second: stop now.
void on_stop_signal(int sig) {
  if (g_stop_signal) {
    std::signal(sig, SIG_DFL);
    std::raise(sig);
  }
  g_stop_signal = sig;
}

constexpr int kExitFailed = 1;  // the run started and failed
constexpr int kExitUsage = 2;   // bad command line, recipe or plugin: nothing was trained

const char* kUsage = R"(usage: tk-run RECIPE.toml [options]

Trains the run a TOML recipe describes and writes it to the recipe's output folder.

options:
  --set KEY=VALUE     override a recipe value (repeatable), e.g. --set optimizer.lr=0.01,
                      --set plugins.grad_accum.steps=8; VALUE is TOML (strings may be bare)
  --dry-run           validate the recipe, load the plugins, print the resolved plan; no training
  --resume CKPT       continue a run from a checkpoint folder, or "latest" (of the recipe's output);
                      with the same recipe, the result is bit-identical to an uninterrupted run
  --nproc N           train with N processes on this machine (needs the ddp plugin in the recipe);
                      each worker's output is prefixed with its rank; one failing stops them all
  --master-port PORT  rendezvous port for --nproc (default: a free one)
  --log-level LEVEL   trace, debug, info (default), warn, error or off
  --progress MODE     auto (default: a live line on a terminal), bar, plain or none
  --list              list built-in components and the plugins found, with their options
  --version           print versions and exit
  -h, --help          this help
)";

void print_specs(const tk::OptionSpecs& specs) {
  for (const auto& s : specs) {
    std::printf("      %-20s %-18s default %s\n", s.name.c_str(), tk::to_string(s.type),
                tk::to_toml(s.default_value).c_str());
    std::printf("      %-20s %s\n", "", s.doc.c_str());
    if (!s.choices.empty())
      std::printf("      %-20s one of: %s\n", "", tk::join(s.choices.data(), s.choices.data() + s.choices.size()).c_str());
  }
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
    try {
      print_specs(registry.make_plugin(c.name)->option_specs());
    } catch (const std::exception& e) {
      std::printf("      cannot make it: %s\n", e.what());
    }
  }
  for (const auto& b : broken) std::printf("  %s\n", b.c_str());
  return 0;
}

}  // namespace

/// OpenMP worker threads that spin after each parallel region fight OpenBLAS's own threads for the
/// cores: measured on 2 cores, a GPT step took 10x longer under LibTorch 2.6 and a CNN step 1.4x
/// under 1.13 (docs/benchmarks.md). libgomp reads OMP_WAIT_POLICY when it is loaded, before main,
/// so tk-run sets it to PASSIVE and runs itself again, once; a value the user set is kept.
static void prefer_passive_openmp(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
  execv("/proc/self/exe", argv);  // returns only on failure: then run with what we have
}

int main(int argc, char** argv) {
  prefer_passive_openmp(argv);
  std::string recipe_path;
  std::vector<std::string> overrides;
  bool dry_run = false;
  std::string level = "info";
  tk::TrainerOptions topts;
  tk::LaunchOptions launch;
  std::vector<std::string> worker_argv = {argv[0]};

  auto die_usage = [](const std::string& msg) {
    std::fprintf(stderr, "tk-run: %s\n\n%s", msg.c_str(), kUsage);
    return kExitUsage;
  };
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](const char* flag) -> const char* {
      if (i + 1 >= argc) return nullptr;
      (void)flag;
      ++i;
      if (std::strcmp(flag, "--nproc") != 0 && std::strcmp(flag, "--master-port") != 0) worker_argv.push_back(argv[i]);
      return argv[i];
    };
    if (a == "--nproc" || a == "--master-port") {
      const char* v = value(a.c_str());
      char* end = nullptr;
      long x = v ? std::strtol(v, &end, 10) : 0;
      if (!v || *end != '\0' || x < 1 || x > 65535) return die_usage(a + " expects a positive number");
      (a == "--nproc" ? launch.nproc : launch.master_port) = static_cast<int>(x);
      continue;
    }
    worker_argv.push_back(a);
    if (a == "-h" || a == "--help") {
      std::printf("%s", kUsage);
      return 0;
    } else if (a == "--version") {
      std::printf("tk-run %s (LibTorch %s, plugin ABI %u)\n", TK_VERSION_STRING, TORCH_VERSION, TK_PLUGIN_ABI_VERSION);
      return 0;
    } else if (a == "--list") {
      return list_all();
    } else if (a == "--dry-run") {
      dry_run = true;
    } else if (a == "--resume") {
      const char* v = value("--resume");
      if (!v) return die_usage("--resume needs a checkpoint folder or \"latest\"");
      topts.resume = v;
    } else if (a == "--set" || a.rfind("--set=", 0) == 0) {
      const char* v = a == "--set" ? value("--set") : argv[i] + 6;
      if (!v) return die_usage("--set needs KEY=VALUE");
      overrides.emplace_back(v);
    } else if (a == "--log-level") {
      const char* v = value("--log-level");
      if (!v) return die_usage("--log-level needs a level");
      level = v;
    } else if (a == "--progress") {
      const char* v = value("--progress");
      std::string m = v ? v : "";
      if (m == "auto") topts.progress = tk::ProgressMode::Auto;
      else if (m == "bar") topts.progress = tk::ProgressMode::Bar;
      else if (m == "plain") topts.progress = tk::ProgressMode::Plain;
      else if (m == "none") topts.progress = tk::ProgressMode::None;
      else return die_usage("--progress expects auto, bar, plain or none, got '" + m + "'");
    } else if (!a.empty() && a[0] == '-') {
      return die_usage("unknown option '" + a + "'");
    } else if (recipe_path.empty()) {
      recipe_path = a;
    } else {
      return die_usage("more than one recipe given ('" + recipe_path + "' and '" + a + "')");
    }
  }
  if (recipe_path.empty()) return die_usage("no recipe given");
  if (launch.nproc > 1 && std::getenv("TK_WORKER")) return die_usage("--nproc inside a worker");
  if (launch.nproc > 1 && !dry_run) {
    setenv("TK_WORKER", "1", 1);
    try {
      return tk::launch_local(worker_argv, launch);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "tk-run: cannot start the workers: %s\n", e.what());
      return kExitFailed;
    }
  }
  if (launch.nproc > 1) {  // a dry run shows the plan of rank 0 of that world
    setenv("WORLD_SIZE", std::to_string(launch.nproc).c_str(), 1);
    setenv("RANK", "0", 1);
  }

  auto logger = spdlog::stderr_color_mt("tk");
  const char* rank = std::getenv("RANK");
  const char* world = std::getenv("WORLD_SIZE");
  if (rank && world && std::strcmp(world, "1") != 0 && !dry_run && !std::getenv("TK_WORKER"))
    logger->set_pattern(std::string("[%H:%M:%S] [rank ") + rank + "] [%^%l%$] %v");
  else
    logger->set_pattern("[%H:%M:%S] [%^%l%$] %v");
  spdlog::set_default_logger(logger);
  auto lvl = spdlog::level::from_str(level);
  if (lvl == spdlog::level::off && level != "off")
    return die_usage("--log-level expects trace, debug, info, warn, error or off, got '" + level + "'");
  spdlog::set_level(lvl);

  std::unique_ptr<tk::Trainer> trainer;
  try {
    auto recipe = std::make_unique<tk::Recipe>(tk::Recipe::from_file(recipe_path));
    for (const auto& o : overrides) recipe->apply_override(o);
    if (const char* dir = std::getenv("TK_FAILURE_DIR")) {
      const std::string file = std::string(dir) + "/" + (std::getenv("RANK") ? std::getenv("RANK") : "0");
      topts.on_failure = [file] { tk::record_failure_time(file); };
    }
    topts.stop_requested = [] { return g_stop_signal != 0; };
    trainer = std::make_unique<tk::Trainer>(*recipe, topts);
    const std::string plan = trainer->describe();
    if (dry_run) {
      std::printf("%s", plan.c_str());
      std::printf("dry run: the recipe is valid and every plugin loaded; nothing was trained\n");
      return 0;
    }
    spdlog::info("plan:\n{}", plan);
    std::signal(SIGINT, on_stop_signal);
    std::signal(SIGTERM, on_stop_signal);
    try {
      tk::FitResult r = trainer->fit();
      std::printf("trained %lld optimizer steps (%lld micro-batches) in %s", static_cast<long long>(r.steps),
                  static_cast<long long>(r.micro_steps), tk::format_duration(r.seconds).c_str());
      if (!r.window_losses.empty())
        std::printf("; loss %.4f -> %.4f", r.window_losses.front(), r.window_losses.back());
      if (!r.validation_losses.empty()) std::printf("; validation loss %.4f", r.validation_losses.back());
      if (r.skipped_steps) std::printf("; %lld steps skipped", static_cast<long long>(r.skipped_steps));
      std::printf("; peak memory %.0f MiB", r.peak_rss_mib);
      std::printf("\n");
      if (!r.output_dir.empty()) std::printf("wrote %s/{recipe.toml,metrics.jsonl,weights.pt}\n", r.output_dir.c_str());
      if (!r.stopped.empty()) {
        std::printf("stopped early (%s) after step %lld; checkpoint %s; continue with: tk-run %s --resume latest\n",
                    r.stopped == "signal" ? "signal" : "max_time", static_cast<long long>(r.steps),
                    r.checkpoint.c_str(), recipe_path.c_str());
        if (r.stopped == "signal") return 128 + static_cast<int>(g_stop_signal);
      }
    } catch (const std::exception& e) {
      spdlog::error("{}", e.what());
      std::fprintf(stderr, "tk-run: the run failed; what it wrote so far is kept in its output folder\n");
      return kExitFailed;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tk-run: error: %s\n", e.what());
    return kExitUsage;
  }
  return 0;
}
