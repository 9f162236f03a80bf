// tk-plugin: write, check and describe trainkit plugins.
//
//   tk-plugin new NAME [DIR]    scaffold a plugin project that builds and passes its tests
//   tk-plugin check LIB.so [--options TOML] [--neutral TOML|none] [--nproc N] [--verbose]
//                               run the plugin contract
//   tk-plugin info LIB.so       name, versions, ABI, options, contract, components
#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include "../cli_parse.h"
#include <tk/abi.h>
#include <tk/loader.h>
#include <tk/testing.h>

#include <filesystem>

#include <cstdio>
#include <iostream>

#include "launch.h"
#include "scaffold.h"

namespace {

std::string list(const std::vector<std::string>& v) { return v.empty() ? "(none)" : tk::join(v.data(), v.data() + v.size()); }
std::string list(const std::vector<tk::Capability>& caps) {
  std::vector<std::string> v;
  for (const auto& c : caps) v.push_back(c.name());
  return list(v);
}

void print_specs(const tk::OptionSpecs& specs) {
  if (specs.empty()) std::printf("    (no options)\n");
  for (const auto& s : specs) {
    std::printf("    %-22s %-18s default %s\n", s.name.c_str(), tk::to_string(s.type), tk::to_toml(s.default_value).c_str());
    std::printf("    %-22s %s\n", "", s.doc.c_str());
    if (!s.choices.empty()) std::printf("    %-22s one of: %s\n", "", list(s.choices).c_str());
  }
}

template <class Maker>
void print_components(const char* kind, const std::vector<tk::Component<Maker>>& list, const std::string& file) {
  for (const auto& c : list) {
    if (c.library != file) continue;
    std::printf("%s %s: %s\n", kind, c.name.c_str(), c.doc.c_str());
    print_specs(c.specs);
  }
}

int info(const std::string& file) {
  const tk::PluginLoader loader({});
  const tk::LibraryInfo li = loader.inspect(file);
  tk::Registry registry;
  loader.load(file, registry);
  const std::string key = std::filesystem::weakly_canonical(file).string();
  std::printf("library   %s %s (%s)\n", li.name.c_str(), li.version.c_str(), key.c_str());
  std::printf("built     trainkit %s, LibTorch %s, plugin ABI %u, layout 0x%llx\n", li.trainkit_version.c_str(),
              li.torch_version.c_str(), TK_PLUGIN_ABI_VERSION,
              static_cast<unsigned long long>(tk::abi::kLayoutSignature));
  for (const auto& c : registry.plugins()) {
    auto p = registry.make_plugin(c.name);
    const tk::Contract k = p->contract();
    std::printf("plugin %s%s\n", c.name.c_str(), c.doc.empty() ? "" : (": " + c.doc).c_str());
    print_specs(c.specs);
    std::printf("    provides   %s\n    after      %s\n    requires   %s\n    conflicts  %s\n", list(k.provides).c_str(),
                list(k.after).c_str(), list(k.requires_).c_str(), list(k.conflicts).c_str());
  }
  print_components("model", registry.models(), key);
  print_components("data", registry.data(), key);
  print_components("loss", registry.losses(), key);
  print_components("optimizer", registry.optimizers(), key);
  print_components("schedule", registry.schedules(), key);
  return 0;
}

/// --nproc N: the contract in a world of N processes on this machine, each checking the plugin as
/// one rank (tk-plugin check again, as torchrun's workers would run it).
int check_in_world(const std::string& file, const std::string& options, const std::string& neutral, int nproc,
                   bool verbose) {
  std::vector<std::string> worker = {"tk-plugin", "check", file};
  if (!options.empty()) worker.insert(worker.end(), {"--options", options});
  if (!neutral.empty()) worker.insert(worker.end(), {"--neutral", neutral});
  if (verbose) worker.emplace_back("--verbose");
  tk::LaunchOptions launch;
  launch.nproc = nproc;
  launch.stop_grace_s = 30.0;
  launch.program = "tk-plugin";
  return tk::launch_workers(worker, launch);
}

/// Refuses, in one line, a file that is no plugin library of this trainkit and options the plugin
/// refuses: the command line's mistakes, not checks failed (before any world is started).
void check_command_line(const std::string& file, const std::string& options, const std::string& neutral) {
  const tk::PluginLoader loader({});
  loader.load_plugin(file);
  for (const auto& [flag, toml] : {std::pair{"--options", options}, std::pair{"--neutral", neutral}}) {
    if (toml.empty() || toml == "none") continue;
    try {
      tk::testing::load_plugin(file, toml);
    } catch (const std::exception& e) {
      throw tk::Error(std::string(flag) + " '" + toml + "': " + e.what());
    }
  }
}

int check(const std::string& file, const std::string& options, const std::string& neutral) {
  tk::testing::ContractOptions c;
  c.options = options;
  c.neutral = neutral == "none" ? "" : neutral;
  c.check_neutral = neutral != "none";
  std::printf("plugin contract for %s\n", file.c_str());
  int passed = 0, failed = 0, skipped = 0;
  for (const auto& r : tk::testing::check_contract(file, c)) {
    const char* mark = r.skipped ? "SKIP" : r.passed ? "PASS" : "FAIL";
    std::printf("%s  %s%s\n", mark, r.name.c_str(), r.passed ? "" : (": " + r.detail).c_str());
    (r.skipped ? skipped : r.passed ? passed : failed) += 1;
  }
  std::printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
  return failed == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  // A line at a time: under a launcher (check --nproc) the output is a pipe, and a rank stopped
  // after another's failure keeps what it printed.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  CLI::App app{"tk-plugin: write, check and describe trainkit plugins"};
  app.require_subcommand(1);
  app.footer("The plugin guide (writing, building, testing and porting plugins): " + tk::plugin_guide());
  app.set_version_flag("--version", std::string("tk-plugin ") + TK_VERSION + " (LibTorch " + TORCH_VERSION + ")");

  std::string name, dir, file, options, neutral;
  int nproc = 1;
  bool verbose = false;
  auto* cmd_new = app.add_subcommand("new", "scaffold a plugin project: sources, a test, a recipe, a README");
  cmd_new->add_option("name", name, "the plugin's name (letters, digits, _)")->required();
  cmd_new->add_option("dir", dir, "the project folder (default: ./NAME)");
  auto* cmd_check = app.add_subcommand("check", "run the plugin contract against a library");
  cmd_check->add_option("library", file, "the plugin library (tk_NAME.so)")->required()->check(CLI::ExistingFile);
  cmd_check->add_option("--options", options, "options for the behavioural checks, as TOML");
  cmd_check->add_option("--neutral", neutral,
                        "options with which the plugin must leave a run bit-identical (TOML), or \"none\" for a "
                        "plugin that always changes the numerics");
  cmd_check->add_option("--nproc", nproc,
                        "check it in a world of N processes on this machine, as each of its ranks (for a plugin "
                        "that sums the gradients across the world, such as ddp); under torchrun, leave it out")
      ->check(CLI::Range(1, 64));
  cmd_check->add_flag("--verbose", verbose,
                      "print the log of the checks' runs (the plugin's own info lines among them); without it, "
                      "their warnings and errors only");
  auto* cmd_info = app.add_subcommand("info", "describe a library: versions, ABI, options, contract, components");
  cmd_info->add_option("library", file, "the plugin library (tk_NAME.so)")->required()->check(CLI::ExistingFile);
  if (const auto rc = tk::parse_command_line(app, argc, argv, "tk-plugin")) return *rc;

  try {
    if (*cmd_new) return tk::scaffold(name, dir.empty() ? name : dir);
    if (*cmd_check) {
      if (!verbose) spdlog::set_level(spdlog::level::warn);
      check_command_line(file, options, neutral);
      return nproc > 1 ? check_in_world(file, options, neutral, nproc, verbose) : check(file, options, neutral);
    }
    return info(file);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tk-plugin%s%s\n", tk::kErrorMark, e.what());
    return 2;
  }
}
