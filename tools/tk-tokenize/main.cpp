// tk-tokenize: text files -> token shards in llm.c's format (the `tokens` data set's), tokenized
// by SentencePiece (a model trained here, BPE or unigram, or an existing .model) or byte by byte.
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <streambuf>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "../cli_parse.h"
#include "byte_bpe.h"
#include "output_folder.h"

namespace fs = std::filesystem;

namespace {

using tk::tokenize::ByteLevelBpe;
using tk::tokenize::Failure;
using tk::tokenize::OutputFolder;

struct Options {
  std::vector<std::string> inputs;
  std::string out, model, type = "bpe", separator, prefix, encode;
  bool encoding = false, decode = false, pieces = false, size = false;
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

/// The inputs, each read once, and their documents: views into them.
struct Documents {
  std::vector<std::string> texts;
  std::vector<std::string_view> docs;
  int64_t bytes = 0;
};

/// Every input's documents, in order: each file split at `separator` (whole when it is empty);
/// empty documents are left out.
Documents documents(const Options& o) {
  Documents d;
  d.texts.reserve(o.inputs.size());  // the views below point into these strings: they never move
  for (const auto& f : o.inputs) d.texts.push_back(read_file(f));
  for (const std::string_view text : d.texts) {
    d.bytes += static_cast<int64_t>(text.size());
    size_t from = 0;
    while (from <= text.size()) {
      const size_t at = o.separator.empty() ? std::string_view::npos : text.find(o.separator, from);
      const std::string_view doc = text.substr(from, at == std::string_view::npos ? std::string_view::npos : at - from);
      if (!doc.empty()) d.docs.push_back(doc);
      if (at == std::string_view::npos) break;
      from = at + o.separator.size();
    }
  }
  if (d.docs.empty()) throw Failure("the inputs hold no text");
  return d;
}

/// One field of a serialized protobuf message: its number and its value, a varint or bytes.
struct ProtoField {
  uint64_t number = 0, varint = 0;
  std::string_view bytes;
};

/// The fields of the serialized protobuf message `m`, in order; nullopt when it is malformed.
std::optional<std::vector<ProtoField>> proto_fields(std::string_view m) {
  size_t at = 0;
  const auto varint = [&](uint64_t& v) {
    v = 0;
    for (int shift = 0; at < m.size() && shift < 64; shift += 7) {
      const auto b = static_cast<unsigned char>(m[at++]);
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (b < 0x80) return true;
    }
    return false;
  };
  std::vector<ProtoField> fields;
  while (at < m.size()) {
    ProtoField f;
    uint64_t key = 0;
    if (!varint(key)) return std::nullopt;
    f.number = key >> 3;
    const uint64_t type = key & 7;
    uint64_t size = type == 1 ? 8 : type == 5 ? 4 : 0;  // 1: fixed64, 5: fixed32, 2: length-delimited
    if (type == 0 && !varint(f.varint)) return std::nullopt;
    if (type == 2 && !varint(size)) return std::nullopt;
    if ((type != 0 && type != 1 && type != 2 && type != 5) || size > m.size() - at) return std::nullopt;
    f.bytes = m.substr(at, size);
    at += size;
    fields.push_back(f);
  }
  return fields;
}

/// The longest document encoded in one call; a longer one is encoded in pieces of this size and
/// up to the next whitespace. SentencePiece's Encode takes about 100 bytes of memory per byte.
constexpr size_t kPiece = 64 << 10;

/// Tokens of documents by a SentencePiece model. A document longer than kPiece bytes is encoded
/// in pieces cut before whitespace, in memory bounded by kPiece and the longest stretch without
/// whitespace: the pieces' tokens are the whole document's (a BPE model's exactly; a unigram
/// model's up to float rounding: its Viterbi sums scores in float from the start of the text, so
/// where two segmentations score the same within rounding, which one wins depends on where the
/// text starts). A model that may make a piece across whitespace gets each document whole
/// (why_whole() says why).
class Encoder {
 public:
  /// Loads the serialized model `model`; `name` names it in errors.
  Encoder(const std::string& model, const std::string& name) {
    if (const auto status = sp_.LoadFromSerializedProto(model); !status.ok())
      throw Failure(name + ": not a SentencePiece model: " + status.ToString());
    why_whole_ = choose_cuts(model);
  }
  const sentencepiece::SentencePieceProcessor& processor() const noexcept { return sp_; }
  /// Why documents are encoded whole ("" when long ones are cut at whitespace).
  const std::string& why_whole() const noexcept { return why_whole_; }

  /// Calls `take(ids)` with the tokens of `doc`, in order, a piece at a time.
  template <class Take>
  void encode(std::string_view doc, Take&& take) const {
    while (!doc.empty()) {
      const size_t cut = doc.size() > kPiece ? next_cut(doc, kPiece) : std::string_view::npos;
      take(sp_.EncodeAsIds(doc.substr(0, cut)));
      doc.remove_prefix(cut == std::string_view::npos ? doc.size() : cut);
    }
  }

 private:
  /// The first place at or after `from` where `doc` may be cut (npos: none): before whitespace
  /// that follows a printable ASCII character. (After whitespace, or U+2581 that a normalization
  /// other than nmt_ keeps, the piece before the cut would lose its trailing U+2581.)
  size_t next_cut(std::string_view doc, size_t from) const {
    if (cuts_.empty()) return std::string_view::npos;
    size_t at = doc.find_first_of(cuts_, from);
    while (at != std::string_view::npos && !(doc[at - 1] > ' ' && doc[at - 1] < 0x7f)) at = doc.find_first_of(cuts_, at + 1);
    return at;
  }

  /// Sets cuts_, the bytes a long document may be cut before, from the model's normalizer spec
  /// and its pieces; returns why there are none. A cut before a space S keeps the whole's tokens
  /// when the normalizer maps S to a space in a rule of its own (the built-in ones: their rules
  /// hold no space; the nmt_ ones map \n, \t and \r to a space), writes spaces as U+2581, drops
  /// extra ones and adds one before the text (the piece after the cut then starts with the U+2581
  /// the whole has there), and when no piece holds U+2581 but at its start while U+2581 alone is a
  /// piece: no token spans the cut, nor do two unknown ones merge across it.
  std::string choose_cuts(std::string_view model) {
    std::string name;
    bool dummy_prefix = true, remove_extra = true, escape = true, suffix = false;
    const auto top = proto_fields(model);
    if (!top) return "its model file could not be read";
    for (const auto& f : *top) {
      if (f.number != 2 && f.number != 3) continue;  // ModelProto: 2 trainer_spec, 3 normalizer_spec
      const auto spec = proto_fields(f.bytes);
      if (!spec) return "its model file could not be read";
      for (const auto& g : *spec) {
        if (f.number == 2 && g.number == 24) suffix = g.varint != 0;  // treat_whitespace_as_suffix
        if (f.number == 3 && g.number == 1) name = std::string(g.bytes);
        if (f.number == 3 && g.number == 3) dummy_prefix = g.varint != 0;
        if (f.number == 3 && g.number == 4) remove_extra = g.varint != 0;
        if (f.number == 3 && g.number == 5) escape = g.varint != 0;
      }
    }
    const bool nmt = name == "nmt_nfkc" || name == "nmt_nfkc_cf";
    if (!nmt && name != "nfkc" && name != "nfkc_cf" && name != "identity")
      return "its normalization '" + name + "' is not one of SentencePiece's built-in ones";
    if (!dummy_prefix || !remove_extra || !escape || suffix)
      return "its normalizer does not treat whitespace as SentencePiece's default does (add_dummy_prefix, "
             "remove_extra_whitespaces, escape_whitespaces, whitespace before words)";
    const std::string_view mark = "\xe2\x96\x81";  // U+2581, SentencePiece's whitespace
    const int space = sp_.PieceToId(mark);
    if (sp_.IsUnknown(space) || sp_.IsControl(space) || sp_.IsUnused(space) || sp_.IsByte(space))
      return "U+2581 (whitespace) is no piece of it";
    for (int id = 0; id < sp_.GetPieceSize(); ++id)
      if (sp_.IdToPiece(id).find(mark, 1) != std::string::npos)
        return "its piece '" + sp_.IdToPiece(id) +
               "' reaches across whitespace (a model trained with split_by_whitespace=false)";
    cuts_ = nmt ? " \n\t\r" : " ";
    return "";
  }

  sentencepiece::SentencePieceProcessor sp_;
  std::string cuts_;
  std::string why_whole_;
};

/// Passes on to `to` what is written to it, a line at a time, but for SentencePiece's informational
/// lines ("... LOG(INFO) ..."): its trainer writes its command line before it reads --minloglevel.
/// What goes wrong comes back in its status, or, for a fatal check, in lines this passes on.
class DropInfoLines final : public std::streambuf {
 public:
  explicit DropInfoLines(std::streambuf* to) : to_(to) {}
  ~DropInfoLines() override { pass_line(); }

 protected:
  int overflow(int c) override {
    if (traits_type::eq_int_type(c, traits_type::eof())) return traits_type::not_eof(c);
    line_ += traits_type::to_char_type(c);
    if (c == '\n') pass_line();
    return c;
  }
  int sync() override { return to_->pubsync(); }  // std::cerr syncs after every <<: a line waits for its end

 private:
  void pass_line() {
    if (line_.find("LOG(INFO)") == std::string::npos) to_->sputn(line_.data(), static_cast<std::streamsize>(line_.size()));
    line_.clear();
  }
  std::streambuf* to_;
  std::string line_;
};

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
  sentencepiece::util::Status status;
  {
    DropInfoLines filter(std::cerr.rdbuf());
    struct Restore {
      std::streambuf* was;
      ~Restore() { std::cerr.rdbuf(was); }
    } restore{std::cerr.rdbuf(&filter)};
    status = sentencepiece::SentencePieceTrainer::Train(args, nullptr, &model);
  }
  if (status.ok()) return model;
  const std::string why = status.ToString();
  if (why.find("sentences_.empty()") != std::string::npos)
    throw Failure("no line of the inputs is shorter than " + std::to_string(kTrainLine) +
                  " bytes: SentencePiece trains on lines up to that length and skips longer ones; break the "
                  "text into lines, or tokenize with --model FILE or --bytes");
  // SentencePiece's own words name its numbers: "... Please set it to a value <= 9." and
  // "... smaller than required_chars. 20 vs 34.".
  const auto number_after = [&why](const std::string& text) -> std::string {
    const size_t at = why.find(text);
    if (at == std::string::npos) return "";
    const long n = std::strtol(why.c_str() + at + text.size(), nullptr, 10);
    return n > 0 ? std::to_string(n) : "";
  };
  const std::string vocab = "--vocab " + std::to_string(o.vocab);
  if (const std::string most = number_after("Please set it to a value <= "); !most.empty())
    throw Failure(vocab + " is more pieces than the inputs hold: at most " + most + " for this text; give --vocab " +
                  most + " or less");
  const size_t chars = why.find("smaller than required_chars");
  if (const std::string least = chars == std::string::npos ? "" : number_after(" vs "); !least.empty())
    throw Failure(vocab + " is fewer pieces than the inputs need: at least " + least + " (each distinct character is "
                  "a piece of its own, and so is each special piece); give --vocab " + least + " or more");
  throw Failure("training the SentencePiece model failed: " + why);
}

/// Shards of one split: OUT/PREFIX<split>_NNN.bin, at most `limit` tokens each, each staged in the
/// output folder.
class ShardWriter {
 public:
  ShardWriter(OutputFolder& out, std::string name, int64_t limit, int width)
      : out_(out), name_(std::move(name)), limit_(limit), width_(width) {}
  void add(uint32_t token) {
    if (pending_ == limit_) flush();
    for (int b = 0; b < width_; ++b) body_.push_back(static_cast<unsigned char>(token >> (8 * b)));  // little-endian
    ++pending_;
    ++total_;
  }
  void add(const std::vector<int>& ids) {
    for (int id : ids) add(static_cast<uint32_t>(id));
  }
  void flush() {
    if (pending_ == 0) return;
    char number[32];
    std::snprintf(number, sizeof number, "_%03d.bin", static_cast<int>(files_.size()));
    const std::string name = name_ + number;
    std::vector<int32_t> head(256, 0);
    head[0] = 20240520;
    head[1] = width_ == 2 ? 1 : 2;
    head[2] = static_cast<int32_t>(pending_);
    OutFile file(out_.stage(name));
    file.write(head.data(), 1024);
    file.write(body_.data(), body_.size());
    file.close();
    out_.staged(name);
    files_.push_back((out_.dir() / name).string());
    body_.clear();
    pending_ = 0;
  }
  int64_t total() const noexcept { return total_; }
  const std::vector<std::string>& files() const noexcept { return files_; }

 private:
  OutputFolder& out_;
  std::string name_;
  int64_t limit_;
  int width_;
  std::vector<unsigned char> body_;  // the pending tokens, as the shard holds them
  int64_t pending_ = 0;
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
/// The ids read from stdin, each checked against a vocabulary of `size`.
std::vector<int> read_ids(int size) {
  std::vector<int> ids;
  for (long long id; std::scanf("%lld", &id) == 1;) {
    if (id < 0 || id >= size)
      throw Failure("id " + std::to_string(id) + " is outside the model's " + std::to_string(size) + " pieces");
    ids.push_back(static_cast<int>(id));
  }
  return ids;
}

void print_ids(const std::vector<int>& ids) {
  std::string line;
  for (int id : ids) line += (line.empty() ? "" : " ") + std::to_string(id);
  std::printf("%s\n", line.c_str());
}

/// --encode, --decode, --pieces and --size with a byte-level BPE (GPT-2's).
int translate_bpe(const Options& o) {
  const ByteLevelBpe bpe(o.model);
  if (o.size) {
    std::printf("%d\n", bpe.size());
    return 0;
  }
  if (o.pieces) {
    const std::string text((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    nlohmann::json list = nlohmann::json::array();
    for (const std::string_view piece : bpe.split(text)) list.push_back(std::string(piece));
    std::printf("%s\n", list.dump().c_str());
    return 0;
  }
  if (o.decode) {
    const std::string text = bpe.decode(read_ids(bpe.size()));
    std::fwrite(text.data(), 1, text.size(), stdout);
    return 0;
  }
  // The empty text: the end-of-document id (none printed for a vocabulary without one).
  print_ids(o.encode.empty() ? (bpe.eos() >= 0 ? std::vector<int>{bpe.eos()} : std::vector<int>{}) : bpe.encode(o.encode));
  return 0;
}

int translate(const Options& o) {
  if (o.model.empty()) throw Failure("--encode, --decode, --pieces and --size need --model FILE");
  if (ByteLevelBpe::names_one(o.model)) return translate_bpe(o);
  if (o.pieces) throw Failure("--pieces shows how GPT-2's pattern cuts a text: it needs a byte-level BPE (--model)");
  sentencepiece::SentencePieceProcessor sp;
  if (const auto status = sp.Load(o.model); !status.ok())
    throw Failure(o.model + ": not a SentencePiece model: " + status.ToString());
  if (o.size) {
    std::printf("%d\n", sp.GetPieceSize());
    return 0;
  }
  if (o.decode) {
    std::fputs(sp.DecodeIds(read_ids(sp.GetPieceSize())).c_str(), stdout);
    return 0;
  }
  // The empty text: the end-of-document id, which a new document follows.
  print_ids(o.encode.empty() ? std::vector<int>{std::max(sp.eos_id(), 0)} : sp.EncodeAsIds(o.encode));
  return 0;
}

/// The files of the model the shards are made with, by the names they get beside them, with the
/// paths they are read from (none for bytes, or for a model trained here).
using ModelFiles = std::vector<std::pair<std::string, fs::path>>;

/// Refuses an input that is a file of the tokenization `out` replaces (tk-tokenize never writes
/// over its input), but for the model's own files there, under their own names (a new
/// tokenization with the model the folder holds): those it returns, to be kept.
std::set<std::string> check_inputs(const OutputFolder& out, const Options& o, const ModelFiles& model) {
  std::set<std::string> kept;
  std::vector<std::string> inputs = o.inputs;
  for (const auto& [name, path] : model) {
    if (out.holds(path) && path.filename() == name) kept.insert(path.string());
    inputs.push_back(path.string());
  }
  for (const auto& f : inputs)
    if (out.holds(f) && !kept.count(f))
      throw Failure(f + " is a file of the tokenization in " + o.out + ", which this one replaces: tk-tokenize never "
                    "writes over its input; copy it out of the folder first, or give --out another folder");
  return kept;
}

void stage_file(OutputFolder& out, const std::string& name, const std::string& bytes) {
  OutFile file(out.stage(name));
  file.write(bytes.data(), bytes.size());
  file.close();
  out.staged(name);
}

/// The SentencePiece model of the tokenization: trained on the inputs or given, written beside the
/// shards as tokenizer.model (where tk-sample finds it).
void open_sentencepiece(Options& o, OutputFolder& out, const std::set<std::string>& kept, const Documents& input,
                        std::optional<Encoder>& encoder) {
  const std::string model = o.model.empty() ? train_model(o) : read_file(o.model);
  encoder.emplace(model, o.model.empty() ? "the trained model" : o.model);
  if (kept.count(o.model)) {
    out.keep("tokenizer.model");
  } else {
    stage_file(out, "tokenizer.model", model);
  }
  if (o.model.empty()) o.model = (out.dir() / "tokenizer.model").string();
  const auto& docs = input.docs;
  const bool long_doc = std::any_of(docs.begin(), docs.end(), [](std::string_view d) { return d.size() > kPiece; });
  if (long_doc && !encoder->why_whole().empty())
    std::fprintf(stderr, "tk-tokenize: note: %s: %s, so each document is encoded whole, in memory about 100 times "
                 "its size\n", o.model.c_str(), encoder->why_whole().c_str());
}

/// How documents become tokens: bytes (neither model), a SentencePiece model or GPT-2's BPE.
struct Tokens {
  const Encoder* sentencepiece = nullptr;
  const ByteLevelBpe* bpe = nullptr;
  int vocab = 256, eos = -1;

  /// Adds the tokens of document `i` of `n` to `split`, then the end-of-document id if there is one.
  void add(std::string_view doc, size_t i, size_t n, ShardWriter& split) const {
    if (sentencepiece) {
      sentencepiece->encode(doc, [&split](const std::vector<int>& ids) { split.add(ids); });
    } else if (bpe) {
      try {
        split.add(bpe->encode(doc));
      } catch (const Failure& e) {
        throw Failure("document " + std::to_string(i + 1) + " of " + std::to_string(n) + ": " + e.what());
      }
    } else {
      for (unsigned char c : doc) split.add(c);
    }
    if (eos >= 0) split.add(static_cast<uint32_t>(eos));  // each document ends with the model's end-of-sequence
  }
};

std::string fmt_fraction(double f) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", f);
  return text;
}

/// The documents --validation holds out of `n`: refused where that is none (the default 0.1 of
/// fewer than 10 documents).
size_t held_out(const Options& o, size_t n) {
  const auto held = static_cast<size_t>(std::floor(o.validation * static_cast<double>(n)));
  if (o.validation > 0.0 && held == 0)
    throw Failure("--validation " + fmt_fraction(o.validation) + " holds out no document of " + std::to_string(n) +
                  (n == 1 ? " (the inputs are one document): split them into documents with --separator, or give"
                          : ": give a larger fraction, or") +
                  " --validation 0 for no validation shards");
  return held;
}

/// The shards of the documents, `n_val` of them (held_out) held out for validation, and a summary.
void write_shards(const Options& o, OutputFolder& out, const Documents& input, const Tokens& tokens, size_t n_val) {
  const auto& docs = input.docs;
  const int width = tokens.vocab <= 65536 ? 2 : 4;
  ShardWriter train(out, o.prefix + "train", o.shard_tokens, width), val(out, o.prefix + "val", o.shard_tokens, width);
  for (size_t i = 0; i < docs.size(); ++i) {
    // Held out evenly through the documents (every 1/fraction-th), not from the end, which for
    // several files would be the last files only.
    const bool held = std::floor(static_cast<double>(i + 1) * o.validation) > std::floor(static_cast<double>(i) * o.validation);
    tokens.add(docs[i], i, docs.size(), held ? val : train);
    progress(i + 1, docs.size());
  }
  train.flush();
  val.flush();
  out.commit();
  const int64_t total = train.total() + val.total();
  std::printf("tokenized %zu documents (%lld bytes) into %lld tokens, %.3f tokens per byte; vocabulary %d (%s)\n",
              docs.size(), static_cast<long long>(input.bytes), static_cast<long long>(total),
              static_cast<double>(total) / static_cast<double>(std::max<int64_t>(input.bytes, 1)), tokens.vocab,
              o.bytes ? "bytes" : o.model.c_str());
  std::printf("train: %lld tokens in %zu shard(s); validation: %lld tokens in %zu shard(s) (%zu documents)\n",
              static_cast<long long>(train.total()), train.files().size(), static_cast<long long>(val.total()),
              val.files().size(), n_val);
  for (const auto& f : train.files()) std::printf("wrote %s\n", f.c_str());
  for (const auto& f : val.files()) std::printf("wrote %s\n", f.c_str());
}

int run(Options& o) {
  if (o.encoding || o.decode || o.pieces || o.size) return translate(o);
  if (o.inputs.empty() || o.out.empty()) throw Failure("give the text files and --out FOLDER");
  if (o.bytes == (!o.model.empty() || o.vocab > 0))
    throw Failure("give one of --bytes, --model FILE or --vocab N (train a model)");
  if (!(o.validation >= 0.0 && o.validation < 1.0)) throw Failure("--validation must be in [0, 1)");
  if (o.shard_tokens < 1 || o.shard_tokens > INT32_MAX) throw Failure("--shard-tokens must be in [1, 2^31)");
  if (const auto why = OutputFolder::prefix_error(o.prefix); !why.empty()) throw Failure("--prefix '" + o.prefix + "' " + why);
  const Documents input = documents(o);
  const size_t n_val = held_out(o, input.docs.size());  // refused before the folder is made
  OutputFolder out(o.out);
  std::optional<ByteLevelBpe> bpe;
  if (!o.model.empty() && ByteLevelBpe::names_one(o.model)) bpe.emplace(o.model);
  const ModelFiles files = bpe ? bpe->files() : o.model.empty() ? ModelFiles{} : ModelFiles{{"tokenizer.model", o.model}};
  const std::set<std::string> kept = check_inputs(out, o, files);
  std::optional<Encoder> encoder;
  Tokens tokens;
  if (bpe) {
    // Its files go beside the shards, under the names they were read by, where tk-sample finds them.
    for (const auto& [name, path] : files) {
      if (kept.count(path.string())) {
        out.keep(name);
      } else {
        stage_file(out, name, read_file(path.string()));
      }
    }
    tokens = {nullptr, &*bpe, bpe->size(), bpe->eos()};
  } else if (!o.bytes) {
    open_sentencepiece(o, out, kept, input, encoder);
    tokens = {&*encoder, nullptr, encoder->processor().GetPieceSize(), encoder->processor().eos_id()};
  }
  write_shards(o, out, input, tokens, n_val);
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
  app.add_flag("--size", o.size, "print how many ids --model has (its pieces) and exit");
  app.add_flag("--pieces", o.pieces,
               "print, as a JSON list, the pieces GPT-2's pattern cuts the text read from stdin into (with a "
               "byte-level BPE --model), before any merge, and exit");
  app.add_option("--model", o.model,
                 "tokenize with this model: a SentencePiece .model, or GPT-2's byte-level BPE (a folder with "
                 "vocab.json and merges.txt, or encoder.json and vocab.bpe; or a tokenizer.json)")
      ->check(CLI::ExistingPath);
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
