#include "support/support.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>

#include "tk/error.h"
#include "tk/output.h"

namespace fs = std::filesystem;

namespace tk {
namespace detail {
namespace {

[[noreturn]] void fail(const std::string& what, const fs::path& file, int err) {
  throw Error("cannot " + what + " '" + file.string() + "': " + std::strerror(err) +
              (err == ENOSPC || err == EDQUOT ? " (the disk is full)" : ""));
}

/// Writes all `n` bytes, retrying short writes and interruptions.
void write_all(int fd, const char* data, size_t n, const fs::path& file) {
  while (n > 0) {
    const ssize_t w = ::write(fd, data, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail("write", file, errno);
    }
    data += w;
    n -= static_cast<size_t>(w);
  }
}

}  // namespace

void sync_folder(const fs::path& dir) {
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail("open folder", dir, errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  // Some file systems cannot sync a folder; what they do not support they cannot lose either.
  if (rc != 0 && err != EINVAL && err != EROFS) fail("sync folder", dir, err);
}

void write_file_atomic(const fs::path& file, const std::string& data) {
  fs::path tmp = file;
  tmp += ".tmp";
  // A new file, never one a link of that name points at: a left-over .tmp (or a planted link) goes.
  ::unlink(tmp.c_str());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) fail("create", tmp, errno);
  try {
    write_all(fd, data.data(), data.size(), tmp);
    if (::fsync(fd) != 0 && errno != EINVAL) fail("write", tmp, errno);
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail("write", tmp, err);
  }
  if (::rename(tmp.c_str(), file.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail("move '" + tmp.string() + "' to", file, err);
  }
  sync_folder(file.parent_path());
}

AppendFile::~AppendFile() {
  if (fd_ >= 0) ::close(fd_);  // no throwing here: a run that wants the error calls close()
}

void AppendFile::open(const fs::path& file, bool truncate) {
  close();
  fd_ = ::open(file.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | (truncate ? O_TRUNC : 0), 0644);
  if (fd_ < 0) fail("open", file, errno);
  file_ = file;
}

void AppendFile::append(const std::string& line) {
  if (fd_ < 0) return;
  const std::string whole = line + "\n";
  const off_t end = ::lseek(fd_, 0, SEEK_END);
  try {
    write_all(fd_, whole.data(), whole.size(), file_);
  } catch (...) {
    // A write cut short (the disk filled up mid-line) leaves no torn record behind.
    if (end >= 0 && ::ftruncate(fd_, end) != 0) {
      // The write's error is the one to report.
    }
    throw;
  }
}

void AppendFile::sync() {
  if (fd_ >= 0 && ::fsync(fd_) != 0 && errno != EINVAL) fail("write", file_, errno);
}

void AppendFile::close() {
  if (fd_ < 0) return;
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0 && errno != EINTR) fail("write", file_, errno);
}

FolderLock::~FolderLock() { release(); }

void FolderLock::acquire(const fs::path& dir) {
  release();
  const fs::path file = dir / ".tk-lock";
  int fd = -1, err = 0;
  // A run that gave up a folder it made unlinks the lock file while holding it: a lock taken on
  // that file is on no file of the folder's, and is taken again on the one there now.
  for (int tries = 0;; ++tries) {
    fd = ::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) fail("open the lock file", file, errno);
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      err = errno;
      break;
    }
    struct stat held {}, there {};
    if (::fstat(fd, &held) == 0 && ::stat(file.c_str(), &there) == 0 && held.st_ino == there.st_ino &&
        held.st_dev == there.st_dev)
      break;
    ::close(fd);
    if (tries == 100) fail("lock", file, ESTALE);
  }
  if (err != 0) {
    ::close(fd);
    if (err != EWOULDBLOCK) fail("lock", file, err);
    std::string holder;
    std::ifstream(file) >> holder;
    throw RunRefused("the output folder '" + dir.string() + "' is in use by another run (process " +
                (holder.empty() ? std::string("unknown") : holder) +
                "); wait for it to end, or give this run another run.output");
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    const int err = errno;
    ::close(fd);
    fail("write", file, err);
  }
  fd_ = fd;
}

void FolderLock::release() {
  if (fd_ < 0) return;
  ::close(fd_);  // drops the lock; the file stays, naming the last owner
  fd_ = -1;
}

bool fault_due(const char* name) {
  static const std::pair<std::string, long> target = [] {
    const char* v = std::getenv("TK_FAULT");
    // A job's restart (tk-run --max-restarts, torchrun) runs through: the fault is its first start's.
    for (const char* restart : {"TK_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"})
      if (const char* r = std::getenv(restart); r && *r && std::strcmp(r, "0") != 0) v = nullptr;
    if (!v) return std::pair<std::string, long>{};
    const std::string s = v;
    const auto colon = s.rfind(':');
    if (colon == std::string::npos) return std::pair<std::string, long>{s, 1};
    return std::pair<std::string, long>{s.substr(0, colon), std::strtol(s.c_str() + colon + 1, nullptr, 10)};
  }();
  if (target.first.empty() || target.first != name) return false;
  static std::mutex m;
  static long passed = 0;
  std::lock_guard<std::mutex> lock(m);
  return ++passed == target.second;
}

void fault_point(const char* name) {
  if (fault_due(name)) std::raise(SIGKILL);
}

}  // namespace detail

void write_atomic(const fs::path& file, const std::string& data) { detail::write_file_atomic(file, data); }

}  // namespace tk
