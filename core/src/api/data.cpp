// The engine's share of data (tk/data.h): what a data set tells, the in-memory data set, the
// epoch order.
#include "tk/data.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/randperm.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "tk/error.h"

namespace tk {
namespace {

uint64_t mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/// FNV-1a over `n` bytes, continuing from `h`.
uint64_t fnv(uint64_t h, const void* p, size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001b3ULL;
  return h;
}

/// Size and sampled blocks of one file, hashed into `h`; its size into `bytes`.
uint64_t fingerprint_file(uint64_t h, const std::string& file, int64_t& bytes) {
  constexpr int64_t kBlock = 4096, kBlocks = 16;
  std::vector<char> block(static_cast<size_t>(kBlock));
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);  // a FIFO is refused, not waited on
  if (fd < 0) throw Error(file + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw Error(file + ": cannot stat it: " + std::strerror(err));
  }
  const bool regular = S_ISREG(st.st_mode);
  const auto size = static_cast<int64_t>(st.st_size);
  for (int64_t b = 0; regular && b < kBlocks && b * kBlock < size; ++b) {
    // Blocks start evenly from the first byte to the last block; a small file is read whole.
    const int64_t at = size <= kBlocks * kBlock ? b * kBlock : (size - kBlock) * b / (kBlocks - 1);
    const ssize_t got = ::pread(fd, block.data(), static_cast<size_t>(kBlock), static_cast<off_t>(at));
    if (got < 0) {
      const int err = errno;
      ::close(fd);
      throw Error(file + ": cannot read: " + std::strerror(err));
    }
    h = fnv(h, &at, sizeof at);
    h = fnv(h, block.data(), static_cast<size_t>(got));
  }
  ::close(fd);
  if (!regular) throw Error(file + ": not a regular file: a data set's files must be files of known size");
  const std::string name = std::filesystem::path(file).filename().string();
  h = fnv(h, name.data(), name.size() + 1);
  h = fnv(h, &size, sizeof size);
  bytes += size;
  return h;
}

}  // namespace

std::vector<FileMatches> files_matching(const std::string& spec,
                                        const std::function<std::string(const std::string&)>& resolve) {
  std::vector<FileMatches> out;
  size_t from = 0;
  while (from <= spec.size()) {
    const size_t comma = spec.find(',', from);
    std::string one = spec.substr(from, comma == std::string::npos ? std::string::npos : comma - from);
    from = comma == std::string::npos ? spec.size() + 1 : comma + 1;
    if (one.empty()) continue;
    if (resolve) one = resolve(one);
    FileMatches m{one, {}};
    glob_t g{};
    if (::glob(one.c_str(), 0, nullptr, &g) == 0)
      for (size_t i = 0; i < g.gl_pathc; ++i) m.files.emplace_back(g.gl_pathv[i]);
    ::globfree(&g);
    std::sort(m.files.begin(), m.files.end());
    out.push_back(std::move(m));
  }
  return out;
}

std::string files_fingerprint(const std::vector<std::string>& files) {
  uint64_t h = 0xcbf29ce484222325ULL;
  int64_t bytes = 0;
  for (const auto& f : files) h = fingerprint_file(h, f, bytes);
  char digest[17];
  std::snprintf(digest, sizeof digest, "%016llx", static_cast<unsigned long long>(h));
  return std::to_string(files.size()) + (files.size() == 1 ? " file, " : " files, ") + std::to_string(bytes) +
         " bytes, digest " + digest;
}

std::string DataInfo::describe() const {
  std::string shape = "[";
  for (size_t i = 0; i < input_shape.size(); ++i) shape += (i ? ", " : "") + std::to_string(input_shape[i]);
  shape += "]";
  if (vocab > 0) return "token ids " + shape + " from a vocabulary of " + std::to_string(vocab);
  if (input_shape.size() == 3) return "images " + shape;
  return "features [" + std::to_string(input_dim) + "]";
}

TensorDataset::TensorDataset(at::Tensor inputs, at::Tensor targets, int64_t ignore_index)
    : inputs_(std::move(inputs)), targets_(std::move(targets)), ignore_index_(ignore_index) {
  if (inputs_.size(0) != targets_.size(0))
    throw Error("data set has " + std::to_string(inputs_.size(0)) + " inputs but " +
                std::to_string(targets_.size(0)) + " targets");
  // One look at all the targets here spares each micro-batch its count of the items that count.
  every_item_counts_ = at::isFloatingType(targets_.scalar_type()) || !targets_.eq(ignore_index_).any().item<bool>();
}

Batch TensorDataset::get(const at::Tensor& indices) const {
  Batch b;
  b.input = inputs_.index_select(0, indices);
  b.target = targets_.index_select(0, indices);
  b.samples = indices.size(0);
  if (at::isFloatingType(b.target.scalar_type())) b.tokens = b.samples;
  else if (every_item_counts_) b.tokens = b.target.numel();
  else b.tokens = b.target.ne(ignore_index_).sum().item<int64_t>();
  return b;
}

at::Tensor epoch_order(int64_t n, uint64_t seed, int64_t epoch, bool shuffle) {
  if (!shuffle) return at::arange(n, at::kLong);
  auto gen = at::detail::createCPUGenerator(mix(mix(seed) ^ static_cast<uint64_t>(epoch)));
  return at::randperm(n, gen, at::kLong);
}

}  // namespace tk
