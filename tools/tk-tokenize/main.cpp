// tk-tokenize: text files -> token shards in llm.c's format (the `tokens` data set's), tokenized
// by SentencePiece (a model trained here, BPE or unigram, or an existing .model) or byte by byte.
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "../cli_parse.h"
#include "output_folder.h"

namespace fs = std::filesystem;

namespace {

using tk::tokenize::Failure;
using tk::tokenize::OutputFolder;

struct Options {
  std::vector<std::string> inputs;
  std::string out, model, type = "bpe", separator, prefix, encode;
  bool encoding = false, decode = false;
  int vocab = 0;
  bool bytes = false;
  double validation = 0.1;
  int64_t shard_tokens = 100'000'000;
};

/// An input file: a regular file (not a FIFO or a device, which could be read forever), read
/// whole, its size known before.
std::string read_file(const std::string& path) {
  std::error_code ec;
  const auto st = fs::status(path, ec);
  if (!fs::is_regular_file(st))
    throw Failure(path + ": not a regular file (tk-tokenize reads files whose size it knows: no FIFO, device or folder)");
  const auto size = fs::file_size(path, ec);
  std::ifstream in(path, std::ios::binary);
  if (ec || !in) throw Failure(path + ": cannot read it" + (ec ? ": " + ec.message() : ""));
  std::string text(static_cast<size_t>(size), '\0');
  in.read(text.data(), static_cast<std::streamsize>(size));
  if (static_cast<uintmax_t>(in.gcount()) != size) throw Failure(path + ": changed while it was read");
  return text;
}

/// A file being written, whose every failure (a full disk) throws with the system's reason.
class OutFile {
 public:
  explicit OutFile(const fs::path& file) : file_(file), f_(std::fopen(file.c_str(), "wb")) {
    if (f_ == nullptr) fail();
  }
  OutFile(const OutFile&) = delete;
  OutFile& operator=(const OutFile&) = delete;
  ~OutFile() {
    if (f_ != nullptr) std::fclose(f_);
  }
  void write(const void* data, size_t n) {
    if (std::fwrite(data, 1, n, f_) != n) fail();
  }
  void close() {
    const bool ok = std::fflush(f_) == 0;
    const int err = errno;
    const bool closed = std::fclose(f_) == 0;
    f_ = nullptr;
    if (!ok || !closed) fail(ok ? errno : err);
  }

 private:
  [[noreturn]] void fail(int err = errno) {
    if (f_ != nullptr) std::fclose(f_);
    f_ = nullptr;
    throw Failure(file_.string() + ": cannot write it: " + std::strerror(err));
  }
  fs::path file_;
  std::FILE* f_;
};

/// Every input's documents, in order: each file split at `separator` (whole when it is empty);
/// empty documents are left out.
std::vector<std::string> documents(const Options& o, int64_t& bytes) {
  std::vector<std::string> docs;
  bytes = 0;
  for (const auto& f : o.inputs) {
    const std::string text = read_file(f);
    bytes += static_cast<int64_t>(text.size());
    size_t from = 0;
    while (from <= text.size()) {
      size_t at = o.separator.empty() ? std::string::npos : text.find(o.separator, from);
      std::string doc = text.substr(from, at == std::string::npos ? std::string::npos : at - from);
      if (!doc.empty()) docs.push_back(std::move(doc));
      if (at == std::string::npos) break;
      from = at + o.separator.size();
    }
  }
  if (docs.empty()) throw Failure("the inputs hold no text");
  return docs;
}

/// The longest line SentencePiece's trainer reads (its max_sentence_length); longer ones it skips.
constexpr int64_t kTrainLine = 4192;

/// Trains a SentencePiece model on the inputs; returns it serialized.
std::string train_model(const Options& o) {
  std::string inputs;
  for (const auto& f : o.inputs) inputs += (inputs.empty() ? "" : ",") + f;
  // One thread and no sampling of the input: the same text trains the same model. The model comes
  // back in memory (no model_prefix: the trainer writes no file).
  const std::string args = "--input=" + inputs + " --vocab_size=" + std::to_string(o.vocab) + " --model_type=" + o.type +
                           " --character_coverage=1.0 --num_threads=1 --max_sentence_length=" + std::to_string(kTrainLine) +
                           " --input_sentence_size=0 --shuffle_input_sentence=false --minloglevel=2";
  std::string model;
  const auto status = sentencepiece::SentencePieceTrainer::Train(args, nullptr, &model);
  if (status.ok()) return model;
  const std::string why = status.ToString();
  if (why.find("sentences_.empty()") != std::string::npos)
    throw Failure("no line of the inputs is shorter than " + std::to_string(kTrainLine) +
                  " bytes: SentencePiece trains on lines up to that length and skips longer ones; break the "
                  "text into lines, or tokenize with --model FILE or --bytes");
  if (why.find("Vocabulary size is too high") != std::string::npos || why.find("vocab_size") != std::string::npos)
    throw Failure("--vocab " + std::to_string(o.vocab) + " is more pieces than the inputs hold (" + why + "); give a smaller --vocab");
  throw Failure("training the SentencePiece model failed: " + why);
}

/// Shards of one split: OUT/PREFIX<split>_NNN.bin, at most `limit` tokens each, each staged in the
/// output folder.
class ShardWriter {
 public:
  ShardWriter(OutputFolder& out, std::string name, int64_t limit, int width)
      : out_(out), name_(std::move(name)), limit_(limit), width_(width) {}
  void add(const std::vector<int>& ids) {
    for (int id : ids) {
      if (static_cast<int64_t>(pending_.size()) == limit_) flush();
      pending_.push_back(static_cast<uint32_t>(id));
    }
    total_ += static_cast<int64_t>(ids.size());
  }
  void flush() {
    if (pending_.empty()) return;
    char number[32];
    std::snprintf(number, sizeof number, "_%03d.bin", static_cast<int>(files_.size()));
    const std::string name = name_ + number;
    std::vector<int32_t> head(256, 0);
    head[0] = 20240520;
    head[1] = width_ == 2 ? 1 : 2;
    head[2] = static_cast<int32_t>(pending_.size());
    std::vector<unsigned char> body;
    body.reserve(pending_.size() * static_cast<size_t>(width_));
    for (uint32_t v : pending_)
      for (int b = 0; b < width_; ++b) body.push_back(static_cast<unsigned char>(v >> (8 * b)));  // little-endian
    OutFile file(out_.stage(name));
    file.write(head.data(), 1024);
    file.write(body.data(), body.size());
    file.close();
    out_.staged(name);
    files_.push_back((out_.dir() / name).string());
    pending_.clear();
  }
  int64_t total() const noexcept { return total_; }
  const std::vector<std::string>& files() const noexcept { return files_; }

 private:
  OutputFolder& out_;
  std::string name_;
  int64_t limit_;
  int width_;
  std::vector<uint32_t> pending_;
  std::vector<std::string> files_;
  int64_t total_ = 0;
};

/// A progress bar on stderr when it is a terminal.
void progress(size_t done, size_t total) {
  static const bool tty = isatty(2) != 0;
  static int shown = -1;
  const int pct = static_cast<int>(100 * done / std::max<size_t>(total, 1));
  if (!tty || pct == shown) return;
  shown = pct;
  std::fprintf(stderr, "\r[%-40s] %3d%%  %zu / %zu documents", std::string(static_cast<size_t>(pct * 40 / 100), '#').c_str(),
               pct, done, total);
  if (done == total) std::fputc('\n', stderr);
}

/// --encode TEXT: its ids on one line; --decode: the text of the ids read from stdin. For tools
/// that must not load SentencePiece themselves (tk-sample: its embedded protobuf clashes with
/// LibTorch's in one process).
int translate(const Options& o) {
  if (o.model.empty()) throw Failure("--encode and --decode need --model FILE");
  sentencepiece::SentencePieceProcessor sp;
  if (const auto status = sp.Load(o.model); !status.ok())
    throw Failure(o.model + ": not a SentencePiece model: " + status.ToString());
  if (o.decode) {
    std::vector<int> ids;
    for (long long id; std::scanf("%lld", &id) == 1;) {
      if (id < 0 || id >= sp.GetPieceSize())
        throw Failure("id " + std::to_string(id) + " is outside the model's " + std::to_string(sp.GetPieceSize()) + " pieces");
      ids.push_back(static_cast<int>(id));
    }
    std::fputs(sp.DecodeIds(ids).c_str(), stdout);
    return 0;
  }
  // The empty text: the end-of-document id, which a new document follows.
  const std::vector<int> ids = o.encode.empty() ? std::vector<int>{std::max(sp.eos_id(), 0)} : sp.EncodeAsIds(o.encode);
  std::string line;
  for (int id : ids) line += (line.empty() ? "" : " ") + std::to_string(id);
  std::printf("%s\n", line.c_str());
  return 0;
}

int run(Options& o) {
  if (o.encoding || o.decode) return translate(o);
  if (o.inputs.empty() || o.out.empty()) throw Failure("give the text files and --out FOLDER");
  if (o.bytes == (!o.model.empty() || o.vocab > 0))
    throw Failure("give one of --bytes, --model FILE or --vocab N (train a model)");
  if (!(o.validation >= 0.0 && o.validation < 1.0)) throw Failure("--validation must be in [0, 1)");
  if (o.shard_tokens < 1 || o.shard_tokens > INT32_MAX) throw Failure("--shard-tokens must be in [1, 2^31)");
  if (const auto why = OutputFolder::prefix_error(o.prefix); !why.empty()) throw Failure("--prefix '" + o.prefix + "' " + why);
  OutputFolder out(o.out);
  std::vector<std::string> inputs = o.inputs;
  if (!o.model.empty()) inputs.push_back(o.model);
  const bool model_in_place = !o.model.empty() && out.holds(o.model) &&
                              fs::path(o.model).filename() == "tokenizer.model";  // the folder's own: kept
  for (const auto& f : inputs)
    if (out.holds(f) && !(model_in_place && f == o.model))
      throw Failure(f + " is a file of the tokenization in " + o.out + ", which this one replaces: tk-tokenize never "
                    "writes over its input; copy it out of the folder first, or give --out another folder");
  int64_t bytes = 0;
  const auto docs = documents(o, bytes);
  sentencepiece::SentencePieceProcessor sp;
  int vocab = 256, eos = -1;
  if (!o.bytes) {
    // The model the shards are made with goes beside them, as tokenizer.model (tk-sample finds it there).
    const std::string model = o.model.empty() ? train_model(o) : read_file(o.model);
    const auto status = sp.LoadFromSerializedProto(model);
    if (!status.ok()) throw Failure((o.model.empty() ? "the trained model" : o.model) + ": not a SentencePiece model: " + status.ToString());
    if (model_in_place) {
      out.keep("tokenizer.model");
    } else {
      OutFile file(out.stage("tokenizer.model"));
      file.write(model.data(), model.size());
      file.close();
      out.staged("tokenizer.model");
    }
    if (o.model.empty()) o.model = (out.dir() / "tokenizer.model").string();
    vocab = sp.GetPieceSize();
    eos = sp.eos_id();
  }
  const int width = vocab <= 65536 ? 2 : 4;
  const size_t n_val = static_cast<size_t>(std::floor(o.validation * static_cast<double>(docs.size())));
  if (o.validation > 0.0 && n_val == 0) throw Failure("--validation holds out no document of " + std::to_string(docs.size()));
  ShardWriter train(out, o.prefix + "train", o.shard_tokens, width), val(out, o.prefix + "val", o.shard_tokens, width);
  for (size_t i = 0; i < docs.size(); ++i) {
    std::vector<int> ids;
    if (o.bytes) {
      for (unsigned char c : docs[i]) ids.push_back(c);
    } else {
      ids = sp.EncodeAsIds(docs[i]);
      if (eos >= 0) ids.push_back(eos);  // each document ends with the model's end-of-sequence
    }
    // Held out evenly through the documents (every 1/fraction-th), not from the end, which for
    // several files would be the last files only.
    const bool held = std::floor(static_cast<double>(i + 1) * o.validation) > std::floor(static_cast<double>(i) * o.validation);
    (held ? val : train).add(ids);
    progress(i + 1, docs.size());
  }
  train.flush();
  val.flush();
  out.commit();
  const int64_t tokens = train.total() + val.total();
  std::printf("tokenized %zu documents (%lld bytes) into %lld tokens, %.3f tokens per byte; vocabulary %d (%s)\n",
              docs.size(), static_cast<long long>(bytes), static_cast<long long>(tokens),
              static_cast<double>(tokens) / static_cast<double>(std::max<int64_t>(bytes, 1)), vocab,
              o.bytes ? "bytes" : o.model.c_str());
  std::printf("train: %lld tokens in %zu shard(s); validation: %lld tokens in %zu shard(s) (%zu documents)\n",
              static_cast<long long>(train.total()), train.files().size(), static_cast<long long>(val.total()),
              val.files().size(), n_val);
  for (const auto& f : train.files()) std::printf("wrote %s\n", f.c_str());
  for (const auto& f : val.files()) std::printf("wrote %s\n", f.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tk-tokenize: text files -> token shards for the `tokens` data set (llm.c's format: a 256-int32 "
               "header, then uint16 tokens, or uint32 beyond 65536)"};
  Options o;
  app.add_option("inputs", o.inputs, "text files")->check(CLI::ExistingFile);
  app.add_option("-o,--out", o.out, "folder of the shards (and of tokenizer.model when one is trained)");
  app.add_option("--encode", o.encode, "print the ids of this text (with --model) and exit; of \"\": the end-of-document id");
  app.add_flag("--decode", o.decode, "print the text of the ids read from stdin (with --model) and exit");
  app.add_option("--model", o.model, "tokenize with this SentencePiece model")->check(CLI::ExistingFile);
  app.add_option("--vocab", o.vocab, "train a SentencePiece model of this vocabulary size on the inputs")
      ->check(CLI::Range(8, 1 << 24));
  app.add_option("--type", o.type, "the model to train: bpe or unigram")->check(CLI::IsMember({"bpe", "unigram"}));
  app.add_flag("--bytes", o.bytes, "byte-level tokens (vocabulary 256), no model");
  app.add_option("--separator", o.separator, "split each file into documents at this string (e.g. '\\n%\\n')");
  app.add_option("--validation", o.validation, "fraction of the documents held out as validation shards, spread evenly");
  app.add_option("--shard-tokens", o.shard_tokens, "tokens per shard at most");
  app.add_option("--prefix", o.prefix, "prefix of the shard files' names");
  if (auto rc = tk::parse_command_line(app, argc, argv, "tk-tokenize")) return *rc;
  o.encoding = app.count("--encode") > 0;
  // CLI11 keeps "\n" as two characters; the separator means what it says.
  for (size_t at; (at = o.separator.find("\\n")) != std::string::npos;) o.separator.replace(at, 2, "\n");
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tk-tokenize: %s\n", e.what());
    return 1;
  }
}
