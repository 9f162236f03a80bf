#pragma once
/// What a run writes and shows: JSON lines, the progress display, atomic file writes.
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace tk {

/// Builds one JSON object on one line, keys in insertion order.
class JsonLine {
 public:
  JsonLine& add(const std::string& key, double v);
  JsonLine& add(const std::string& key, int64_t v);
  JsonLine& add(const std::string& key, const std::string& v);
  std::string str() const { return "{" + body_ + "}"; }

 private:
  void key(const std::string& k);
  std::string body_;
};

/// JSON string literal for `s`, quotes included.
std::string json_quote(const std::string& s);

/// Writes `data` to `file` through a temporary file, fsync and a rename, so that a crash or a kill
/// leaves the old file or the new one; throws naming the file and the reason (a full disk too).
void write_atomic(const std::filesystem::path& file, const std::string& data);

enum class ProgressMode { Auto, Bar, Plain, None };

/// Step progress: a live line on a terminal, periodic plain lines otherwise.
class Progress {
 public:
  Progress(ProgressMode mode, int64_t total_steps, int64_t every);
  /// Reports the state after optimizer step `step` (1-based).
  void update(int64_t step, int64_t epoch, double loss, double lr, double samples_per_s,
              double elapsed_s);
  /// A line of its own (validation results), keeping the live line intact.
  void note(const std::string& line);
  /// Ends the live line.
  void finish();

 private:
  bool live_ = false;
  bool quiet_ = false;
  bool open_ = false;
  int64_t total_, every_;
};

/// "1m05s", "12.3s".
std::string format_duration(double seconds);

}  // namespace tk
