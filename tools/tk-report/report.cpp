// The report: each run folder read into one JSON document, embedded with the page's script, its
// style and the charting library (all compiled in, see assets.cmake) into one HTML file.
#include "report.h"

#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <nlohmann/json.hpp>
#include <tk/output.h>
#include <toml++/toml.h>

#include <cmath>
#include <ctime>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>

#include "assets.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace tk::report {
namespace {

std::string read_text(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

/// Keys whose records are validations, not training steps.
bool is_validation_key(const std::string& key) { return key.rfind("validation_", 0) == 0; }

/// A record is a training step's when it has the step's own figures; the validation that closes a
/// run has a record with only `step` and its validation figures.
bool is_step_record(const json& r) { return r.contains("loss") || r.contains("lr") || r.contains("wall_time"); }

/// Column-wise tables: one array per key, null where a record lacks it; text values go to events.
struct Table {
  std::vector<std::string> keys;  // in the order they first appear
  std::map<std::string, std::vector<json>> columns;
  size_t rows = 0;

  void add(const json& record, const std::function<bool(const std::string&)>& take) {
    for (auto& [k, col] : columns) col.emplace_back(nullptr);
    ++rows;
    for (const auto& [k, v] : record.items()) {
      if (!take(k) || !(v.is_number() || v.is_boolean() || v.is_null())) continue;
      auto [it, fresh] = columns.try_emplace(k, std::vector<json>(rows, nullptr));
      if (fresh) keys.push_back(k);
      it->second.back() = v.is_boolean() ? json(v.get<bool>() ? 1 : 0) : v;
    }
  }
  json to_json() const {
    json out = json::object();
    for (const auto& k : keys) out[k] = columns.at(k);
    return out;
  }
};

/// metrics.jsonl as tables. A line that is not a JSON object with an integer `step` is skipped
/// with a warning, but for a last line without its newline: a record being written, or torn by a
/// kill, which is said once in the run's notes. A step at or before one already read means the
/// run went back (a resume): the records it replaced are dropped.
void read_metrics(const fs::path& file, json& run, std::vector<std::string>& warnings) {
  std::vector<json> records;
  run["steps"] = run["validation"] = json::object();
  run["events"] = json::array();
  std::error_code ec;
  if (!fs::exists(file, ec)) {
    run["notes"].push_back("no metrics.jsonl: no step has been recorded");
    return;
  }
  const std::string text = read_text(file);
  size_t pos = 0, line_no = 0;
  while (pos < text.size()) {
    const size_t end = text.find('\n', pos);
    const bool whole = end != std::string::npos;
    const std::string line = text.substr(pos, whole ? end - pos : std::string::npos);
    pos = whole ? end + 1 : text.size();
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json r = json::parse(line, nullptr, /*allow_exceptions=*/false);
    const bool ok = !r.is_discarded() && r.is_object() && r.contains("step") && r["step"].is_number_integer();
    if (!ok) {
      if (!whole) {
        run["notes"].push_back("the last line of metrics.jsonl is incomplete (being written, or cut by a kill): left out");
      } else {
        warnings.push_back(file.string() + ":" + std::to_string(line_no) +
                           ": not a metrics record (a JSON object with an integer \"step\"): skipped");
        run["skipped_lines"] = run.value("skipped_lines", 0) + 1;
      }
      continue;
    }
    const int64_t step = r["step"].get<int64_t>();
    while (!records.empty() && records.back()["step"].get<int64_t>() >= step &&
           (is_step_record(r) || records.back()["step"].get<int64_t>() > step))
      records.pop_back();
    records.push_back(std::move(r));
  }
  Table steps, validation;
  json events = json::array();
  for (const auto& r : records) {
    if (is_step_record(r)) steps.add(r, [](const std::string& k) { return !is_validation_key(k); });
    bool has_validation = false;
    for (const auto& [k, v] : r.items()) has_validation |= is_validation_key(k);
    if (has_validation)
      validation.add(r, [](const std::string& k) { return k == "step" || is_validation_key(k); });
    for (const auto& [k, v] : r.items())
      if (v.is_string()) events.push_back({{"step", r["step"]}, {"key", k}, {"text", v}});
  }
  run["steps"] = steps.to_json();
  run["validation"] = validation.to_json();
  run["events"] = std::move(events);
}

/// The resolved recipe as "section.key" -> value text, [[plugins]] by name ("plugins.clip.max_norm").
void flatten(const toml::table& table, const std::string& prefix, json& out) {
  for (const auto& [key, node] : table) {
    const std::string name = prefix + std::string(key.str());
    if (const auto* t = node.as_table()) {
      flatten(*t, name + ".", out);
    } else if (const auto* a = node.as_array(); a && a->is_array_of_tables()) {
      std::map<std::string, int> seen;
      for (const auto& item : *a) {
        const auto* t = item.as_table();
        std::string id = t ? t->at_path("name").value_or(std::string()) : std::string();
        if (id.empty()) id = std::to_string(seen.size());
        if (++seen[id] > 1) id += "#" + std::to_string(seen[id]);
        if (t) flatten(*t, name + "." + id + ".", out);
      }
    } else {
      std::ostringstream s;
      node.visit([&s](const auto& v) { s << v; });
      out[name] = s.str();
    }
  }
}

/// The PID holding a flock(2) on `file`, from /proc/locks (its device and inode); 0 when none
/// does; -1 when that cannot be known (no /proc).
long lock_holder(const fs::path& file) {
  struct stat st {};
  if (stat(file.c_str(), &st) != 0) return 0;
  char file_id[64];
  std::snprintf(file_id, sizeof file_id, "%02x:%02x:%llu", major(st.st_dev), minor(st.st_dev),
                static_cast<unsigned long long>(st.st_ino));
  std::ifstream locks("/proc/locks");
  if (!locks) return -1;
  for (std::string line; std::getline(locks, line);) {
    std::istringstream in(line);
    std::string id, kind, mode, access, dev;
    long pid = 0;
    if (!(in >> id >> kind)) continue;
    if (kind == "->") continue;  // a process waiting for the lock, not holding it
    if (!(in >> mode >> access >> pid >> dev) || kind != "FLOCK") continue;
    if (dev == file_id) return pid;
  }
  return 0;
}

/// Where the run stands: status.json as the run last wrote it, checked against the folder's lock
/// (a "running" run whose lock nobody holds was killed).
json read_status(const fs::path& dir, std::vector<std::string>& warnings) {
  json s = json::object();
  if (fs::exists(dir / "status.json")) {
    s = json::parse(read_text(dir / "status.json"), nullptr, false);
    if (s.is_discarded() || !s.is_object() || !s.contains("status") || !s["status"].is_string()) {
      warnings.push_back((dir / "status.json").string() + ": damaged (not a status tk-run writes); the run's state is "
                         "shown as unknown");
      s = {{"status", "unknown"}, {"detail", "status.json is damaged"}};
    }
  } else {
    // A folder written before runs recorded their status.
    s["status"] = fs::exists(dir / "weights.pt") ? "completed" : "unknown";
  }
  const long holder = lock_holder(dir / ".tk-lock");
  if (holder < 0) {
    if (s.value("status", "") == "running")
      s["detail"] = "whether its process is still alive is unknown here (no /proc/locks)";
  } else if (s.value("status", "") == "running" && holder == 0) {
    s["status"] = "interrupted";
    s["detail"] = "the process ended without recording how (killed, or the machine stopped); continue it with "
                  "--resume latest";
  } else if (holder > 0) {
    s["status"] = "running";
    s["pid"] = holder;
  }
  return s;
}

json read_run(const fs::path& dir, std::vector<std::string>& warnings) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw NotARun(dir.string() + ": no such folder");
  const bool has_metrics = fs::exists(dir / "metrics.jsonl"), has_recipe = fs::exists(dir / "recipe.toml");
  if (!has_metrics && !has_recipe)
    throw NotARun(dir.string() + ": not a run's output folder (it has neither metrics.jsonl nor recipe.toml)");
  json run = {{"path", dir.string()}, {"notes", json::array()}};
  run["status"] = read_status(dir, warnings);
  read_metrics(dir / "metrics.jsonl", run, warnings);
  run["recipe"] = json::object();
  if (has_recipe) {
    run["recipe_text"] = read_text(dir / "recipe.toml");
    try {
      flatten(toml::parse(run["recipe_text"].get<std::string>()), "", run["recipe"]);
    } catch (const toml::parse_error& e) {
      warnings.push_back((dir / "recipe.toml").string() + ":" + std::to_string(e.source().begin.line) + ": " +
                         std::string(e.description()) + ": its values are left out of the comparison");
    }
  } else {
    run["notes"].push_back("no recipe.toml");
  }
  return run;
}

/// Names for the runs: their folders' names, or more of their paths where those repeat.
void name_runs(json& runs) {
  auto folder = [](const json& r) {  // "runs/a/" is "runs/a"; "." is the folder's own name
    fs::path p = fs::absolute(fs::path(r["path"].get<std::string>())).lexically_normal();
    return p.filename().empty() ? p.parent_path() : p;
  };
  std::map<std::string, int> count;
  for (const auto& r : runs) ++count[folder(r).filename().string()];
  for (auto& r : runs) {
    std::string name = folder(r).filename().string();
    if (count[name] > 1 || name.empty()) name = r["path"].get<std::string>();
    r["name"] = name;
  }
}

/// `text` with `marker` replaced by `with` (once; the template has each marker once).
void fill(std::string& text, const std::string& marker, const std::string& with) {
  const auto at = text.find(marker);
  if (at == std::string::npos) throw std::logic_error("report template: no " + marker);
  text.replace(at, marker.size(), with);
}

}  // namespace

std::string render(const std::vector<fs::path>& dirs, std::vector<std::string>& warnings) {
  json doc = {{"runs", json::array()}, {"generated", static_cast<int64_t>(std::time(nullptr))}};
  for (const auto& d : dirs) doc["runs"].push_back(read_run(d, warnings));
  name_runs(doc["runs"]);
  doc["warnings"] = warnings;
  // Inside a <script> element the HTML parser looks for "</script" and "<!--": no "<" may reach
  // it. In JSON a "<" can only be inside a string, where "\u003c" is the same character.
  std::string data = doc.dump(-1, ' ', false, json::error_handler_t::replace);
  for (size_t at = 0; (at = data.find('<', at)) != std::string::npos; at += 6) data.replace(at, 1, "\\u003c");
  std::string page(assets::kPage);
  fill(page, "/*TK_STYLE*/", std::string(assets::kUplotCss) + "\n" + assets::kStyle);
  fill(page, "/*TK_UPLOT*/", assets::kUplotJs);
  fill(page, "/*TK_SCRIPT*/", assets::kScript);
  fill(page, "/*TK_DATA*/", data);
  return page;
}

namespace {

/// Refuses to write over what is not a report: a folder, a device, a link, or a file without the
/// report's marker (a run's metrics.jsonl, say).
void check_replaceable(const fs::path& out) {
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(out, ec);
  if (ec || !fs::exists(st)) {
    if (out.has_parent_path() && !fs::is_directory(out.parent_path(), ec))
      throw NotReplaceable(out.string() + ": its folder " + out.parent_path().string() + " does not exist");
    return;  // a new file
  }
  const std::string what = fs::is_directory(st) ? "a folder" : fs::is_symlink(st) ? "a link" : "not a regular file";
  if (!fs::is_regular_file(st))
    throw NotReplaceable(out.string() + ": is " + what + "; the report goes to a regular file of its own");
  std::ifstream in(out, std::ios::binary);
  std::string head(4096, '\0');
  in.read(head.data(), static_cast<std::streamsize>(head.size()));
  head.resize(static_cast<size_t>(in.gcount()));
  // Pages of tk-report before it wrote the marker carry its title.
  if (head.find(kReportMarker) == std::string::npos && head.find("<title>trainkit report</title>") == std::string::npos)
    throw NotReplaceable(out.string() + ": exists and is not a report of tk-report (its first 4 KiB have no " +
                         kReportMarker + "): it is not replaced; give -o a new file, or a report to replace");
}

}  // namespace

Written write(const std::vector<fs::path>& runs, const fs::path& out) {
  Written w{out, {}};
  const std::string page = render(runs, w.warnings);  // a run that is not one is said first
  check_replaceable(out);
  write_atomic(out, page);
  return w;
}

}  // namespace tk::report
