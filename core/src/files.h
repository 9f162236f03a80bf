#pragma once
// Checked, durable file operations for a run's output folder: every failed write throws an Error
// that names the file and the reason, nothing is left half-written where a reader could take it
// for whole, and one process at a time owns a folder. Not installed.
#include <filesystem>
#include <string>

namespace tk::detail {

/// Writes all of `data` to `file`, replacing it: through `<file>.tmp`, fsync, rename and an fsync
/// of the folder, so that a crash or a kill at any instant leaves either the old or the new file.
void write_file_atomic(const std::filesystem::path& file, const std::string& data);

/// Makes a rename or a new entry in `dir` survive a power cut.
void sync_folder(const std::filesystem::path& dir);

/// A file that only grows by whole records (metrics.jsonl): each append is one checked write(2)
/// of a complete line, so a kill never leaves a line the kernel has not taken whole.
class AppendFile {
 public:
  AppendFile() = default;
  AppendFile(const AppendFile&) = delete;
  AppendFile& operator=(const AppendFile&) = delete;
  ~AppendFile();

  /// Opens `file` for appending (created when missing, emptied when `truncate`).
  void open(const std::filesystem::path& file, bool truncate);
  bool is_open() const noexcept { return fd_ >= 0; }
  /// Appends `line` and a newline; throws naming the file on any failure (disk full included).
  void append(const std::string& line);
  /// Flushes what was appended to the disk.
  void sync();
  void close();

 private:
  int fd_ = -1;
  std::filesystem::path file_;
};

/// An exclusive lock on a folder for as long as this object lives: `<dir>/.tk-lock`, flock(2)ed
/// and holding the owner's PID. The kernel drops the lock when the process ends, however it ends,
/// so a killed run never blocks its own resume.
class FolderLock {
 public:
  FolderLock() = default;
  FolderLock(const FolderLock&) = delete;
  FolderLock& operator=(const FolderLock&) = delete;
  ~FolderLock();

  /// Takes the lock on `dir` (which must exist); throws, naming the holder's PID, when another
  /// process holds it.
  void acquire(const std::filesystem::path& dir);
  void release();

 private:
  int fd_ = -1;
};

/// A crash point for tests of kill safety: when the environment variable TK_FAULT is
/// "<name>:<n>", the n-th time the run passes point `name` the process kills itself with SIGKILL.
/// Points: metrics-written, checkpoint-partial, checkpoint-renamed, checkpoint-done.
void fault_point(const char* name);
/// Whether TK_FAULT is "<name>:<n>" and this is the n-th time point `name` is passed (for faults
/// other than a kill: "oom" makes the n-th micro-batch of the process fail as out of memory).
bool fault_due(const char* name);

}  // namespace tk::detail
