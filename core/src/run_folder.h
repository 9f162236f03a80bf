#pragma once
// What of an output folder is trainkit's: files.json, the record of every file the core and the
// plugins wrote there, and the survey that tells a run's own files from anything else a person
// keeps in the folder. Not installed.
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace tk::detail {

/// files.json: the core's files of the run (recipe.toml, metrics.jsonl, ..., checkpoints) and each
/// plugin's (a plugin that wrote none has an empty list). Each file is recorded before it is
/// written, so no file of trainkit's is ever unlisted.
struct Manifest {
  std::vector<std::string> core;
  std::map<std::string, std::vector<std::string>> plugins;
  bool lists_core = true;  ///< false for a files.json that records the plugins' files only
};

/// The name of the record.
inline constexpr const char* kManifestFile = "files.json";

/// files.json of `dir`, nullopt when there is none. Only names that may be trainkit's are kept (a
/// damaged or hand-edited list can never name a folder, a link or anything outside `dir`);
/// `damaged` says why when something was dropped or it cannot be read.
std::optional<Manifest> read_manifest(const std::filesystem::path& dir, std::string* damaged = nullptr);
/// Replaces files.json of `dir` atomically.
void write_manifest(const std::filesystem::path& dir, const Manifest& m);

/// Why `file` cannot be a plugin's file name (a folder, a hidden name, a core file's), or "".
std::string bad_plugin_file_name(const std::string& file);

/// What an output folder holds, sorted out before a new run claims it.
struct FolderSurvey {
  std::vector<std::string> run;      ///< the files of a run of trainkit's that are there (for messages)
  std::vector<std::string> foreign;  ///< files at the names trainkit writes that it did not write
  std::vector<std::filesystem::path> deletable;  ///< what --overwrite deletes: the run's files, files.json last
};

/// Surveys `dir`: a file at one of the names trainkit writes is the run's when files.json lists it
/// (or, in a folder written before files.json existed, when the folder carries trainkit's marks: a
/// resolved recipe.toml, a status.json); checkpoints/ holds the run's step-<N> folders and
/// `latest`, and anything else there is foreign. A report.html is the run's when it is a report.
FolderSurvey survey_folder(const std::filesystem::path& dir);

}  // namespace tk::detail
