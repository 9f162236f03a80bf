// tk-report: one self-contained HTML page of one or more runs, their charts overlaid.
//
//   tk-report RUN_DIR [RUN_DIR ...] [-o report.html]
#include <CLI/CLI.hpp>

#include "../cli_parse.h"

#include <cstdio>

#include "report.h"

int main(int argc, char** argv) {
  CLI::App app{"Writes one HTML page (no network needed to open it) that shows runs from their output folders: "
               "loss, validation, learning rate, batch, gradient norm, loss scale, throughput and memory per "
               "step, overlaid across runs, with a summary and the differences between their recipes.",
               "tk-report"};
  std::vector<std::string> dirs;
  std::string out;
  app.add_option("runs", dirs, "run output folders (what tk-run wrote: metrics.jsonl, recipe.toml)")
      ->required()
      ->type_name("RUN_DIR");
  app.add_option("-o,--output", out, "the page to write (default: report.html in the run's folder for one run, "
                                     "else ./report.html)")
      ->type_name("FILE");
  if (const auto rc = tk::parse_command_line(app, argc, argv, "tk-report")) return *rc;
  std::vector<std::filesystem::path> runs(dirs.begin(), dirs.end());
  if (out.empty()) out = runs.size() == 1 ? (runs[0] / "report.html").string() : "report.html";
  try {
    const auto w = tk::report::write(runs, out);
    for (const auto& warning : w.warnings) std::fprintf(stderr, "tk-report: warning: %s\n", warning.c_str());
    std::printf("wrote %s (%zu run%s)\n", w.file.c_str(), runs.size(), runs.size() == 1 ? "" : "s");
  } catch (const tk::report::NotARun& e) {
    std::fprintf(stderr, "tk-report: error: %s\n", e.what());
    return 2;
  } catch (const tk::report::NotReplaceable& e) {
    std::fprintf(stderr, "tk-report: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tk-report: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
