#pragma once
// tk-tokenize's --out folder: it writes only files it lists as its own, and never one of its inputs.
#include <filesystem>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace tk::tokenize {

/// What went wrong, for the one-line error tk-tokenize exits with.
struct Failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// The file that lists a tokenization's files (tokenize.json in its folder).
inline constexpr const char* kManifest = "tokenize.json";

/// A folder of token shards and the tokenizer they were made with. tokenize.json in it lists every
/// file tk-tokenize wrote there, each listed before it exists, and says whether the tokenization
/// finished. A new tokenization writes each file under a temporary name (listed too) and, once
/// every file is written, renames them into place and deletes the files of the one it replaces:
/// a tokenization that fails leaves the earlier one whole. A folder that holds anything
/// tokenize.json does not list is refused, and nothing in it is touched.
class OutputFolder {
 public:
  /// Creates `dir` or takes it over from an earlier tokenization; throws Failure naming the files
  /// that are not tk-tokenize's.
  explicit OutputFolder(std::filesystem::path dir);
  /// Without commit(): deletes what this tokenization staged, and the folders this one made where
  /// nothing else is in them. (A commit() that failed halfway leaves tokenize.json saying the
  /// folder is incomplete.)
  ~OutputFolder();
  OutputFolder(const OutputFolder&) = delete;
  OutputFolder& operator=(const OutputFolder&) = delete;

  const std::filesystem::path& dir() const noexcept { return dir_; }
  /// Whether `file` (any path) is a file of this folder's earlier tokenization.
  bool holds(const std::filesystem::path& file) const;
  /// Where to write `name` (a plain file name) for now: a temporary file, listed before it exists.
  std::filesystem::path stage(const std::string& name);
  /// `name`, written to stage(name), is complete.
  void staged(const std::string& name);
  /// Keeps `name`, a file of the earlier tokenization, as a file of this one.
  void keep(const std::string& name);
  /// Puts every staged file in place, deletes the earlier tokenization's other files and records
  /// the folder as complete.
  void commit();

  /// The temporary name of `name`.
  static std::string temporary(const std::string& name) { return "." + name + ".tmp"; }
  /// Whether `name` is a temporary name (of some file).
  static bool is_temporary(const std::string& name) {
    return name.size() > 5 && name.front() == '.' && name.compare(name.size() - 4, 4, ".tmp") == 0;
  }
  /// Why `prefix` cannot start a file name in the folder (a '/', a leading dot, ...), or "".
  static std::string prefix_error(const std::string& prefix);

 private:
  void save(bool complete) const;

  std::filesystem::path dir_;
  std::set<std::string> listed_;    // what tokenize.json lists: earlier files and temporary ones
  std::vector<std::string> files_;  // this tokenization's files, in the order written
  bool complete_ = true;             // the files in place are one whole tokenization
  std::filesystem::path made_;       // the outermost folder this run created ("" for none)
  bool committed_ = false;
};

/// Reads tokenize.json in `dir`: whether it is there, and then the files it lists and whether the
/// tokenization that wrote them finished. Throws Failure for a damaged one.
struct Manifest {
  bool present = false, complete = false;
  std::set<std::string> files;
};
Manifest read_manifest(const std::filesystem::path& dir);

}  // namespace tk::tokenize
