// tk-sample: text from a language model. Rebuilds a run's model from the recipe.toml its output
// folder holds and loads its weights.safetensors (or builds a recipe's model with the weights it
// starts from, such as a published checkpoint), and continues a prompt token by token
// (temperature, top-k, a seed), decoding with the run's tokenizer: its SentencePiece model,
// GPT-2's byte-level BPE or bytes. --logits writes the prompt's logits instead.
#include <ATen/core/Generator.h>
#include <ATen/CPUGeneratorImpl.h>
#include <spdlog/spdlog.h>
#include <toml++/toml.h>
#include <torch/torch.h>
#include <tk/recipe.h>
#include <tk/tensor_io.h>
#include <tk/trainer.h>

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "../cli_parse.h"
#include "../model_of.h"

namespace fs = std::filesystem;

namespace {

struct Options {
  std::string run, prompt, ids, logits, tokenizer, weights, device = "cpu";
  int64_t tokens = 200, top_k = 0;
  double temperature = 1.0;
  uint64_t seed = 0;
};

/// Runs `cmd` and returns its standard output; fails with its exit status otherwise.
std::string output_of(const std::string& cmd, const std::string& input = "") {
  const fs::path in = fs::temp_directory_path() / ("tk-sample-" + std::to_string(::getpid()) + ".ids");
  if (!input.empty()) std::ofstream(in) << input;
  FILE* p = ::popen((cmd + (input.empty() ? "" : " < '" + in.string() + "'")).c_str(), "r");
  if (!p) throw std::runtime_error("cannot run " + cmd);
  std::string out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  const int status = ::pclose(p);
  std::error_code ec;
  fs::remove(in, ec);
  if (status != 0) throw std::runtime_error("tk-tokenize failed (" + cmd + ")");
  return out;
}

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

/// Encodes and decodes the run's tokens: bytes, or a SentencePiece model or byte-level BPE through
/// tk-tokenize (beside this program). SentencePiece carries its own protobuf, which clashes with
/// LibTorch's in one process.
class Tokenizer {
 public:
  explicit Tokenizer(std::string model) : model_(std::move(model)) {
    if (model_.empty()) return;
    tool_ = (fs::read_symlink("/proc/self/exe").parent_path() / "tk-tokenize").string();
    if (!fs::exists(tool_)) throw std::runtime_error("tk-tokenize is not beside tk-sample (" + tool_ + ")");
    if (!fs::exists(model_)) throw std::runtime_error(model_ + ": no such file or folder");
    start_ = ids(output_of(shell_quote(tool_) + " --model " + shell_quote(model_) + " --encode ''"));  // loads the model
  }
  std::vector<int64_t> encode(const std::string& text) const {
    if (model_.empty()) {  // bytes as 0-255 (a char may be signed)
      std::vector<int64_t> out;
      for (unsigned char c : text) out.push_back(c);
      return out;
    }
    return ids(output_of(shell_quote(tool_) + " --model " + shell_quote(model_) + " --encode " + shell_quote(text)));
  }
  std::string decode(const std::vector<int64_t>& ids) const {
    if (model_.empty()) return std::string(ids.begin(), ids.end());
    std::string list;
    for (int64_t id : ids) list += std::to_string(id) + " ";
    return output_of(shell_quote(tool_) + " --model " + shell_quote(model_) + " --decode", list + "\n");
  }
  bool bytes() const noexcept { return model_.empty(); }
  /// How many ids it decodes: 0 to size() - 1 (asked of tk-tokenize when first needed).
  int64_t size() const {
    if (model_.empty()) return 256;
    if (size_ == 0) {
      const auto said = ids(output_of(shell_quote(tool_) + " --model " + shell_quote(model_) + " --size"));
      if (said.size() != 1 || said.front() < 1) throw std::runtime_error(tool_ + " --size: no count of ids for " + model_);
      size_ = said.front();
    }
    return size_;
  }
  /// What a new document follows: a newline, or the model's end-of-document id.
  std::vector<int64_t> start() const { return model_.empty() ? std::vector<int64_t>{'\n'} : start_; }

 private:
  static std::vector<int64_t> ids(const std::string& line) {
    std::vector<int64_t> out;
    std::istringstream in(line);
    for (int64_t id; in >> id;) out.push_back(id);
    return out;
  }
  std::string model_, tool_;
  std::vector<int64_t> start_;
  mutable int64_t size_ = 0;
};


/// The tokenizer of the run: the one given, else the data set's (text at byte level: bytes; token
/// shards: the tokenizer tk-tokenize wrote beside them, or bytes for a vocabulary of 256).
std::string find_tokenizer(const Options& o, const tk::Recipe& recipe, int64_t vocab) {
  if (!o.tokenizer.empty()) return o.tokenizer == "bytes" ? "" : o.tokenizer;
  const tk::DataKeys data = tk::data_keys(recipe);
  if (data.name == "text" && data.level == "char")
    throw std::runtime_error("the run reads characters (data.level = \"char\"), whose numbering tk-sample does not "
                             "rebuild; give --tokenizer");
  if (data.name != "tokens") return "";
  // A BPE's vocab.json and merges.txt: their folder is the model.
  const auto files = tk::tokenizer_files(recipe);
  if (!files.empty()) return (files.size() == 1 ? files.front() : files.front().parent_path()).string();
  // Bytes: a vocabulary of 256, or shards tk-tokenize wrote with no model beside them (--bytes);
  // shards of fewer tokens from elsewhere, or moved away, may be of a small model's ids.
  const auto shards = tk::files_named(recipe, data.train);
  std::error_code ec;
  const bool of_bytes = vocab == 256 || (vocab < 256 && !shards.empty() &&
                                         fs::is_regular_file(fs::path(shards.front()).parent_path() / "tokenize.json", ec));
  if (!of_bytes)
    throw std::runtime_error("no tokenizer beside the run's shards" +
                             std::string(data.pretrained.empty() ? "" : " or in its pretrained checkpoint's folder") +
                             " (tokenizer.model, tokenizer.json, or vocab.json and merges.txt): give --tokenizer" +
                             (vocab < 256 ? " (--tokenizer bytes for shards of bytes)" : ""));
  return "";
}

/// The next token after `logits` (the last position's), one of the first `ids`: argmax at
/// temperature 0, else sampled from the softmax of logits / temperature over the top_k largest
/// (all when 0).
int64_t next_token(at::Tensor logits, int64_t ids, const Options& o, at::Generator& gen) {
  logits = logits.narrow(0, 0, std::min(ids, logits.size(0))).to(at::kDouble).cpu();
  if (o.temperature == 0.0) return logits.argmax().item<int64_t>();
  logits = logits / o.temperature;
  if (o.top_k > 0 && o.top_k < logits.numel()) {
    const double kth = std::get<0>(logits.topk(o.top_k)).min().item<double>();
    logits = logits.masked_fill(logits < kth, -std::numeric_limits<double>::infinity());
  }
  return at::multinomial(logits.softmax(0), 1, false, gen).item<int64_t>();
}

/// A token shard of the same sequence many times, in its own temporary folder, removed with it:
/// what a run of data 'tokens' whose shards are gone is built from (its model needs the vocabulary
/// and the context, not the examples; its plan, an epoch that holds a step: 16M tokens of them).
class StandInShard {
 public:
  StandInShard(int64_t vocab, int64_t seq_len) : vocab_(vocab) {
    std::string dir = (fs::temp_directory_path() / "tk-sample-XXXXXX").string();
    if (!::mkdtemp(dir.data())) throw std::runtime_error("cannot make a temporary folder in " + fs::temp_directory_path().string());
    dir_ = dir;
    try {
      write(seq_len);
    } catch (...) {
      std::error_code ec;
      fs::remove_all(dir_, ec);
      throw;
    }
  }
  ~StandInShard() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  StandInShard(const StandInShard&) = delete;
  StandInShard& operator=(const StandInShard&) = delete;
  fs::path file() const { return dir_ / "stand_in.bin"; }
  /// The recipe's [data] pointed at this shard.
  tk::Recipe recipe(tk::Recipe r) const {
    r.apply_override("data.train=\"" + file().string() + "\"");
    r.apply_override("data.validation=\"\"");
    r.apply_override("data.vocab=" + std::to_string(vocab_));
    return r;
  }

 private:
  void write(int64_t seq_len) const {
    const int32_t version = vocab_ > 65536 ? 2 : 1;
    const int64_t width = version == 1 ? 2 : 4, copies = std::max<int64_t>((int64_t{16} << 20) / seq_len, 1);
    std::string sequence;
    for (int64_t i = 0; i < seq_len; ++i) {
      const uint32_t id = static_cast<uint32_t>(i % vocab_);
      sequence.append(reinterpret_cast<const char*>(&id), static_cast<size_t>(width));  // little-endian (the shards' order)
    }
    std::vector<int32_t> header(256, 0);
    header[0] = 20240520;
    header[1] = version;
    header[2] = static_cast<int32_t>(seq_len * copies + 1);
    std::ofstream out(file(), std::ios::binary);
    out.write(reinterpret_cast<const char*>(header.data()), 1024);
    for (int64_t c = 0; c < copies; ++c) out.write(sequence.data(), static_cast<std::streamsize>(sequence.size()));
    const uint32_t last = 0;
    out.write(reinterpret_cast<const char*>(&last), static_cast<std::streamsize>(width));  // the last target
    if (!out.flush()) throw std::runtime_error("cannot write " + file().string());
  }

  fs::path dir_;
  int64_t vocab_;
};

/// For a run of data 'tokens' whose data set cannot be made (its shards moved or deleted): the
/// stand-in shard its model is built from, with the vocabulary and context its weights file
/// records; null for other runs. `why` is what making the data set said.
std::unique_ptr<StandInShard> stand_in_for(const tk::Recipe& recipe, const fs::path& weights, const std::string& why) {
  const tk::DataKeys data = tk::data_keys(recipe);
  if (data.name != "tokens") return nullptr;
  bool train = false, validation = false;
  tk::files_named(recipe, data.train, &train);
  tk::files_named(recipe, data.validation, &validation);
  if (train && validation) return nullptr;  // the shards are there: what failed is something else
  const auto unknown = [&](const std::string& what) {
    return std::runtime_error(why + "\n" + weights.string() + " " + what + ": put the run's shards back where its "
                              "recipe.toml names them");
  };
  if (weights.extension() != ".safetensors") throw unknown("is no safetensors file, whose header would say the model's shape");
  tk::Metadata meta;
  try {
    meta = tk::load_safetensors_metadata(weights);
  } catch (const std::exception& e) {
    throw unknown(std::string("cannot say the model's shape (") + e.what() + ")");
  }
  const auto number = [&](const char* key) {  // a positive whole number, or 0
    const auto it = meta.find(key);
    if (it == meta.end() || it->second.empty() || it->second.find_first_not_of("0123456789") != std::string::npos) return 0LL;
    return std::atoll(it->second.c_str());
  };
  const long long vocab = number("trainkit.vocab"), context = number("trainkit.input_shape");
  if (vocab < 1 || context < 1)
    throw unknown("does not record the vocabulary and context its model was built for (an older trainkit wrote it)");
  std::fprintf(stderr, "tk-sample: the run's data cannot be read (%s); its model is built from what %s records: a "
               "vocabulary of %lld tokens and a context of %lld\n", why.c_str(), weights.c_str(), vocab, context);
  return std::make_unique<StandInShard>(vocab, context);
}

/// The prompt's token ids: --ids as given, else --prompt encoded (a new document without one).
std::vector<int64_t> prompt_ids(const Options& o, const Tokenizer& tok, int64_t vocab) {
  std::vector<int64_t> ids;
  if (!o.ids.empty()) {
    std::istringstream in(o.ids);
    std::string word;
    while (in >> word) {
      size_t used = 0;
      long long id = -1;
      try {
        id = std::stoll(word, &used);
      } catch (const std::exception&) {
      }
      if (used != word.size()) throw std::runtime_error("--ids: '" + word + "' is not a token id");
      ids.push_back(id);
    }
  } else {
    ids = o.prompt.empty() ? tok.start() : tok.encode(o.prompt);
  }
  if (ids.empty())
    throw std::runtime_error("nothing to continue: " + std::string(o.prompt.empty() && o.ids.empty() ? "the tokenizer has no "
                             "end-of-document token to start a new document with; give --prompt" : "the prompt has no tokens"));
  for (int64_t id : ids)
    if (id < 0 || id >= vocab)
      throw std::runtime_error("the prompt's token " + std::to_string(id) + " is outside the model's vocabulary of " +
                               std::to_string(vocab));
  return ids;
}

/// The text of ids[given:] as it follows ids[:given]: the whole sequence decoded, less the prompt's
/// text. (A SentencePiece piece that starts a word carries its space, which decoding drops at the
/// start of a text: decoded alone, the first piece after the prompt would lose it.)
std::string continuation(const Tokenizer& tok, const std::vector<int64_t>& ids, size_t given) {
  const std::vector<int64_t> after(ids.begin() + static_cast<std::ptrdiff_t>(given), ids.end());
  if (tok.bytes() || after.empty()) return tok.decode(after);
  const std::string whole = tok.decode(ids), head = tok.decode(std::vector<int64_t>(ids.begin(), ids.begin() +
                                                                                   static_cast<std::ptrdiff_t>(given)));
  return whole.compare(0, head.size(), head) == 0 ? whole.substr(head.size()) : tok.decode(after);
}

int sample(const Options& o) {
  // A run's output folder (its recipe.toml and weights), or a recipe (the weights it starts from).
  const tk::RunOrRecipe source(o.run, o.weights);
  const fs::path& dir = source.dir;
  const tk::Recipe& recipe = source.recipe;
  const fs::path& weights = source.weights;
  std::fputs(source.untrained_note("tk-sample").c_str(), stderr);
  spdlog::set_level(spdlog::level::warn);
  std::unique_ptr<tk::Trainer> built;
  std::unique_ptr<StandInShard> stand_in;
  try {
    built = tk::build_model(recipe, o.device);
  } catch (const std::exception& e) {
    if (!weights.empty()) stand_in = stand_in_for(recipe, weights, e.what());
    if (!stand_in) throw;
    built = tk::build_model(stand_in->recipe(recipe), o.device);
  }
  tk::Trainer& trainer = *built;
  if (!trainer.data().info.next_token)
    throw std::runtime_error("the run in " + dir.string() + " is no language model (its data set's targets are not "
                             "the next tokens): tk-sample continues text with runs of data 'text' or 'tokens'");
  tk::Model& model = trainer.model();
  if (!weights.empty()) tk::load_weights(model, weights);
  torch::NoGradGuard no_grad;
  model.eval();
  const int64_t vocab = trainer.data().info.vocab;
  // Logits of given ids need no tokenizer; a sample is decoded with the run's.
  const Tokenizer tok(o.ids.empty() || o.logits.empty() ? find_tokenizer(o, recipe, vocab) : std::string());
  // A model of bytes may know fewer than 256 (the largest its text held, plus one): it writes none
  // beyond them, and a prompt's byte beyond them is refused. One of more tokens is not of bytes.
  if (tok.bytes() && vocab > 256 && o.logits.empty())
    throw std::runtime_error("the model's vocabulary is " + std::to_string(vocab) + " tokens, more than the 256 " +
                             (o.tokenizer == "bytes" ? "bytes --tokenizer bytes gives" : "bytes the run's data reads") +
                             ": give --tokenizer, the tokenizer of its data");
  const auto& shape = trainer.data().info.input_shape;
  const int64_t context = shape.empty() ? 1024 : shape.front();
  // A vocabulary padded beyond the tokenizer's ids (GPT-2's 50257 to 50304) has ids nothing decodes:
  // never sampled.
  const int64_t decodable = o.logits.empty() ? std::min(vocab, tok.size()) : vocab;
  if (decodable < vocab && vocab - decodable > 128)
    std::fprintf(stderr, "tk-sample: note: the tokenizer has %lld ids, the model's vocabulary %lld: ids from %lld up "
                 "are never sampled (is it the tokenizer of the run's data?)\n", static_cast<long long>(decodable),
                 static_cast<long long>(vocab), static_cast<long long>(decodable));
  std::vector<int64_t> ids = prompt_ids(o, tok, vocab);
  const size_t given = ids.size();
  at::Generator gen = at::detail::createCPUGenerator(o.seed);
  const at::Device device = model.parameters().front().device();
  if (!o.logits.empty()) {  // the prompt's logits at every position, in the model's dtype
    if (ids.size() > static_cast<size_t>(context))
      throw std::runtime_error("--logits: the prompt has " + std::to_string(ids.size()) + " tokens, more than the context of " +
                               std::to_string(context));
    const auto x = torch::tensor(ids, torch::kLong).unsqueeze(0).to(device);
    tk::save_safetensors(o.logits, {{"logits", model.forward(x).select(0, 0).cpu().contiguous()}});
    return 0;
  }
  for (int64_t i = 0; i < o.tokens; ++i) {
    const size_t from = ids.size() > static_cast<size_t>(context) ? ids.size() - static_cast<size_t>(context) : 0;
    const auto x = torch::tensor(std::vector<int64_t>(ids.begin() + static_cast<std::ptrdiff_t>(from), ids.end()),
                                 torch::kLong).unsqueeze(0).to(device);
    ids.push_back(next_token(model.forward(x).select(0, 0).select(0, -1), decodable, o, gen));
  }
  std::string text = continuation(tok, ids, given);
  // A prompt's trailing space the tokenizer dropped comes back as the next piece's: said once.
  if (!o.prompt.empty() && std::isspace(static_cast<unsigned char>(o.prompt.back())) && !text.empty() && text.front() == ' ')
    text.erase(0, 1);
  std::printf("%s%s\n", o.prompt.c_str(), text.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tk-sample: text from a language model trained by tk-run (its output folder)"};
  Options o;
  app.add_option("run", o.run, "the run's output folder (recipe.toml, weights.safetensors), or a recipe: its model "
                               "with the weights it starts from ([model] pretrained or init)")->required()
      ->check(CLI::ExistingPath);
  app.add_option("-p,--prompt", o.prompt, "text to continue (\"\": start a new document)");
  app.add_option("--ids", o.ids, "the prompt as token ids, separated by spaces (instead of --prompt)")
      ->excludes(app.get_option("--prompt"));
  app.add_option("--logits", o.logits, "write the prompt's logits at every position ([tokens, vocabulary], the model's "
                                       "dtype) to this safetensors file, as 'logits', instead of sampling");
  app.add_option("-n,--tokens", o.tokens, "tokens to write")->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  app.add_option("-t,--temperature", o.temperature, "softmax temperature in [0, 100]; 0 takes the likeliest token")
      ->check(CLI::Validator(
          [](std::string& v) {
            const double t = std::strtod(v.c_str(), nullptr);  // CLI11's Range lets a NaN through
            return t >= 0.0 && t <= 100.0 ? std::string() : "is " + v + ", not a number in [0, 100]";
          },
          "in [0, 100]"));
  app.add_option("-k,--top-k", o.top_k, "sample among the k likeliest tokens (0: all)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 24));
  app.add_option("-s,--seed", o.seed, "seed of the sampling: the same seed writes the same text");
  app.add_option("--tokenizer", o.tokenizer,
                 "a SentencePiece .model, GPT-2's byte-level BPE (a folder with vocab.json and merges.txt, or a "
                 "tokenizer.json), or \"bytes\" (default: the run's)");
  app.add_option("--weights", o.weights,
                 "weights to load: a .safetensors or .pt file, or a checkpoint (its folder or model.pt; a sharded "
                 "run's shares merged) (default: RUN/weights.safetensors)");
  app.add_option("--device", o.device, "where the model runs: cpu, cuda, cuda:N");
  if (auto rc = tk::parse_command_line(app, argc, argv, "tk-sample")) return *rc;
  try {
    return sample(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tk-sample: %s\n", tk::message_of(e).c_str());
    return 1;
  }
}
