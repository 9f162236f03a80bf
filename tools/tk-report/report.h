// tk-report: one self-contained HTML page that shows runs from their output folders.
//
// It reads what a run leaves behind (metrics.jsonl, recipe.toml, status.json) and nothing else:
// the training core does not know it exists. Runs still being written, runs that failed and
// folders with some files missing are all shown for what they are.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace tk::report {

/// A run folder that cannot be shown at all (it does not exist, or holds no run).
struct NotARun : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// An output file the report may not be written to: it exists and is not a report (a run's own
/// file, anything else a person keeps), or it is not a regular file (a folder, a device, a link).
struct NotReplaceable : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// The marker every page carries near its top; an existing file is a report, which may be
/// replaced, when its first 4 KiB hold it (or, for pages written before the marker, the title
/// "<title>trainkit report</title>").
inline constexpr const char* kReportMarker = "<meta name=\"generator\" content=\"tk-report\">";

struct Written {
  std::filesystem::path file;
  /// What was skipped while reading, each with its file and line ("runs/a/metrics.jsonl:17: ...").
  std::vector<std::string> warnings;
};

/// The report page of `runs` (run output folders) as HTML text; `warnings` gets what was skipped.
std::string render(const std::vector<std::filesystem::path>& runs, std::vector<std::string>& warnings);

/// Writes the report of `runs` to `out` (replaced atomically: a reader never sees half a page).
/// Refuses (NotReplaceable) an `out` that exists and is not a report, or is no regular file.
Written write(const std::vector<std::filesystem::path>& runs, const std::filesystem::path& out);

}  // namespace tk::report
