#pragma once
// How every trainkit tool parses its command line: a bad one gets the tool's name, the reason and a
// pointer to --help on stderr, and exit code 2 (--help and --version exit 0).
#include <CLI/CLI.hpp>

#include <cstdio>
#include <optional>

namespace tk {

/// Parses `argv` into `app`; nullopt when the tool goes on, else the exit code to return.
inline std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv, const char* tool) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    std::fprintf(stderr, "%s: error: %s\nRun with --help for more information.\n", tool, e.what());
    return 2;
  }
  return std::nullopt;
}

}  // namespace tk
