// Pre-tokenized corpora in llm.c's shard format, memory-mapped: a header of 256 little-endian
// int32 (magic 20240520, version, token count), then that many tokens (version 1: uint16, as
// llm.c, modded-nanogpt and the speedrun contests write them; version 2: uint32, for vocabularies
// beyond 65536). A shard is cut into sequences of seq_len inputs and the next tokens as targets;
// the sequences of every shard of a set make one indexable data set, so the core's seeded shuffle,
// its striding by rank and its resume position apply as to any other.
#include <sys/mman.h>
#include <sys/stat.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>

#include "data_sets.h"

namespace fs = std::filesystem;

namespace tk::data {
namespace {

constexpr int32_t kMagic = 20240520;
constexpr int64_t kHeaderInts = 256, kHeaderBytes = kHeaderInts * 4;
/// The largest vocabulary taken: 2^24 ids, far beyond any published tokenizer's (a few 100k). An id
/// beyond it is a damaged shard or another format, not a vocabulary (its embedding alone would
/// hold 2^24 x width parameters, and counting its ids would take memory to match).
constexpr int64_t kMaxVocab = int64_t{1} << 24;

/// What a file that is not a regular one is, for a message.
std::string file_kind(mode_t m) {
  if (S_ISDIR(m)) return "a folder";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "not a file";
}

/// One shard, mapped read-only. Pages a batch read are handed back afterwards (MADV_DONTNEED):
/// the page cache keeps them, this process's resident memory does not grow with the corpus.
class Shard {
 public:
  Shard(const fs::path& file, const Options& o, const std::string& key) : file_(file) {
    // Non-blocking: opening a FIFO would wait for a writer; it is refused below instead.
    fd_ = ::open(file.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd_ < 0) o.fail(key, file.string() + ": cannot open: " + std::strerror(errno));
    struct stat st {};
    ::fstat(fd_, &st);
    if (!S_ISREG(st.st_mode))
      o.fail(key, file.string() + ": not a regular file (" + file_kind(st.st_mode) +
                      "): a token shard is a file of known size, read in place");
    bytes_ = static_cast<int64_t>(st.st_size);
    modified_ = st.st_mtim;
    if (bytes_ < kHeaderBytes)
      o.fail(key, file.string() + ": " + std::to_string(bytes_) + " bytes, shorter than the 1024-byte header of a token shard");
    int32_t head[kHeaderInts];
    if (::pread(fd_, head, sizeof head, 0) != static_cast<ssize_t>(sizeof head))
      o.fail(key, file.string() + ": cannot read its header");
    if (head[0] != kMagic)
      o.fail(key, file.string() + ": not a token shard (magic " + std::to_string(head[0]) + ", expected " +
                      std::to_string(kMagic) + ")");
    if (head[1] != 1 && head[1] != 2)
      o.fail(key, file.string() + ": token shard version " + std::to_string(head[1]) +
                      " (expected 1, uint16 tokens, or 2, uint32 tokens)");
    width_ = head[1] == 1 ? 2 : 4;
    count_ = head[2];
    const int64_t expected = kHeaderBytes + count_ * width_;
    if (count_ < 0 || expected != bytes_)
      o.fail(key, file.string() + ": the header says " + std::to_string(count_) + " tokens of " + std::to_string(width_) +
                      " bytes (" + std::to_string(expected) + " bytes with the header), the file has " +
                      std::to_string(bytes_) + " bytes");
    void* m = ::mmap(nullptr, static_cast<size_t>(bytes_), PROT_READ, MAP_SHARED, fd_, 0);
    if (m == MAP_FAILED) o.fail(key, file.string() + ": cannot map it: " + std::strerror(errno));
    map_ = static_cast<const unsigned char*>(m);
    ::madvise(m, static_cast<size_t>(bytes_), MADV_RANDOM);
  }
  ~Shard() {
    if (map_) ::munmap(const_cast<unsigned char*>(map_), static_cast<size_t>(bytes_));
    if (fd_ >= 0) ::close(fd_);
  }
  Shard(const Shard&) = delete;
  Shard& operator=(const Shard&) = delete;

  const fs::path& file() const noexcept { return file_; }
  int64_t count() const noexcept { return count_; }
  int width() const noexcept { return width_; }
  /// Tokens [first, first + n) as int64, into `out`, from the mapping: check_unchanged() first.
  void read(int64_t first, int64_t n, int64_t* out) const { decode(map_ + kHeaderBytes + first * width_, n, out); }
  /// Throws when the file's size or modification time is not what it was when it was opened. The
  /// mapping is read only after this: a shard cut short under it would end the process with
  /// SIGBUS, one rewritten in place would give other tokens; either is a located error here.
  void check_unchanged() const {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) throw Error(file_.string() + ": cannot stat it: " + std::strerror(errno));
    if (st.st_size == bytes_ && st.st_mtim.tv_sec == modified_.tv_sec && st.st_mtim.tv_nsec == modified_.tv_nsec) return;
    throw Error(file_.string() + ": the shard changed while the run reads it (" + std::to_string(bytes_) +
                " bytes when the run opened it, " + std::to_string(static_cast<int64_t>(st.st_size)) +
                " now" + (st.st_size == bytes_ ? ", rewritten in place" : "") +
                "): a run's shards must stay as they are; put them back and resume from the last checkpoint, or "
                "write new shards to new files");
  }
  /// `n` tokens of this shard's width at `p`, as int64, into `out`.
  void decode(const unsigned char* p, int64_t n, int64_t* out) const {
    if (width_ == 2) {
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int64_t>(p[2 * i]) | (static_cast<int64_t>(p[2 * i + 1]) << 8);
    } else {
      for (int64_t i = 0; i < n; ++i) {
        uint32_t v = 0;
        std::memcpy(&v, p + 4 * i, 4);  // little-endian (make_tokens refuses other machines)
        out[i] = v;
      }
    }
  }
  /// Lets go of the pages that hold tokens [first, first + n).
  void release(int64_t first, int64_t n) const {
    const long page = ::sysconf(_SC_PAGESIZE);
    const int64_t begin = (kHeaderBytes + first * width_) / page * page;
    const int64_t end = kHeaderBytes + (first + n) * width_;
    ::madvise(const_cast<unsigned char*>(map_) + begin, static_cast<size_t>(end - begin), MADV_DONTNEED);
  }
  /// The raw bytes of tokens [first, first + n) into `out`, read from the file (not the mapping).
  void read_raw(int64_t first, int64_t n, void* out) const {
    const auto want = static_cast<size_t>(n * width_);
    size_t got = 0;
    while (got < want) {
      const ssize_t r = ::pread(fd_, static_cast<char*>(out) + got, want - got,
                                static_cast<off_t>(kHeaderBytes + first * width_ + static_cast<int64_t>(got)));
      if (r <= 0) throw Error(file_.string() + ": read error: " + (r < 0 ? std::strerror(errno) : "unexpected end"));
      got += static_cast<size_t>(r);
    }
  }

 private:
  fs::path file_;
  int fd_ = -1;
  int64_t bytes_ = 0, count_ = 0;
  struct timespec modified_ {};
  int width_ = 2;
  const unsigned char* map_ = nullptr;
};

/// The shards of one split and their sequences: sequence i of shard s is its tokens
/// [i * T, i * T + T] (inputs the first T, targets the last T).
class TokenShards final : public Dataset {
 public:
  TokenShards(std::vector<std::unique_ptr<Shard>> shards, int64_t seq_len) : shards_(std::move(shards)), t_(seq_len) {
    int64_t total = 0;
    for (const auto& s : shards_) {
      starts_.push_back(total);
      total += std::max<int64_t>(0, (s->count() - 1) / t_);
    }
    size_ = total;
  }
  int64_t size() const override { return size_; }
  Batch get(const at::Tensor& indices) const override {
    const auto idx = indices.to(at::kLong).contiguous();
    const int64_t n = idx.numel();
    at::Tensor seq = at::empty({n, t_ + 1}, at::kLong);
    int64_t* out = seq.data_ptr<int64_t>();
    const int64_t* ix = idx.data_ptr<int64_t>();
    auto shard_of = [&](int64_t i) { return std::upper_bound(starts_.begin(), starts_.end(), i) - 1; };
    std::vector<bool> checked(shards_.size(), false);  // each shard the batch reads, once, before any read
    for (int64_t k = 0; k < n; ++k) {
      const auto s = static_cast<size_t>(shard_of(ix[k]) - starts_.begin());
      if (!checked[s]) shards_[s]->check_unchanged();
      checked[s] = true;
    }
    for (int64_t k = 0; k < n; ++k) {
      const auto it = shard_of(ix[k]);
      const Shard& s = *shards_[static_cast<size_t>(it - starts_.begin())];
      const int64_t first = (ix[k] - *it) * t_;
      s.read(first, t_ + 1, out + k * (t_ + 1));
      s.release(first, t_ + 1);
    }
    Batch b;
    b.input = seq.slice(1, 0, t_);
    b.target = seq.slice(1, 1, t_ + 1);
    b.samples = n;
    b.tokens = n * t_;
    return b;
  }
  const std::vector<std::unique_ptr<Shard>>& shards() const noexcept { return shards_; }

 private:
  std::vector<std::unique_ptr<Shard>> shards_;
  std::vector<int64_t> starts_;
  int64_t t_, size_ = 0;
};

/// Shards in a folder that tk-tokenize wrote: its tokenize.json lists each of them, and says the
/// tokenization finished. A shard it does not list (left by an earlier tokenization, or put there
/// by hand) would train examples of another tokenizer beside these.
void check_tokenizations(const Options& o, const std::string& key, const std::vector<fs::path>& shards) {
  std::map<fs::path, std::set<std::string>> folders;
  for (const auto& f : shards) folders[f.parent_path()].insert(f.filename().string());
  for (const auto& [dir, names] : folders) {
    const fs::path manifest = (dir.empty() ? fs::path(".") : dir) / "tokenize.json";
    std::ifstream in(manifest);
    if (!in) continue;  // shards from elsewhere: nothing to check them against
    const auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("files") || !j["files"].is_array() || !j.contains("complete") ||
        !j["complete"].is_boolean())
      o.fail(key, manifest.string() + " is damaged (it lists the files tk-tokenize wrote there): tokenize again");
    if (!j["complete"].get<bool>())
      o.fail(key, "the tokenization in " + dir.string() + " did not finish (" + manifest.string() +
                      " says so): run tk-tokenize again");
    std::set<std::string> listed;
    for (const auto& f : j["files"])
      if (f.is_string()) listed.insert(f.get<std::string>());
    for (const auto& n : names)
      if (!listed.count(n))
        o.fail(key, (dir / n).string() + " is not a shard of the tokenization in " + dir.string() + " (" +
                        manifest.string() + " does not list it): a file of an earlier tokenization or of another "
                        "tokenizer; move it out of the folder, or name the shards you mean");
  }
}

/// The files a pattern names, sorted: a glob, or a list separated by commas.
std::vector<fs::path> files_of(const Options& o, const std::string& key) {
  std::vector<fs::path> out;
  for (const auto& [one, found] : files_matching(o.get_path(key))) {
    if (found.empty())
      o.fail(key, one.find_first_of("*?[") == std::string::npos ? one + ": no such file" : "'" + one + "' matches no file");
    for (const auto& f : found) {
      std::error_code ec;
      if (!fs::exists(f, ec))  // what glob found and stat cannot: a link to nothing
        o.fail(key, f.string() + ": a symbolic link to " + fs::read_symlink(f, ec).string() + ", which does not exist");
      out.push_back(f);
    }
  }
  if (out.empty()) o.fail(key, "names no shard");
  check_tokenizations(o, key, out);
  return out;
}

/// The largest token id of a shard, and how often each id occurs added into `counts` (grown as
/// needed): one pass in chunks of 1M tokens through one buffer, read with pread, so that a corpus
/// larger than memory is checked at the memory of one chunk.
int64_t scan(const Shard& s, std::vector<int64_t>& counts, const Options& o, const std::string& key) {
  constexpr int64_t kChunk = 1 << 20;
  std::vector<unsigned char> raw(static_cast<size_t>(std::min(kChunk, s.count()) * s.width()));
  std::vector<int64_t> ids(static_cast<size_t>(std::min(kChunk, s.count())));
  int64_t top = 0;
  for (int64_t first = 0; first < s.count(); first += kChunk) {
    const int64_t n = std::min(kChunk, s.count() - first);
    s.read_raw(first, n, raw.data());
    s.decode(raw.data(), n, ids.data());
    for (int64_t i = 0; i < n; ++i) {
      const int64_t id = ids[static_cast<size_t>(i)];
      if (id >= kMaxVocab)
        o.fail(key, s.file().string() + ": token " + std::to_string(id) + " (at token " + std::to_string(first + i) +
                        ") is beyond " + std::to_string(kMaxVocab) +
                        ", the largest vocabulary the tokens data set takes: a damaged shard, or one of another format");
      if (id >= static_cast<int64_t>(counts.size())) counts.resize(static_cast<size_t>(id) + 1, 0);
      ++counts[static_cast<size_t>(id)];
      top = std::max(top, id);
    }
  }
  return top;
}

/// The shards of `key`, each checked, with the largest token id of each and, added into
/// `counts`, how often each id occurs (for the unigram baseline).
struct Split {
  std::unique_ptr<TokenShards> set;
  std::vector<int64_t> largest;
  std::string fingerprint;  ///< files_fingerprint() of its shards
};

Split open_split(const Options& o, const std::string& key, int64_t t, std::vector<int64_t>& counts) {
  std::vector<std::unique_ptr<Shard>> shards;
  std::vector<int64_t> largest;
  std::vector<std::string> names;
  for (const auto& f : files_of(o, key)) {
    auto s = std::make_unique<Shard>(f, o, key);
    // The recipe's seq_len blamed where it sets one (a shard too short, or it too long).
    if (s->count() < t + 1)
      o.fail(o.where("seq_len").file.empty() ? key : "seq_len",
             f.string() + ": " + std::to_string(s->count()) + " tokens, fewer than one sequence of seq_len " +
                 std::to_string(t) + " needs (" + std::to_string(t + 1) + ")");
    largest.push_back(scan(*s, counts, o, key));
    shards.push_back(std::move(s));
    names.push_back(f.string());
  }
  return {std::make_unique<TokenShards>(std::move(shards), t), std::move(largest), files_fingerprint(names)};
}

/// Refuses the first shard of `split` with a token at or beyond `vocab`, naming it.
void refuse_beyond(const Options& o, const std::string& key, const Split& split, int64_t vocab) {
  for (size_t i = 0; i < split.largest.size(); ++i)
    if (split.largest[i] >= vocab)
      o.fail(key, split.set->shards()[i]->file().string() + ": token " + std::to_string(split.largest[i]) +
                      " is beyond the vocabulary of " + std::to_string(vocab));
}

}  // namespace

OptionSpecs tokens_specs() {
  return {opt_path("train", "", "training shards: a file, a glob (\"data/train_*.bin\") or a comma-separated list"),
          opt_path("validation", "", "validation shards, the same way (\"\": none)"),
          opt_int("seq_len", 1024, "positions per example"),
          opt_int("vocab", 0, "the vocabulary (0: the largest token id + 1 over all shards); a token at or beyond it is refused")};
}

DataSplits make_tokens(const Options& o, uint64_t) {
  const int64_t t = o.get_int("seq_len");
  if (t < 1) o.fail("seq_len", "must be >= 1, got " + std::to_string(t));
  const uint16_t one = 1;
  if (*reinterpret_cast<const unsigned char*>(&one) != 1)
    o.fail("train", "token shards are little-endian; this machine is not");
  if (o.get_int("vocab") < 0) o.fail("vocab", "must be >= 0");
  if (o.get_int("vocab") > kMaxVocab)
    o.fail("vocab", "is " + std::to_string(o.get_int("vocab")) + ", beyond " + std::to_string(kMaxVocab) +
                        ", the largest vocabulary the tokens data set takes (a published tokenizer has a few 100k)");
  if (o.get_path("train").empty()) o.fail("train", "give the training shards (a file, a glob or a list)");
  std::vector<int64_t> train_counts, val_counts;
  Split train = open_split(o, "train", t, train_counts);
  std::optional<Split> val;
  if (!o.get_path("validation").empty()) val = open_split(o, "validation", t, val_counts);
  int64_t vocab = o.get_int("vocab");
  if (vocab == 0) {
    vocab = 1 + *std::max_element(train.largest.begin(), train.largest.end());
    if (val) vocab = std::max(vocab, 1 + *std::max_element(val->largest.begin(), val->largest.end()));
  }
  refuse_beyond(o, "train", train, vocab);
  if (val) refuse_beyond(o, "validation", *val, vocab);
  DataSplits d;
  d.info.input_dim = vocab;
  d.info.output_dim = vocab;
  d.info.vocab = vocab;
  d.info.input_shape = {t};
  d.info.next_token = true;
  d.info.fingerprint = "train: " + train.fingerprint + (val ? "; validation: " + val->fingerprint : "");
  if (val) {
    // The unigram baseline: the training tokens' frequencies (add-one smoothed), scored on the
    // validation tokens.
    train_counts.resize(static_cast<size_t>(vocab), 0);
    val_counts.resize(static_cast<size_t>(vocab), 0);
    double total = 0.0, loss = 0.0, scored = 0.0;
    for (int64_t c : train_counts) total += static_cast<double>(c) + 1.0;
    for (size_t i = 0; i < val_counts.size(); ++i) {
      loss -= static_cast<double>(val_counts[i]) * std::log((static_cast<double>(train_counts[i]) + 1.0) / total);
      scored += static_cast<double>(val_counts[i]);
    }
    d.info.baseline_name = "unigram";
    d.info.baseline_loss = loss / scored;
  }
  d.train = std::move(train.set);
  if (val) d.validation = std::move(val->set);
  return d;
}

}  // namespace tk::data
