#pragma once
// GPT-2's tokenizer: byte-level BPE. The text is cut into pieces by GPT-2's pattern (contractions,
// runs of letters, of digits, of other characters, each with the space before it, and whitespace),
// each piece's UTF-8 bytes are written as printable characters (one per byte, GPT-2's table), and
// the pieces are merged pairwise, the lowest-ranked merge first, until no listed merge is left.
#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace tk::tokenize {

class ByteLevelBpe {
 public:
  /// Whether `path` names a byte-level BPE tokenizer rather than a SentencePiece model: a
  /// tokenizer.json (any .json), or a folder (which must hold vocab.json and merges.txt, or
  /// encoder.json and vocab.bpe as OpenAI published GPT-2's).
  static bool names_one(const std::filesystem::path& path);
  /// Reads the tokenizer `path` names (see names_one). Throws Failure naming the file and what in
  /// it is wrong: not JSON, no BPE model, a merge whose parts or result are not in the vocabulary,
  /// an id given twice, a pre-tokenizer other than GPT-2's byte-level one.
  explicit ByteLevelBpe(const std::filesystem::path& path);
  ~ByteLevelBpe();
  ByteLevelBpe(const ByteLevelBpe&) = delete;
  ByteLevelBpe& operator=(const ByteLevelBpe&) = delete;

  /// The ids of `text` (UTF-8; a Failure says where it is not). "<|endoftext|>" in the text is
  /// text like any other, as in GPT-2's own encoder: the end of a document is eos().
  std::vector<int> encode(std::string_view text) const;
  /// The pieces GPT-2's pattern cuts `text` into, before any merge (views into `text`).
  std::vector<std::string_view> split(std::string_view text) const;
  /// The bytes the ids stand for (a sequence cut inside a character gives that character's bytes
  /// so far). Throws Failure for an id outside the vocabulary.
  std::string decode(const std::vector<int>& ids) const;
  /// The vocabulary's size (the largest id + 1).
  int size() const noexcept { return static_cast<int>(pieces_.size()); }
  /// The id of "<|endoftext|>", GPT-2's end of a document; -1 when the vocabulary has none.
  int eos() const noexcept { return eos_; }
  /// The files that hold this tokenizer, by the names they get beside the shards (vocab.json and
  /// merges.txt, or tokenizer.json), with their paths now.
  const std::vector<std::pair<std::string, std::filesystem::path>>& files() const noexcept { return files_; }

 private:
  void read_vocab_and_merges(const std::filesystem::path& vocab, const std::filesystem::path& merges);
  void read_tokenizer_json(const std::filesystem::path& file);
  void add_piece(const std::string& piece, int id, const std::string& where);
  void add_merge(const std::string& left, const std::string& right, const std::string& where);
  /// The ids of one piece of the pattern, its bytes already written as characters.
  const std::vector<int>& merge(const std::string& piece) const;

  std::unordered_map<std::string, int> ids_;  // piece (GPT-2's characters for its bytes) -> id
  std::vector<std::string> pieces_;           // id -> piece
  std::unordered_map<std::string, int> ranks_;  // "left right" -> the merge's rank (its place in the list)
  int merges_ = 0;                             // merges read so far
  std::set<int> added_;                        // ids of added tokens (<|endoftext|>, ...): decoded as their text
  int eos_ = -1;
  std::vector<std::pair<std::string, std::filesystem::path>> files_;
  struct Pattern;
  std::unique_ptr<Pattern> pattern_;
  mutable std::unordered_map<std::string, std::vector<int>> cache_;
};

}  // namespace tk::tokenize
