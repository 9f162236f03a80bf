// What of an output folder is trainkit's (run_folder.h).
#include "support/support.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <regex>
#include <set>

#include "tk/output.h"

namespace fs = std::filesystem;

namespace tk::detail {
namespace {

/// The files the core writes into an output folder besides checkpoints/ (a plugin's file may not
/// take one's name).
const char* const kCoreNames[] = {"recipe.toml", "metrics.jsonl", "weights.pt", "weights.safetensors", "trace.jsonl",
                                  "status.json", "report.html"};
const std::set<std::string> kReserved = {"recipe.toml", "metrics.jsonl", "weights.pt", "weights.safetensors", "trace.jsonl", "status.json",
                                         "report.html", "checkpoints", kManifestFile, ".tk-lock"};

bool is_core_name(const std::string& name) {
  return name == "checkpoints" || std::find(std::begin(kCoreNames), std::end(kCoreNames), name) != std::end(kCoreNames);
}

/// The first `n` bytes of a file.
std::string head_of(const fs::path& file, size_t n) {
  std::ifstream in(file, std::ios::binary);
  std::string head(n, '\0');
  in.read(head.data(), static_cast<std::streamsize>(n));
  head.resize(static_cast<size_t>(in.gcount()));
  return head;
}

/// A folder a trainkit from before files.json wrote: its recipe.toml is a resolved one, or its
/// status.json is trainkit's.
bool written_before_manifest(const fs::path& dir) {
  if (head_of(dir / "recipe.toml", 64).rfind("# resolved from ", 0) == 0) return true;
  const auto s = nlohmann::json::parse(head_of(dir / "status.json", 4096), nullptr, false);
  return s.is_object() && s.contains("status") && s.contains("pid");
}

bool is_plain_file(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(fs::symlink_status(p, ec));
}

bool is_report(const fs::path& p) {
  const std::string head = head_of(p, 4096);
  return head.find("<meta name=\"generator\" content=\"tk-report\">") != std::string::npos ||
         head.find("<title>trainkit report</title>") != std::string::npos;
}

/// checkpoints/: the run's step folders and `latest`, and what else is there; whether it holds the
/// run's checkpoints.
bool survey_checkpoints(const fs::path& dir, bool trainkits, FolderSurvey& out) {
  std::error_code ec;
  const fs::path root = dir / "checkpoints";
  if (!fs::exists(fs::symlink_status(root, ec))) return false;
  if (!fs::is_directory(fs::symlink_status(root, ec))) {
    out.foreign.push_back("checkpoints (not a folder)");
    return false;
  }
  bool steps = false;
  static const std::regex step("step-[0-9]{8}(\\.tmp)?");
  static const std::regex probe(std::string("\\") + kProbePrefix + "[0-9]+-[0-9]+(\\.tmp)?");
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    const auto st = fs::symlink_status(e.path(), ec);
    const bool ours = trainkits && ((std::regex_match(name, step) && fs::is_directory(st)) ||
                                    ((name == "latest" || name == "latest.tmp" || std::regex_match(name, probe)) &&
                                     fs::is_regular_file(st)));
    if (!ours) {
      out.foreign.push_back("checkpoints/" + name);
      continue;
    }
    steps = steps || name.rfind("step-", 0) == 0;
    out.deletable.push_back(e.path());
  }
  return steps;
}

}  // namespace

std::string bad_plugin_file_name(const std::string& file) {
  if (file.empty() || file == "." || file == "..") return "is not a file name";
  if (file.find('/') != std::string::npos || file.find('\0') != std::string::npos)
    return "is not a plain file name (no folders: the file goes into the output folder)";
  if (file.front() == '.') return "starts with a dot (hidden names are the core's)";
  if (kReserved.count(file) || file.rfind("recipe.toml", 0) == 0) return "is one of the core's files";
  if (file.size() > 4 && file.compare(file.size() - 4, 4, ".tmp") == 0) return "ends with .tmp (the core's partial files)";
  return "";
}

std::optional<Manifest> read_manifest(const fs::path& dir, std::string* damaged) {
  std::ifstream in(dir / kManifestFile);
  if (!in) return std::nullopt;
  Manifest out;
  const auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  auto bad = [&](const std::string& why) {
    if (damaged && damaged->empty()) *damaged = (dir / kManifestFile).string() + ": " + why;
  };
  if (!j.is_object() || !j.contains("plugins") || !j["plugins"].is_object()) {
    bad("damaged (not a {\"core\": [...], \"plugins\": {...}} object)");
    return out;
  }
  out.lists_core = j.contains("core");
  if (out.lists_core && !j["core"].is_array()) bad("\"core\" is not a list");
  if (out.lists_core && j["core"].is_array()) {
    for (const auto& f : j["core"]) {
      if (f.is_string() && is_core_name(f.get<std::string>())) out.core.push_back(f.get<std::string>());
      else bad("an entry of \"core\" is not a file of the core's");
    }
  }
  for (const auto& [plugin, files] : j["plugins"].items()) {
    auto& list = out.plugins[plugin];
    if (!files.is_array()) {
      bad("the entry of plugin '" + plugin + "' is not a list");
      continue;
    }
    for (const auto& f : files)
      if (f.is_string() && bad_plugin_file_name(f.get<std::string>()).empty()) list.push_back(f.get<std::string>());
      else bad("an entry of plugin '" + plugin + "' is not a plugin's file name");
  }
  return out;
}

void write_manifest(const fs::path& dir, const Manifest& m) {
  nlohmann::ordered_json j;
  j["core"] = m.core;
  j["plugins"] = nlohmann::ordered_json::object();
  for (const auto& [p, list] : m.plugins) j["plugins"][p] = list;
  write_atomic(dir / kManifestFile, j.dump(1) + "\n");
}

FolderSurvey survey_folder(const fs::path& dir) {
  FolderSurvey out;
  std::error_code ec;
  const auto manifest = read_manifest(dir);
  const bool trainkits = manifest.has_value() || written_before_manifest(dir);
  auto listed = [&](const std::string& name) {
    if (!manifest || !manifest->lists_core) return trainkits;
    return std::find(manifest->core.begin(), manifest->core.end(), name) != manifest->core.end();
  };
  bool any = false;  // a run's records, weights or checkpoints are there
  for (const char* name : kCoreNames) {
    const fs::path p = dir / name;
    if (!fs::exists(fs::symlink_status(p, ec))) continue;
    const bool ours = is_plain_file(p) && (std::string(name) == "report.html" ? is_report(p) : listed(name));
    if (!ours) {
      out.foreign.push_back(name);
      continue;
    }
    out.deletable.push_back(p);
    const std::string n = name;
    if ((n == "metrics.jsonl" && fs::file_size(p, ec) > 0) || n == "weights.pt") {
      out.run.push_back(n);
      any = true;
    }
  }
  if (survey_checkpoints(dir, trainkits, out)) {
    out.run.push_back("checkpoints/");
    any = true;
  }
  if (manifest)
    for (const auto& [plugin, files] : manifest->plugins)
      for (const auto& f : files)
        if (is_plain_file(dir / f)) {
          out.deletable.push_back(dir / f);
          out.run.push_back(f);
          any = true;
        }
  if (!any) out.run.clear();
  if (trainkits && fs::exists(dir / kManifestFile)) out.deletable.push_back(dir / kManifestFile);  // last
  return out;
}

}  // namespace tk::detail
