// Published GPT checkpoints read into trainkit's names: Hugging Face GPT-2 and Llama folders, and
// llm.c's GPT-2 .bin.
#include "published.h"

#include <nlohmann/json.hpp>

#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>

#include <tk/error.h>

namespace tk::models {

double GptShape::parameters() const {
  const double c = static_cast<double>(width), d = static_cast<double>(head_dim());
  const double h = static_cast<double>(heads), kv = static_cast<double>(kv_heads), i = static_cast<double>(mlp_width);
  const double b = bias ? 1.0 : 0.0;
  const double norm = rms_norm || !bias ? c : 2 * c;
  const double qkv = c * (h + 2 * kv) * d + b * (h + 2 * kv) * d, proj = c * c + b * c;
  const double ffn = (mlp == "swiglu" ? 2.0 : 1.0) * (c * i + b * i) + i * c + b * c;
  return static_cast<double>(rows) * c * (tied ? 1 : 2) + (rotary ? 0.0 : static_cast<double>(context) * c) + norm +
         static_cast<double>(layers) * (qkv + proj + ffn + 2 * norm);
}

double GptShape::forward_flops(double t) const {
  const double c = static_cast<double>(width), d = static_cast<double>(head_dim());
  const double qkv = c * static_cast<double>(heads + 2 * kv_heads) * d;
  const double ffn = (mlp == "swiglu" ? 3.0 : 2.0) * c * static_cast<double>(mlp_width);
  // Each block's matrix products, and its attention against all t positions (scores and values).
  return static_cast<double>(layers) * (2.0 * (qkv + c * c + ffn) + 4.0 * t * c) + 2.0 * c * static_cast<double>(vocab);
}

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

/// Problems found while reading, said together: a line each.
struct Problems {
  std::vector<std::string> lines;
  void add(std::string line) { lines.push_back(std::move(line)); }
  void raise(const std::string& what) const {
    if (lines.empty()) return;
    std::string text = what;
    const size_t shown = std::min<size_t>(lines.size(), 20);
    for (size_t i = 0; i < shown; ++i) text += "\n  " + lines[i];
    if (lines.size() > shown) text += "\n  ... and " + std::to_string(lines.size() - shown) + " more";
    throw Error(text);
  }
};

// ---------------------------------------------------------------- configuration

/// A config.json's fields, read with the file named in every complaint.
class Config {
 public:
  explicit Config(const fs::path& file) : file_(file.string()) {
    std::ifstream in(file);
    if (!in) throw Error(file_ + ": cannot read it");
    try {
      j_ = json::parse(in);
    } catch (const json::exception& e) {
      throw Error(file_ + ": not JSON (" + e.what() + ")");
    }
    if (!j_.is_object()) throw Error(file_ + ": expected a JSON object");
  }
  std::string model_type() const { return j_.value("model_type", std::string()); }
  const std::string& file() const { return file_; }

  int64_t count(const char* key, std::optional<int64_t> def = std::nullopt) {
    const json* v = find(key);
    if (!v && def) return *def;
    if (!v || !v->is_number_integer() || v->get<int64_t>() < 1) {
      problems.add(std::string("'") + key + "': expected a whole number >= 1, got " + (v ? v->dump() : "nothing"));
      return 1;
    }
    return v->get<int64_t>();
  }
  double number(const char* key, double def) {
    const json* v = find(key);
    if (!v) return def;
    if (!v->is_number() || !(v->get<double>() > 0.0)) {
      problems.add(std::string("'") + key + "': expected a number > 0, got " + v->dump());
      return def;
    }
    return v->get<double>();
  }
  bool flag(const char* key, bool def) {
    const json* v = find(key);
    if (!v) return def;
    if (!v->is_boolean()) {
      problems.add(std::string("'") + key + "': expected true or false, got " + v->dump());
      return def;
    }
    return v->get<bool>();
  }
  std::string text(const char* key, const std::string& def) {
    const json* v = find(key);
    if (!v) return def;
    if (!v->is_string()) {
      problems.add(std::string("'") + key + "': expected a string, got " + v->dump());
      return def;
    }
    return v->get<std::string>();
  }
  /// A field that changes the computation in a way trainkit's GPT does not: refused unless absent,
  /// null or `honoured`.
  void only(const char* key, const json& honoured, const std::string& why) {
    const json* v = find(key);
    if (v && !v->is_null() && *v != honoured)
      problems.add(std::string("'") + key + "' = " + v->dump() + ": " + why + " (trainkit honours " + honoured.dump() + ")");
  }
  /// A field that must be absent or null.
  void absent(const char* key, const std::string& why) {
    const json* v = find(key);
    if (v && !v->is_null()) problems.add(std::string("'") + key + "' = " + v->dump() + ": " + why);
  }
  const json* find(const char* key) const {
    auto it = j_.find(key);
    return it == j_.end() ? nullptr : &*it;
  }

  Problems problems;

 private:
  std::string file_;
  json j_;
};

GptShape gpt2_shape(Config& c) {
  GptShape s;
  s.vocab = s.rows = c.count("vocab_size");
  s.context = c.count("n_positions");
  s.width = c.count("n_embd");
  s.heads = s.kv_heads = c.count("n_head");
  s.layers = c.count("n_layer");
  const json* inner = c.find("n_inner");
  s.mlp_width = inner && !inner->is_null() ? c.count("n_inner") : 4 * s.width;
  const std::string act = c.text("activation_function", "gelu_new");
  if (act == "gelu_new" || act == "gelu_pytorch_tanh" || act == "gelu_fast") s.mlp = "gelu_tanh";
  else if (act == "gelu") s.mlp = "gelu";
  else c.problems.add("'activation_function' = \"" + act + "\": trainkit's GPT has GELU, exact (\"gelu\") or in its tanh form (\"gelu_new\")");
  s.norm_eps = c.number("layer_norm_epsilon", 1e-5);
  s.tied = c.flag("tie_word_embeddings", true);
  c.only("scale_attn_weights", true, "attention scores are always scaled by 1/sqrt(head width)");
  c.only("scale_attn_by_inverse_layer_idx", false, "scores are not scaled by the layer's index");
  c.only("add_cross_attention", false, "a decoder-only model has no cross-attention");
  return s;
}

GptShape llama_shape(Config& c) {
  GptShape s;
  s.vocab = s.rows = c.count("vocab_size");
  s.width = c.count("hidden_size");
  s.mlp_width = c.count("intermediate_size");
  s.layers = c.count("num_hidden_layers");
  s.heads = c.count("num_attention_heads");
  s.kv_heads = c.count("num_key_value_heads", s.heads);
  s.context = c.count("max_position_embeddings", 2048);
  s.norm_eps = c.number("rms_norm_eps", 1e-6);
  s.rotary_base = c.number("rope_theta", 10000.0);
  s.tied = c.flag("tie_word_embeddings", false);
  s.rotary = s.rms_norm = true;
  s.mlp = "swiglu";
  s.bias = false;
  c.only("hidden_act", "silu", "the MLP is SwiGLU, whose gate is SiLU");
  c.only("attention_bias", false, "the attention's projections have no bias");
  c.only("mlp_bias", false, "the MLP's projections have no bias");
  c.absent("rope_scaling", "rotary angles are not rescaled (no long-context scaling)");
  if (const json* hd = c.find("head_dim"); hd && !hd->is_null() && s.heads > 0 &&
                                             (!hd->is_number_integer() || hd->get<int64_t>() * s.heads != s.width))
    c.problems.add("'head_dim' = " + hd->dump() + ": trainkit's heads are hidden_size / num_attention_heads = " +
                   std::to_string(s.width / s.heads) + " wide");
  if (s.heads > 0 && s.kv_heads > 0 && s.heads % s.kv_heads != 0)
    c.problems.add("'num_key_value_heads' = " + std::to_string(s.kv_heads) + " does not divide num_attention_heads = " +
                   std::to_string(s.heads));
  return s;
}

// ---------------------------------------------------------------- names

/// Where a checkpoint's tensor goes: a trainkit parameter, or a piece of one (`slot` of `slots`,
/// joined along the first dimension), transposed or not. An empty name: a tensor to skip.
struct Target {
  std::string name;
  int slot = 0, slots = 1;
  bool transpose = false;
};

/// Hugging Face GPT-2's name -> trainkit's (GPT2Model's names, or GPT2LMHeadModel's under
/// "transformer."); std::nullopt for a name GPT-2 does not have. Its Conv1D keeps weights as
/// [in, out], transposed from a Linear's.
std::optional<Target> gpt2_target(const std::string& name, int64_t layers) {
  static const std::regex layer(R"(^(?:transformer\.)?h\.(\d+)\.(.+)$)");
  static const std::map<std::string, Target> per_layer = {
      {"ln_1.weight", {"ln1.weight"}}, {"ln_1.bias", {"ln1.bias"}},
      {"attn.c_attn.weight", {"attn.qkv.weight", 0, 1, true}}, {"attn.c_attn.bias", {"attn.qkv.bias"}},
      {"attn.c_proj.weight", {"attn.proj.weight", 0, 1, true}}, {"attn.c_proj.bias", {"attn.proj.bias"}},
      {"ln_2.weight", {"ln2.weight"}}, {"ln_2.bias", {"ln2.bias"}},
      {"mlp.c_fc.weight", {"fc.weight", 0, 1, true}}, {"mlp.c_fc.bias", {"fc.bias"}},
      {"mlp.c_proj.weight", {"proj.weight", 0, 1, true}}, {"mlp.c_proj.bias", {"proj.bias"}},
      {"attn.bias", {""}}, {"attn.masked_bias", {""}}};  // the causal mask, a buffer
  static const std::map<std::string, Target> top = {{"wte.weight", {"wte.weight"}}, {"wpe.weight", {"wpe.weight"}},
                                                    {"ln_f.weight", {"ln_f.weight"}}, {"ln_f.bias", {"ln_f.bias"}}};
  std::smatch m;
  if (std::regex_match(name, m, layer)) {
    auto it = per_layer.find(m[2]);
    if (it == per_layer.end() || std::stoll(m[1]) >= layers) return std::nullopt;
    Target t = it->second;
    if (!t.name.empty()) t.name = "blocks." + m[1].str() + "." + t.name;
    return t;
  }
  const std::string bare = name.rfind("transformer.", 0) == 0 ? name.substr(12) : name;
  if (auto it = top.find(bare); it != top.end()) return it->second;
  if (name == "lm_head.weight") return Target{"head.weight"};
  return std::nullopt;
}

/// Hugging Face Llama's name -> trainkit's: q, k and v join into attn.qkv, the gate and up
/// projections into fc (gate first). Hugging Face keeps q and k in the half-split rotary layout
/// trainkit's rotary positions use, so no row is permuted.
std::optional<Target> llama_target(const std::string& name, int64_t layers) {
  static const std::regex layer(R"(^model\.layers\.(\d+)\.(.+)$)");
  static const std::map<std::string, Target> per_layer = {
      {"input_layernorm.weight", {"ln1.weight"}},
      {"self_attn.q_proj.weight", {"attn.qkv.weight", 0, 3}}, {"self_attn.k_proj.weight", {"attn.qkv.weight", 1, 3}},
      {"self_attn.v_proj.weight", {"attn.qkv.weight", 2, 3}}, {"self_attn.o_proj.weight", {"attn.proj.weight"}},
      {"post_attention_layernorm.weight", {"ln2.weight"}},
      {"mlp.gate_proj.weight", {"fc.weight", 0, 2}}, {"mlp.up_proj.weight", {"fc.weight", 1, 2}},
      {"mlp.down_proj.weight", {"proj.weight"}}, {"self_attn.rotary_emb.inv_freq", {""}}};
  std::smatch m;
  if (std::regex_match(name, m, layer)) {
    auto it = per_layer.find(m[2]);
    if (it == per_layer.end() || std::stoll(m[1]) >= layers) return std::nullopt;
    Target t = it->second;
    if (!t.name.empty()) t.name = "blocks." + m[1].str() + "." + t.name;
    return t;
  }
  if (name == "model.embed_tokens.weight") return Target{"wte.weight"};
  if (name == "model.norm.weight") return Target{"ln_f.weight"};
  if (name == "lm_head.weight") return Target{"head.weight"};
  return std::nullopt;
}

/// The safetensors files of a Hugging Face folder: model.safetensors, or the shards its index names.
std::vector<fs::path> weight_files(const fs::path& dir) {
  if (fs::exists(dir / "model.safetensors")) return {dir / "model.safetensors"};
  const fs::path index = dir / "model.safetensors.index.json";
  if (!fs::exists(index)) {
    const bool bin = fs::exists(dir / "pytorch_model.bin");
    throw Error(dir.string() + ": no model.safetensors or model.safetensors.index.json" +
                (bin ? " (it has pytorch_model.bin, a Python pickle: the safetensors files of the same model load)" : ""));
  }
  json j;
  try {
    j = json::parse(std::ifstream(index));
  } catch (const json::exception& e) {
    throw Error(index.string() + ": not JSON (" + e.what() + ")");
  }
  if (!j.contains("weight_map") || !j["weight_map"].is_object())
    throw Error(index.string() + ": no \"weight_map\" object (tensor name -> file)");
  std::set<std::string> files;
  for (const auto& [name, file] : j["weight_map"].items()) {
    if (!file.is_string()) throw Error(index.string() + ": weight_map's '" + name + "' names no file");
    const std::string f = file.get<std::string>();
    if (f.find('/') != std::string::npos) throw Error(index.string() + ": weight_map's '" + name + "' is outside the folder: " + f);
    files.insert(f);
  }
  std::vector<fs::path> out;
  for (const auto& f : files) {
    if (!fs::exists(dir / f)) throw Error(index.string() + " names " + f + ", which the folder lacks");
    out.push_back(dir / f);
  }
  return out;
}

using TargetOf = std::optional<Target> (*)(const std::string&, int64_t);

/// A Hugging Face folder's tensors by trainkit's names, pieces joined; unknown names refused.
void map_tensors(Published& p, const std::vector<fs::path>& files, TargetOf target_of, const std::string& family) {
  Problems problems;
  std::map<std::string, std::vector<at::Tensor>> pieces;
  std::map<std::string, std::vector<std::string>> origins;
  at::Tensor table, head;
  std::string head_origin;
  for (const auto& file : files) {
    for (auto& [name, t] : load_safetensors(file)) {
      const std::string where = file.filename().string() + " '" + name + "'";
      const auto target = target_of(name, p.shape.layers);
      if (!target) {
        problems.add(where + ": " + family + " has no such tensor (or not in a model of " + std::to_string(p.shape.layers) + " layers)");
        continue;
      }
      if (target->name.empty()) continue;
      if (target->name == "head.weight" && p.shape.tied) {  // a tied head saved as well: it must be the table
        head = t;
        head_origin = where;
        continue;
      }
      auto& slots = pieces[target->name];
      slots.resize(static_cast<size_t>(target->slots));
      origins[target->name].resize(static_cast<size_t>(target->slots));
      if (slots[static_cast<size_t>(target->slot)].defined()) problems.add(where + ": given twice");
      slots[static_cast<size_t>(target->slot)] = target->transpose && t.dim() == 2 ? t.t().contiguous() : t;
      origins[target->name][static_cast<size_t>(target->slot)] = where + (target->transpose ? " (transposed)" : "");
      if (target->name == "wte.weight") table = t;
    }
  }
  if (head.defined() && table.defined() && (head.sizes() != table.sizes() || !at::equal(head, table)))
    problems.add(head_origin + ": the configuration ties the head to the token table, but this tensor differs from it");
  for (auto& [name, slots] : pieces) {
    std::string from;
    bool whole = true;
    for (size_t i = 0; i < slots.size(); ++i) {
      from += (i ? " + " : "") + (slots[i].defined() ? origins[name][i] : std::string("(missing piece)"));
      whole = whole && slots[i].defined();
    }
    if (!whole) {
      problems.add("'" + name + "' is made of " + std::to_string(slots.size()) + " tensors, the checkpoint gives " + from);
      continue;
    }
    if (slots.size() > 1) {
      for (const auto& s : slots)
        if (s.dim() != 2 || s.size(1) != slots[0].size(1) || s.scalar_type() != slots[0].scalar_type())
          problems.add(from + ": pieces of '" + name + "' that do not stack (" + c10::str(s.sizes()) + " " +
                       c10::toString(s.scalar_type()) + " and " + c10::str(slots[0].sizes()) + ")");
    }
    p.tensors.emplace_back(name, slots.size() > 1 ? at::cat(slots, 0) : slots[0]);
    p.origin[name] = from;
  }
  problems.raise(p.source + ": tensors trainkit cannot place:");
}

Published read_huggingface(const fs::path& dir) {
  if (!fs::exists(dir / "config.json"))
    throw Error(dir.string() + ": no config.json (a Hugging Face model folder has one, with the model's shape)");
  Config c(dir / "config.json");
  Published p;
  p.source = dir.string();
  const std::string type = c.model_type();
  if (type == "gpt2") {
    p.format = "Hugging Face GPT-2";
    p.shape = gpt2_shape(c);
  } else if (type == "llama") {
    p.format = "Hugging Face Llama";
    p.shape = llama_shape(c);
  } else {
    throw Error(c.file() + ": 'model_type' is \"" + type + "\"; trainkit reads \"gpt2\" and \"llama\"");
  }
  c.problems.raise(c.file() + ": fields trainkit's GPT cannot honour:");
  map_tensors(p, weight_files(dir), type == "gpt2" ? gpt2_target : llama_target, p.format);
  return p;
}

// ---------------------------------------------------------------- llm.c

/// llm.c's GPT-2 checkpoint (train_gpt2.py's write_model): 256 int32 of header (magic 20240326,
/// version 3 for float32 or 5 for bfloat16, context, vocabulary, layers, heads, width, padded
/// vocabulary), then every parameter in Linear layout, a kind at a time across the layers.
Published read_llmc(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::vector<int32_t> h(256);
  if (!in.read(reinterpret_cast<char*>(h.data()), 1024))
    throw Error(file.string() + ": shorter than llm.c's 1024-byte header");
  if (h[0] != 20240326)
    throw Error(file.string() + ": not an llm.c GPT-2 checkpoint (its magic number is " + std::to_string(h[0]) + ", not 20240326)");
  if (h[1] != 3 && h[1] != 5)
    throw Error(file.string() + ": llm.c checkpoint version " + std::to_string(h[1]) +
                "; trainkit reads 3 (float32) and 5 (bfloat16), with the padded vocabulary");
  for (int i = 2; i <= 7; ++i)
    if (h[static_cast<size_t>(i)] < 1) throw Error(file.string() + ": header entry " + std::to_string(i) + " is " + std::to_string(h[static_cast<size_t>(i)]));
  Published p;
  p.format = "llm.c GPT-2";
  p.source = file.string();
  GptShape& s = p.shape;
  s.context = h[2];
  s.vocab = h[3];
  s.layers = h[4];
  s.heads = s.kv_heads = h[5];
  s.width = h[6];
  s.rows = h[7];
  s.mlp_width = 4 * s.width;
  s.mlp = "gelu_tanh";
  if (s.rows < s.vocab)
    throw Error(file.string() + ": its padded vocabulary (" + std::to_string(s.rows) + ") is smaller than its vocabulary (" + std::to_string(s.vocab) + ")");
  if (s.width % s.heads != 0)
    throw Error(file.string() + ": width " + std::to_string(s.width) + " is not divisible by " + std::to_string(s.heads) + " heads");
  const int64_t L = s.layers, C = s.width, V = s.rows, T = s.context;
  // The order train_gpt2.py's write_tensors writes: each kind across all layers.
  struct Entry {
    std::string name;
    std::vector<int64_t> shape;
    bool per_layer;
  };
  const std::vector<Entry> order = {
      {"wte.weight", {V, C}, false}, {"wpe.weight", {T, C}, false}, {"ln1.weight", {C}, true}, {"ln1.bias", {C}, true},
      {"attn.qkv.weight", {3 * C, C}, true}, {"attn.qkv.bias", {3 * C}, true}, {"attn.proj.weight", {C, C}, true},
      {"attn.proj.bias", {C}, true}, {"ln2.weight", {C}, true}, {"ln2.bias", {C}, true},
      {"fc.weight", {4 * C, C}, true}, {"fc.bias", {4 * C}, true}, {"proj.weight", {C, 4 * C}, true},
      {"proj.bias", {C}, true}, {"ln_f.weight", {C}, false}, {"ln_f.bias", {C}, false}};
  const auto numel = [](const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  };
  int64_t total = 0;
  for (const auto& e : order) total += numel(e.shape) * (e.per_layer ? L : 1);
  const auto dtype = h[1] == 3 ? at::kFloat : at::kBFloat16;
  const int64_t item = h[1] == 3 ? 4 : 2;
  const auto size = static_cast<int64_t>(fs::file_size(file));
  if (size != 1024 + total * item)
    throw Error(file.string() + ": " + std::to_string(size) + " bytes, but a " + std::to_string(L) + "-layer GPT-2 of width " +
                std::to_string(C) + ", context " + std::to_string(T) + " and " + std::to_string(V) + " padded tokens takes " +
                std::to_string(1024 + total * item));
  at::Tensor all = at::empty({total}, at::TensorOptions().dtype(dtype));
  if (!in.read(static_cast<char*>(all.data_ptr()), static_cast<std::streamsize>(total * item)))
    throw Error(file.string() + ": cannot read its parameters");
  int64_t at = 0;
  for (const auto& e : order) {
    for (int64_t l = 0; l < (e.per_layer ? L : 1); ++l) {
      const std::string full = e.per_layer ? "blocks." + std::to_string(l) + "." + e.name : e.name;
      p.tensors.emplace_back(full, all.narrow(0, at, numel(e.shape)).view(e.shape));
      p.origin[full] = file.filename().string() + " at element " + std::to_string(at);
      at += numel(e.shape);
    }
  }
  return p;
}

// ---------------------------------------------------------------- writing

/// What keeps a shape out of a family: "" when it fits.
std::string gpt2_misfit(const GptShape& s) {
  std::vector<std::string> why;
  if (s.rotary) why.push_back("rotary positions (GPT-2 learns a position table)");
  if (s.rms_norm) why.push_back("RMSNorm (GPT-2 has LayerNorm)");
  if (!s.bias) why.push_back("no biases (GPT-2 has them)");
  if (s.mlp == "swiglu") why.push_back("a SwiGLU MLP (GPT-2's is GELU)");
  if (s.kv_heads != s.heads) why.push_back("grouped-query attention");
  std::string out;
  for (const auto& w : why) out += (out.empty() ? "" : ", ") + w;
  return out;
}

std::string llama_misfit(const GptShape& s) {
  std::vector<std::string> why;
  if (!s.rotary) why.push_back("learned positions (Llama has rotary ones)");
  if (!s.rms_norm) why.push_back("LayerNorm (Llama has RMSNorm)");
  if (s.bias) why.push_back("biases (Llama has none)");
  if (s.mlp != "swiglu") why.push_back("a GELU MLP (Llama's is SwiGLU)");
  std::string out;
  for (const auto& w : why) out += (out.empty() ? "" : ", ") + w;
  return out;
}

/// Hugging Face's names for trainkit's parameters, pieces split, Conv1D weights transposed.
NamedTensors huggingface_tensors(const GptShape& s, const NamedTensors& params, bool gpt2) {
  static const std::regex layer(R"(^blocks\.(\d+)\.(.+)$)");
  NamedTensors out;
  const int64_t d = s.head_dim();
  for (const auto& [name, t] : params) {
    const at::Tensor v = t.detach().cpu();
    std::smatch m;
    if (!std::regex_match(name, m, layer)) {
      if (gpt2) {
        if (name == "head.weight") out.emplace_back("lm_head.weight", v.narrow(0, 0, s.vocab));
        else out.emplace_back(name, name == "wte.weight" ? v.narrow(0, 0, s.vocab) : v);
      } else {
        const std::map<std::string, std::string> top = {
            {"wte.weight", "model.embed_tokens.weight"}, {"ln_f.weight", "model.norm.weight"}, {"head.weight", "lm_head.weight"}};
        out.emplace_back(top.at(name), name == "ln_f.weight" ? v : v.narrow(0, 0, s.vocab));
      }
      continue;
    }
    const std::string i = m[1], rest = m[2];
    if (gpt2) {
      static const std::map<std::string, std::pair<std::string, bool>> names = {
          {"ln1.weight", {"ln_1.weight", false}}, {"ln1.bias", {"ln_1.bias", false}},
          {"attn.qkv.weight", {"attn.c_attn.weight", true}}, {"attn.qkv.bias", {"attn.c_attn.bias", false}},
          {"attn.proj.weight", {"attn.c_proj.weight", true}}, {"attn.proj.bias", {"attn.c_proj.bias", false}},
          {"ln2.weight", {"ln_2.weight", false}}, {"ln2.bias", {"ln_2.bias", false}},
          {"fc.weight", {"mlp.c_fc.weight", true}}, {"fc.bias", {"mlp.c_fc.bias", false}},
          {"proj.weight", {"mlp.c_proj.weight", true}}, {"proj.bias", {"mlp.c_proj.bias", false}}};
      const auto& [hf, transpose] = names.at(rest);
      out.emplace_back("h." + i + "." + hf, transpose ? v.t().contiguous() : v);
      continue;
    }
    const std::string p = "model.layers." + i + ".";
    if (rest == "attn.qkv.weight") {
      out.emplace_back(p + "self_attn.q_proj.weight", v.narrow(0, 0, s.heads * d).contiguous());
      out.emplace_back(p + "self_attn.k_proj.weight", v.narrow(0, s.heads * d, s.kv_heads * d).contiguous());
      out.emplace_back(p + "self_attn.v_proj.weight", v.narrow(0, (s.heads + s.kv_heads) * d, s.kv_heads * d).contiguous());
    } else if (rest == "fc.weight") {
      out.emplace_back(p + "mlp.gate_proj.weight", v.narrow(0, 0, s.mlp_width).contiguous());
      out.emplace_back(p + "mlp.up_proj.weight", v.narrow(0, s.mlp_width, s.mlp_width).contiguous());
    } else {
      static const std::map<std::string, std::string> names = {
          {"ln1.weight", "input_layernorm.weight"}, {"attn.proj.weight", "self_attn.o_proj.weight"},
          {"ln2.weight", "post_attention_layernorm.weight"}, {"proj.weight", "mlp.down_proj.weight"}};
      out.emplace_back(p + names.at(rest), v);
    }
  }
  return out;
}

json huggingface_config(const GptShape& s, bool gpt2, at::ScalarType dtype) {
  const std::string torch_dtype = dtype == at::kDouble ? "float64" : dtype == at::kBFloat16 ? "bfloat16" : "float32";
  if (gpt2)
    return {{"model_type", "gpt2"}, {"architectures", {"GPT2LMHeadModel"}}, {"vocab_size", s.vocab},
            {"n_positions", s.context}, {"n_ctx", s.context}, {"n_embd", s.width}, {"n_layer", s.layers},
            {"n_head", s.heads}, {"n_inner", s.mlp_width == 4 * s.width ? json(nullptr) : json(s.mlp_width)},
            {"activation_function", s.mlp == "gelu" ? "gelu" : "gelu_new"}, {"layer_norm_epsilon", s.norm_eps},
            {"resid_pdrop", s.dropout}, {"embd_pdrop", s.dropout}, {"attn_pdrop", s.dropout},
            {"scale_attn_weights", true}, {"tie_word_embeddings", s.tied}, {"torch_dtype", torch_dtype}};
  return {{"model_type", "llama"}, {"architectures", {"LlamaForCausalLM"}}, {"vocab_size", s.vocab},
          {"hidden_size", s.width}, {"intermediate_size", s.mlp_width}, {"num_hidden_layers", s.layers},
          {"num_attention_heads", s.heads}, {"num_key_value_heads", s.kv_heads},
          {"max_position_embeddings", s.context}, {"rms_norm_eps", s.norm_eps}, {"rope_theta", s.rotary_base},
          {"hidden_act", "silu"}, {"attention_bias", false}, {"mlp_bias", false}, {"rope_scaling", nullptr},
          {"tie_word_embeddings", s.tied}, {"attention_dropout", s.dropout}, {"torch_dtype", torch_dtype}};
}

/// Writes `text` to `file` through a temporary beside it, so that the file is whole or absent.
void write_text(const fs::path& file, const std::string& text) {
  const fs::path partial = file.string() + ".partial";
  {
    std::ofstream out(partial, std::ios::binary);
    out << text;
    if (!out.flush()) throw Error("cannot write " + partial.string());
  }
  fs::rename(partial, file);
}

void write_huggingface(const GptShape& s, const NamedTensors& params, const fs::path& dir, int64_t max_file_bytes) {
  const std::string gpt2_why = gpt2_misfit(s), llama_why = llama_misfit(s);
  if (!gpt2_why.empty() && !llama_why.empty())
    throw Error("a Hugging Face folder holds GPT-2 or Llama, and this GPT is neither: as GPT-2 it has " + gpt2_why +
                "; as Llama it has " + llama_why);
  const bool gpt2 = gpt2_why.empty();
  const NamedTensors tensors = huggingface_tensors(s, params, gpt2);
  fs::create_directories(dir);
  write_text(dir / "config.json", huggingface_config(s, gpt2, params.front().second.scalar_type()).dump(2) + "\n");
  // Files of at most max_file_bytes (a tensor larger than that gets a file of its own).
  std::vector<NamedTensors> files(1);
  int64_t in_file = 0, total = 0;
  for (const auto& nt : tensors) {
    const int64_t bytes = static_cast<int64_t>(nt.second.nbytes());
    if (in_file > 0 && in_file + bytes > max_file_bytes) {
      files.emplace_back();
      in_file = 0;
    }
    files.back().push_back(nt);
    in_file += bytes;
    total += bytes;
  }
  const Metadata meta = {{"format", "pt"}};
  if (files.size() == 1) return save_safetensors(dir / "model.safetensors", files.front(), meta);
  json index = {{"metadata", {{"total_size", total}}}, {"weight_map", json::object()}};
  char name[64];
  for (size_t f = 0; f < files.size(); ++f) {
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", f + 1, files.size());
    save_safetensors(dir / name, files[f], meta);
    for (const auto& nt : files[f]) index["weight_map"][nt.first] = name;
  }
  write_text(dir / "model.safetensors.index.json", index.dump(2) + "\n");
}

/// llm.c's .bin: the header, then every parameter in float32, in the order read_llmc reads.
void write_llmc(const GptShape& s, const NamedTensors& params, const fs::path& file) {
  std::string why = gpt2_misfit(s);
  if (s.mlp == "gelu") why += std::string(why.empty() ? "" : ", ") + "exact GELU (llm.c computes its tanh form)";
  if (s.mlp_width != 4 * s.width) why += std::string(why.empty() ? "" : ", ") + "an MLP not 4x as wide";
  if (!s.tied) why += std::string(why.empty() ? "" : ", ") + "an untied head";
  if (!why.empty()) throw Error("llm.c's .bin holds GPT-2, and this GPT has " + why);
  std::map<std::string, at::Tensor> by_name;
  for (const auto& [name, t] : params) by_name[name] = t.detach().cpu().to(at::kFloat).contiguous();
  // A padded table keeps its rows; an unpadded one is padded to a multiple of 128, as llm.c does.
  const int64_t padded = s.rows > s.vocab ? s.rows : (s.rows + 127) / 128 * 128;
  std::vector<int32_t> h(256, 0);
  const std::vector<int64_t> fields = {20240326, 3, s.context, s.vocab, s.layers, s.heads, s.width, padded};
  for (size_t i = 0; i < fields.size(); ++i) h[i] = static_cast<int32_t>(fields[i]);
  std::string bytes(reinterpret_cast<const char*>(h.data()), 1024);
  const auto put = [&](const at::Tensor& t) {
    bytes.append(static_cast<const char*>(t.data_ptr()), t.nbytes());
  };
  at::Tensor table = by_name.at("wte.weight");
  if (padded > s.rows) table = at::cat({table, at::zeros({padded - s.rows, s.width}, table.options())});
  put(table);
  put(by_name.at("wpe.weight"));
  for (const char* kind : {"ln1.weight", "ln1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
                           "attn.proj.bias", "ln2.weight", "ln2.bias", "fc.weight", "fc.bias", "proj.weight", "proj.bias"})
    for (int64_t l = 0; l < s.layers; ++l) put(by_name.at("blocks." + std::to_string(l) + "." + kind));
  put(by_name.at("ln_f.weight"));
  put(by_name.at("ln_f.bias"));
  if (file.has_parent_path()) fs::create_directories(file.parent_path());
  write_text(file, bytes);
}

}  // namespace

std::vector<std::string> published_formats() { return {"huggingface", "llmc"}; }

void write_published(const GptShape& s, const NamedTensors& params, const std::string& format, const fs::path& where,
                     int64_t max_file_bytes) {
  if (format == "huggingface") return write_huggingface(s, params, where, max_file_bytes);
  if (format == "llmc") return write_llmc(s, params, where);
  throw Error("no export format '" + format + "' (formats: huggingface, llmc)");
}

Published read_published(const fs::path& where) {
  if (fs::is_directory(where)) return read_huggingface(where);
  if (!fs::exists(where)) throw Error(where.string() + ": no such file or folder");
  return read_llmc(where);
}

void load_published(const Published& from, const std::vector<std::pair<std::string, at::Tensor>>& params) {
  std::map<std::string, at::Tensor> given(from.tensors.begin(), from.tensors.end());
  Problems problems;
  const auto origin = [&](const std::string& name) {
    auto it = from.origin.find(name);
    return it == from.origin.end() ? std::string() : " (from " + it->second + ")";
  };
  for (const auto& [name, dst] : params) {
    auto it = given.find(name);
    if (it == given.end()) {
      problems.add("'" + name + "': the checkpoint lacks it");
      continue;
    }
    const at::Tensor& src = it->second;
    if (!src.is_floating_point())
      problems.add("'" + name + "'" + origin(name) + ": " + c10::toString(src.scalar_type()) + ", not floating point");
    else if (src.sizes() != dst.sizes())
      problems.add("'" + name + "'" + origin(name) + ": shape " + c10::str(src.sizes()) + ", the model's is " + c10::str(dst.sizes()));
    else {
      torch::NoGradGuard no_grad;
      at::Tensor target = dst;
      target.copy_(src);
    }
    given.erase(it);
  }
  for (const auto& [name, t] : given) problems.add("'" + name + "'" + origin(name) + ": the model has no such parameter");
  problems.raise(from.source + " (" + from.format + ") does not fit the model its configuration describes:");
}

}  // namespace tk::models
