#include "byte_bpe.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <nlohmann/json.hpp>

#include <array>
#include <climits>
#include <fstream>
#include <sstream>

#include "output_folder.h"

namespace fs = std::filesystem;

namespace tk::tokenize {

namespace {

/// GPT-2's pattern: the contractions, then letters, digits or other characters with the space
/// before them, then whitespace (a run before a non-space keeps its last space for the next piece).
/// Its \s is Python's: Unicode's White_Space (the separators Z, tab to carriage return, U+0085),
/// written out, as PCRE2's \s also takes U+180E.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\t-\r\x{85}\p{Z}\p{L}\p{N}]+)"
    R"(|[\t-\r\x{85}\p{Z}]+(?![^\t-\r\x{85}\p{Z}])|[\t-\r\x{85}\p{Z}]+)";

std::string pcre2_message(int code) {
  PCRE2_UCHAR text[256];
  return pcre2_get_error_message(code, text, sizeof text) < 0 ? "error " + std::to_string(code)
                                                              : std::string(reinterpret_cast<const char*>(text));
}

std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

/// GPT-2's table from bytes to characters: the printable bytes of Latin-1 stand for themselves,
/// the others (controls, space, soft hyphen) for U+0100 onwards, in byte order.
struct ByteTable {
  std::array<std::string, 256> text;      // byte -> its character, in UTF-8
  std::array<int, 512> byte_of{};         // code point (< 512) -> byte, -1 for none
  ByteTable() {
    byte_of.fill(-1);
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const int cp = printable ? b : 256 + extra++;
      text[static_cast<size_t>(b)] = utf8(static_cast<uint32_t>(cp));
      byte_of[static_cast<size_t>(cp)] = b;
    }
  }
};
const ByteTable& byte_table() {
  static const ByteTable table;
  return table;
}

/// The UTF-8 characters of `s`, each as its bytes (s is well-formed: it came through the table).
std::vector<std::string> characters(const std::string& s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

nlohmann::json read_json(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw Failure(file.string() + ": cannot read it");
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw Failure(file.string() + ": not JSON: " + e.what());
  }
}

}  // namespace

struct ByteLevelBpe::Pattern {
  pcre2_code* code = nullptr;
  Pattern() {
    int error = 0;
    PCRE2_SIZE offset = 0;
    code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kGpt2Pattern), PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP,
                         &error, &offset, nullptr);
    if (!code)
      throw Failure("GPT-2's pattern does not compile with this PCRE2: " + pcre2_message(error) + " at " +
                    std::to_string(offset));
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // the interpreter does the same where JIT is not available
  }
  ~Pattern() { pcre2_code_free(code); }
};

bool ByteLevelBpe::names_one(const fs::path& path) {
  return fs::is_directory(path) || path.extension() == ".json";
}

ByteLevelBpe::ByteLevelBpe(const fs::path& path) : pattern_(std::make_unique<Pattern>()) {
  if (!fs::is_directory(path)) {
    read_tokenizer_json(path);
    files_ = {{"tokenizer.json", path}};
  } else if (fs::exists(path / "vocab.json") || fs::exists(path / "merges.txt")) {
    read_vocab_and_merges(path / "vocab.json", path / "merges.txt");
  } else if (fs::exists(path / "encoder.json") || fs::exists(path / "vocab.bpe")) {
    read_vocab_and_merges(path / "encoder.json", path / "vocab.bpe");
  } else if (fs::exists(path / "tokenizer.json")) {
    read_tokenizer_json(path / "tokenizer.json");
    files_ = {{"tokenizer.json", path / "tokenizer.json"}};
  } else {
    throw Failure(path.string() + ": no tokenizer in this folder: it holds none of vocab.json and merges.txt, "
                  "encoder.json and vocab.bpe (GPT-2's byte-level BPE), tokenizer.json");
  }
  for (int id = 0; id < size(); ++id)
    if (pieces_[static_cast<size_t>(id)].empty())
      throw Failure(path.string() + ": the vocabulary has no piece of id " + std::to_string(id) + " (its ids run to " +
                    std::to_string(size() - 1) + " with gaps)");
  // Every byte is a piece: a text of any bytes has tokens.
  for (int b = 0; b < 256; ++b)
    if (!ids_.count(byte_table().text[static_cast<size_t>(b)]))
      throw Failure(path.string() + ": the vocabulary lacks the piece of byte " + std::to_string(b) +
                    " ('" + byte_table().text[static_cast<size_t>(b)] + "'): not a byte-level BPE");
  const auto end = ids_.find("<|endoftext|>");
  eos_ = end == ids_.end() ? -1 : end->second;
  if (eos_ >= 0) added_.insert(eos_);
}

ByteLevelBpe::~ByteLevelBpe() = default;

void ByteLevelBpe::add_piece(const std::string& piece, int id, const std::string& where) {
  if (id < 0 || id >= (1 << 24)) throw Failure(where + ": the piece '" + piece + "' has the id " + std::to_string(id));
  if (static_cast<size_t>(id) >= pieces_.size()) pieces_.resize(static_cast<size_t>(id) + 1);
  if (!pieces_[static_cast<size_t>(id)].empty() && pieces_[static_cast<size_t>(id)] != piece)
    throw Failure(where + ": the id " + std::to_string(id) + " is given to '" + pieces_[static_cast<size_t>(id)] +
                  "' and to '" + piece + "'");
  pieces_[static_cast<size_t>(id)] = piece;
  ids_[piece] = id;
}

void ByteLevelBpe::add_merge(const std::string& left, const std::string& right, const std::string& where) {
  for (const std::string* part : std::initializer_list<const std::string*>{&left, &right, nullptr}) {
    const std::string piece = part ? *part : left + right;
    if (!ids_.count(piece))
      throw Failure(where + ": the merge '" + left + " " + right + "' " + (part ? "joins" : "makes") + " '" + piece +
                    "', which the vocabulary does not hold");
  }
  ranks_[left + " " + right] = merges_++;  // ranked by its place in the list; one listed twice: its last place
}

void ByteLevelBpe::read_vocab_and_merges(const fs::path& vocab, const fs::path& merges) {
  for (const auto& f : {vocab, merges})
    if (!fs::is_regular_file(f)) throw Failure(f.string() + ": missing (a GPT-2 tokenizer is " + vocab.filename().string() +
                                               " and " + merges.filename().string() + ")");
  const nlohmann::json v = read_json(vocab);
  if (!v.is_object()) throw Failure(vocab.string() + ": not an object of pieces and their ids");
  for (const auto& [piece, id] : v.items()) {
    if (!id.is_number_integer()) throw Failure(vocab.string() + ": the id of '" + piece + "' is not an integer");
    add_piece(piece, id.get<int>(), vocab.string());
  }
  std::ifstream in(merges, std::ios::binary);
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || (number == 1 && line.rfind("#version", 0) == 0)) continue;
    const size_t space = line.find(' ');
    if (space == std::string::npos || space == 0 || line.find(' ', space + 1) != std::string::npos)
      throw Failure(merges.string() + ":" + std::to_string(number) + ": not a merge (two pieces and one space): '" + line + "'");
    add_merge(line.substr(0, space), line.substr(space + 1), merges.string() + ":" + std::to_string(number));
  }
  files_ = {{"vocab.json", vocab}, {"merges.txt", merges}};
}

void ByteLevelBpe::read_tokenizer_json(const fs::path& file) {
  const nlohmann::json j = read_json(file);
  const std::string name = file.string();
  const auto model = j.find("model");
  if (model == j.end() || !model->is_object() || model->value("type", "") != "BPE")
    throw Failure(name + ": its model is not a BPE one (model.type \"BPE\"); SentencePiece models are .model files");
  for (const char* unsupported : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (model->contains(unsupported) && !(*model)[unsupported].is_null() && (*model)[unsupported] != "")
      throw Failure(name + ": model." + unsupported + " is set: not GPT-2's byte-level BPE");
  if (model->value("byte_fallback", false) || model->value("ignore_merges", false))
    throw Failure(name + ": model.byte_fallback or model.ignore_merges is set: not GPT-2's byte-level BPE");
  const auto pre = j.find("pre_tokenizer");
  if (pre == j.end() || !pre->is_object() || pre->value("type", "") != "ByteLevel" || pre->value("add_prefix_space", false) ||
      !pre->value("use_regex", true))
    throw Failure(name + ": its pre_tokenizer is not GPT-2's (ByteLevel, with its pattern, no prefix space): "
                  "tk-tokenize reads GPT-2's byte-level BPE");
  if (j.contains("normalizer") && !j["normalizer"].is_null())
    throw Failure(name + ": it has a normalizer; GPT-2's byte-level BPE has none");
  const auto& vocab = (*model)["vocab"];
  if (!vocab.is_object()) throw Failure(name + ": model.vocab is not an object of pieces and their ids");
  for (const auto& [piece, id] : vocab.items()) {
    if (!id.is_number_integer()) throw Failure(name + ": the id of '" + piece + "' is not an integer");
    add_piece(piece, id.get<int>(), name);
  }
  if (j.contains("added_tokens"))
    for (const auto& t : j["added_tokens"])
      if (t.is_object() && t.contains("content") && t.contains("id"))
      {
        add_piece(t["content"].get<std::string>(), t["id"].get<int>(), name + ": added_tokens");
        added_.insert(t["id"].get<int>());
      }
  const auto& merges = (*model)["merges"];
  if (!merges.is_array()) throw Failure(name + ": model.merges is not a list");
  for (size_t i = 0; i < merges.size(); ++i) {
    const auto& m = merges[i];
    const std::string where = name + ": model.merges[" + std::to_string(i) + "]";
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || space == 0) throw Failure(where + ": not a merge: '" + s + "'");
      add_merge(s.substr(0, space), s.substr(space + 1), where);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      add_merge(m[0].get<std::string>(), m[1].get<std::string>(), where);
    } else {
      throw Failure(where + ": not a merge (\"left right\" or [left, right])");
    }
  }
}

const std::vector<int>& ByteLevelBpe::merge(const std::string& piece) const {
  if (const auto hit = cache_.find(piece); hit != cache_.end()) return hit->second;
  std::vector<std::string> word = characters(piece);
  while (word.size() > 1) {
    // The adjacent pair of the lowest rank; all its occurrences are merged, left to right.
    int best = INT_MAX;
    size_t at = 0;
    for (size_t i = 0; i + 1 < word.size(); ++i) {
      const auto r = ranks_.find(word[i] + " " + word[i + 1]);
      if (r != ranks_.end() && r->second < best) best = r->second, at = i;
    }
    if (best == INT_MAX) break;
    const std::string left = word[at], right = word[at + 1];
    std::vector<std::string> merged;
    merged.reserve(word.size());
    for (size_t i = 0; i < word.size(); ++i) {
      if (i + 1 < word.size() && word[i] == left && word[i + 1] == right) {
        merged.push_back(left + right);
        ++i;
      } else {
        merged.push_back(word[i]);
      }
    }
    word = std::move(merged);
  }
  std::vector<int> ids;
  ids.reserve(word.size());
  for (const auto& w : word) ids.push_back(ids_.at(w));  // held: every byte and every merge's result is a piece
  if (cache_.size() > (1u << 20)) cache_.clear();  // bounded: a corpus of unbounded variety
  return cache_.emplace(piece, std::move(ids)).first->second;
}

std::vector<std::string_view> ByteLevelBpe::split(std::string_view text) const {
  std::vector<std::string_view> pieces;
  const std::unique_ptr<pcre2_match_data, void (*)(pcre2_match_data*)> md(
      pcre2_match_data_create_from_pattern(pattern_->code, nullptr), pcre2_match_data_free);
  if (!md) throw Failure("out of memory for PCRE2's match data");
  const auto subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  for (PCRE2_SIZE at = 0; at < text.size();) {
    // The first match checks that the whole text is UTF-8; the later ones need not again.
    const int rc = pcre2_match(pattern_->code, subject, text.size(), at, at == 0 ? 0 : PCRE2_NO_UTF_CHECK, md.get(), nullptr);
    if (rc <= PCRE2_ERROR_UTF8_ERR1 && rc >= PCRE2_ERROR_UTF8_ERR21)
      throw Failure("the text is not UTF-8 at byte " + std::to_string(pcre2_get_startchar(md.get())) + " (" +
                    pcre2_message(rc) + ")");
    if (rc < 0) throw Failure("GPT-2's pattern failed at byte " + std::to_string(at) + ": " + pcre2_message(rc));
    const PCRE2_SIZE* span = pcre2_get_ovector_pointer(md.get());
    pieces.push_back(text.substr(span[0], span[1] - span[0]));
    at = span[1];
  }
  return pieces;
}

std::vector<int> ByteLevelBpe::encode(std::string_view text) const {
  std::vector<int> out;
  std::string piece;
  for (const std::string_view raw : split(text)) {
    piece.clear();
    for (const char c : raw) piece += byte_table().text[static_cast<unsigned char>(c)];
    const std::vector<int>& ids = merge(piece);
    out.insert(out.end(), ids.begin(), ids.end());
  }
  return out;
}

std::string ByteLevelBpe::decode(const std::vector<int>& ids) const {
  std::string out;
  for (int id : ids) {
    if (id < 0 || id >= size()) throw Failure("id " + std::to_string(id) + " is outside the vocabulary of " + std::to_string(size()));
    const std::string& piece = pieces_[static_cast<size_t>(id)];
    if (added_.count(id)) {  // an added token is its own text, not GPT-2's characters for bytes
      out += piece;
      continue;
    }
    for (size_t i = 0; i < piece.size();) {
      const auto c = static_cast<unsigned char>(piece[i]);
      uint32_t cp = c;
      size_t n = 1;
      if (c >= 0xC0 && c < 0xE0 && i + 1 < piece.size()) {
        cp = ((c & 0x1Fu) << 6) | (static_cast<unsigned char>(piece[i + 1]) & 0x3Fu);
        n = 2;
      }
      const int b = cp < 512 ? byte_table().byte_of[cp] : -1;
      if (b < 0) {
        out.append(piece, i, n);  // no character of GPT-2's table: its own bytes
      } else {
        out += static_cast<char>(b);
      }
      i += n;
    }
  }
  return out;
}

}  // namespace tk::tokenize
