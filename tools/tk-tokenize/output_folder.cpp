// tk-tokenize's --out folder (output_folder.h).
#include "output_folder.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <system_error>

#include <nlohmann/json.hpp>

namespace fs = std::filesystem;

namespace tk::tokenize {
namespace {

std::string quoted_list(const std::vector<std::string>& names, size_t most = 5) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < most; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > most) out += ", and " + std::to_string(names.size() - most) + " more";
  return out;
}

/// Writes `text` to `file` through a temporary file and a rename: never half a file.
void write_whole(const fs::path& file, const std::string& text) {
  const fs::path tmp = file.string() + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  bool ok = f != nullptr && std::fwrite(text.data(), 1, text.size(), f) == text.size() && std::fflush(f) == 0;
  const int err = errno;
  if (f != nullptr && std::fclose(f) != 0) ok = false;
  std::error_code ec;
  if (!ok || (fs::rename(tmp, file, ec), ec)) {
    fs::remove(tmp, ec);
    throw Failure(file.string() + ": cannot write it: " + std::strerror(err));
  }
}

}  // namespace

Manifest read_manifest(const fs::path& dir) {
  Manifest m;
  std::ifstream in(dir / kManifest);
  if (!in) return m;
  m.present = true;
  const auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  const auto damaged = [&] {
    return Failure((dir / kManifest).string() + " is damaged (not {\"written_by\": \"tk-tokenize\", \"complete\": ..., "
                   "\"files\": [...]}): it lists the files of a tokenization; delete the folder and tokenize again");
  };
  if (!j.is_object() || j.value("written_by", "") != "tk-tokenize" || !j.contains("files") || !j["files"].is_array() ||
      !j.contains("complete") || !j["complete"].is_boolean())
    throw damaged();
  m.complete = j["complete"].get<bool>();
  for (const auto& f : j["files"]) {
    if (!f.is_string()) throw damaged();
    const std::string name = f.get<std::string>();
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == ".." || name == kManifest)
      throw damaged();
    m.files.insert(name);
  }
  return m;
}

std::string OutputFolder::prefix_error(const std::string& prefix) {
  if (prefix.find('/') != std::string::npos || prefix.find('\0') != std::string::npos)
    return "holds a '/': it starts the shards' file names inside --out, it is no path";
  if (!prefix.empty() && prefix.front() == '.') return "starts with a dot: the shards would be hidden files";
  return "";
}

OutputFolder::OutputFolder(fs::path dir) : dir_(std::move(dir)) {
  std::error_code ec;
  const auto st = fs::status(dir_, ec);
  if (fs::exists(st) && !fs::is_directory(st)) throw Failure("--out " + dir_.string() + " is not a folder");
  if (!fs::exists(st)) {
    made_ = dir_;
    for (fs::path up = dir_.parent_path(); !up.empty() && !fs::exists(up, ec); up = up.parent_path()) made_ = up;
    fs::create_directories(dir_, ec);
    if (ec) throw Failure("--out " + dir_.string() + ": cannot create it: " + ec.message());
  }
  const Manifest m = read_manifest(dir_);
  listed_ = m.files;
  complete_ = !m.present || m.complete;
  std::vector<std::string> foreign;
  for (const auto& e : fs::directory_iterator(dir_, ec)) {
    const std::string name = e.path().filename().string();
    const bool ours = m.present && (name == kManifest || name == std::string(kManifest) + ".tmp" || listed_.count(name));
    if (!ours || !fs::is_regular_file(e.symlink_status(ec))) foreign.push_back(name);
  }
  if (ec) throw Failure("--out " + dir_.string() + ": cannot list it: " + ec.message());
  std::sort(foreign.begin(), foreign.end());
  if (!foreign.empty())
    throw Failure("--out " + dir_.string() + " holds files tk-tokenize did not write (" + quoted_list(foreign) +
                  "): it never writes over them nor deletes them; give --out a new or empty folder, or one that "
                  "an earlier tk-tokenize wrote (its " + kManifest + " lists its files)");
}

OutputFolder::~OutputFolder() {
  if (committed_) return;
  std::error_code ec;
  bool dropped = false;
  for (auto it = listed_.begin(); it != listed_.end();) {
    const std::string& name = *it;
    if (!is_temporary(name)) {
      ++it;
      continue;
    }
    fs::remove(dir_ / name, ec);
    it = listed_.erase(it);
    dropped = true;
  }
  try {
    if (!made_.empty() && listed_.empty()) {
      fs::remove(dir_ / kManifest, ec);
      fs::path d = dir_;
      while (fs::remove(d, ec) && d != made_) d = d.parent_path();  // each only if empty, up to the one made
    } else if (dropped) {
      save(complete_);
    }
  } catch (...) {  // a destructor: what it could not tidy stays listed, to be tidied by the next run
  }
}

bool OutputFolder::holds(const fs::path& file) const {
  std::error_code ec;
  const fs::path d = fs::weakly_canonical(dir_, ec), f = fs::weakly_canonical(file, ec);
  return f.parent_path() == d && listed_.count(f.filename().string()) > 0;
}

fs::path OutputFolder::stage(const std::string& name) {
  if (listed_.insert(temporary(name)).second) save(complete_);  // listed before it exists
  return dir_ / temporary(name);
}

void OutputFolder::staged(const std::string& name) { files_.push_back(name); }

void OutputFolder::keep(const std::string& name) { files_.push_back(name); }

void OutputFolder::commit() {
  for (const auto& f : files_) listed_.insert(f);
  complete_ = false;
  save(complete_);  // a mix of two tokenizations until the last rename
  std::error_code ec;
  for (const auto& f : files_) {
    if (!fs::exists(dir_ / temporary(f), ec)) continue;  // kept, not staged
    fs::rename(dir_ / temporary(f), dir_ / f, ec);
    if (ec) throw Failure((dir_ / f).string() + ": cannot put it in place: " + ec.message());
  }
  const std::set<std::string> now(files_.begin(), files_.end());
  for (const auto& f : listed_)
    if (!now.count(f)) fs::remove(dir_ / f, ec);  // the earlier tokenization's other files
  listed_ = now;
  complete_ = true;
  save(complete_);
  committed_ = true;
}

void OutputFolder::save(bool complete) const {
  nlohmann::ordered_json j;
  j["written_by"] = "tk-tokenize";
  j["complete"] = complete;
  j["files"] = std::vector<std::string>(listed_.begin(), listed_.end());
  write_whole(dir_ / kManifest, j.dump(1) + "\n");
}

}  // namespace tk::tokenize
