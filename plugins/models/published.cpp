// Published GPT checkpoints read into trainkit's names: Hugging Face GPT-2 and Llama folders, and
// llm.c's GPT-2 .bin.
#include "published.h"

#include "torch_save.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <set>

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
    if (fs::exists(file) && !fs::is_regular_file(file))  // a folder, or a pipe that could wait for a writer
      throw Error(file_ + ": not a regular file (a folder, a pipe or a device)");
    std::ifstream in(file);
    if (!in) throw Error(file_ + ": cannot read it");
    try {
      j_ = json::parse(in);
    } catch (const json::exception& e) {
      throw Error(file_ + ": not JSON (" + e.what() + ")");
    }
    if (!j_.is_object()) throw Error(file_ + ": expected a JSON object");
  }
  const std::string& file() const { return file_; }

  int64_t count(const char* key, std::optional<int64_t> def = std::nullopt) {
    return get<int64_t>(key, def, int64_t{1}, "a whole number >= 1",
                        [](const json& v) { return v.is_number_integer() && v.get<int64_t>() >= 1; });
  }
  double number(const char* key, double def) {
    return get<double>(key, def, def, "a number > 0", [](const json& v) { return v.is_number() && v.get<double>() > 0.0; });
  }
  bool flag(const char* key, bool def) {
    return get<bool>(key, def, def, "true or false", [](const json& v) { return v.is_boolean(); });
  }
  std::string text(const char* key, const std::string& def) {
    return get<std::string>(key, def, def, "a string", [](const json& v) { return v.is_string(); });
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
  /// Field `key` as a T where `fits` accepts it. Absent: `def`, or without one a problem. Of another
  /// kind: a problem naming what was `expected`, and `fallback` (the run is refused either way).
  template <class T>
  T get(const char* key, std::optional<T> def, T fallback, const char* expected, bool (*fits)(const json&)) {
    const json* v = find(key);
    if (!v && def) return *def;
    if (!v || !fits(*v)) {
      problems.add(std::string("'") + key + "': expected " + expected + ", got " + (v ? v->dump() : "nothing"));
      return fallback;
    }
    return v->get<T>();
  }

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
  // Newer configurations keep the rotary settings in one object.
  if (const json* rope = c.find("rope_parameters"); rope && rope->is_object()) {
    if (rope->contains("rope_theta") && (*rope)["rope_theta"].is_number()) s.rotary_base = (*rope)["rope_theta"].get<double>();
    const std::string type = rope->value("rope_type", std::string("default"));
    if (type != "default")
      c.problems.add("'rope_parameters' has rope_type \"" + type + "\": rotary angles are not rescaled (trainkit honours \"default\")");
  }
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

// ---------------------------------------------------------------- names, both ways

/// A tensor of a published layout and the trainkit parameter it is, or a piece of (`slot` of
/// `slots`, stacked along the first dimension), transposed (GPT-2's Conv1D) or not.
struct Rule {
  std::string theirs, ours;
  int slot = 0, slots = 1;
  bool transpose = false;
};

/// A Hugging Face family's names: each layer's under `layer_prefix` N ".", and the model's own.
struct Family {
  std::string name;             // for messages
  std::string optional_prefix;  // a prefix some saves put before every name ("transformer.")
  std::string layer_prefix;
  std::vector<Rule> layer, top;
  std::vector<std::string> skipped;  // per-layer buffers that are no parameters
};

/// GPT-2 (GPT2Model's names; GPT2LMHeadModel's put "transformer." before them). Its Conv1D keeps
/// weights as [in, out], transposed from a Linear's; the causal mask is a buffer of every layer.
const Family& gpt2_family() {
  static const Family f{"Hugging Face GPT-2", "transformer.", "h.",
                        {{"ln_1.weight", "ln1.weight"}, {"ln_1.bias", "ln1.bias"},
                         {"attn.c_attn.weight", "attn.qkv.weight", 0, 1, true}, {"attn.c_attn.bias", "attn.qkv.bias"},
                         {"attn.c_proj.weight", "attn.proj.weight", 0, 1, true}, {"attn.c_proj.bias", "attn.proj.bias"},
                         {"ln_2.weight", "ln2.weight"}, {"ln_2.bias", "ln2.bias"},
                         {"mlp.c_fc.weight", "fc.weight", 0, 1, true}, {"mlp.c_fc.bias", "fc.bias"},
                         {"mlp.c_proj.weight", "proj.weight", 0, 1, true}, {"mlp.c_proj.bias", "proj.bias"}},
                        {{"wte.weight", "wte.weight"}, {"wpe.weight", "wpe.weight"}, {"ln_f.weight", "ln_f.weight"},
                         {"ln_f.bias", "ln_f.bias"}, {"lm_head.weight", "head.weight"}},
                        {"attn.bias", "attn.masked_bias"}};
  return f;
}

/// Llama: q, k and v are stacked into attn.qkv, the gate and up projections into fc (gate first).
/// Hugging Face keeps q and k in the half-split rotary layout trainkit's rotary positions use, so
/// no row is permuted.
const Family& llama_family() {
  static const Family f{"Hugging Face Llama", "", "model.layers.",
                        {{"input_layernorm.weight", "ln1.weight"},
                         {"self_attn.q_proj.weight", "attn.qkv.weight", 0, 3},
                         {"self_attn.k_proj.weight", "attn.qkv.weight", 1, 3},
                         {"self_attn.v_proj.weight", "attn.qkv.weight", 2, 3},
                         {"self_attn.o_proj.weight", "attn.proj.weight"},
                         {"post_attention_layernorm.weight", "ln2.weight"},
                         {"mlp.gate_proj.weight", "fc.weight", 0, 2}, {"mlp.up_proj.weight", "fc.weight", 1, 2},
                         {"mlp.down_proj.weight", "proj.weight"}},
                        {{"model.embed_tokens.weight", "wte.weight"}, {"model.norm.weight", "ln_f.weight"},
                         {"lm_head.weight", "head.weight"}},
                        {"self_attn.rotary_emb.inv_freq"}};
  return f;
}

/// nanoGPT's GPT (model.py): GPT-2's names under "transformer.", in Linear layout (its from_pretrained
/// transposes GPT-2's Conv1D weights into it), the causal mask a buffer where flash attention is
/// not used.
const Family& nanogpt_family() {
  static const Family f = [] {
    Family n = gpt2_family();
    n.name = "nanoGPT";
    for (Rule& r : n.layer) r.transpose = false;
    n.skipped = {"attn.bias"};
    return n;
  }();
  return f;
}

/// The rows of each piece of a stacked parameter (a per-layer trainkit name) in shape `s`.
std::vector<int64_t> piece_rows(const GptShape& s, const std::string& ours) {
  const int64_t d = s.head_dim();
  if (ours == "attn.qkv.weight") return {s.heads * d, s.kv_heads * d, s.kv_heads * d};
  if (ours == "fc.weight") return {s.mlp_width, s.mlp_width};
  return {};
}

/// "blocks.N.rest" -> (N, rest); nullopt for another name.
std::optional<std::pair<std::string, std::string>> split_layer(const std::string& name, const std::string& prefix) {
  if (name.rfind(prefix, 0) != 0) return std::nullopt;
  const size_t dot = name.find('.', prefix.size());
  const std::string index = name.substr(prefix.size(), dot == std::string::npos ? 0 : dot - prefix.size());
  if (index.empty() || index.size() > 6 || index.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  return std::make_pair(index, name.substr(dot + 1));
}

/// The rule for a checkpoint's `name`, its trainkit name complete; nullopt for a name the family
/// does not have (or of a layer past `layers`); a rule naming nothing for a buffer to skip.
std::optional<Rule> rule_for(const Family& f, std::string name, int64_t layers) {
  if (!f.optional_prefix.empty() && name.rfind(f.optional_prefix, 0) == 0) name = name.substr(f.optional_prefix.size());
  if (auto layer = split_layer(name, f.layer_prefix)) {
    const auto& [index, rest] = *layer;
    if (std::stoll(index) >= layers) return std::nullopt;
    if (std::find(f.skipped.begin(), f.skipped.end(), rest) != f.skipped.end()) return Rule{name, ""};
    for (const Rule& r : f.layer)
      if (r.theirs == rest) {
        Rule out = r;
        out.ours = "blocks." + index + "." + r.ours;
        return out;
      }
    return std::nullopt;
  }
  for (const Rule& r : f.top)
    if (r.theirs == name) return r;
  return std::nullopt;
}

/// Trainkit's parameters under the family's names: stacked ones split, Conv1D weights transposed
/// back, the table's (and head's) padding rows dropped.
NamedTensors to_family(const Family& f, const GptShape& s, const NamedTensors& params) {
  NamedTensors out;
  for (const auto& [name, t] : params) {
    const at::Tensor v = t.detach().cpu();
    if (auto layer = split_layer(name, "blocks.")) {
      const auto& [index, rest] = *layer;
      std::vector<const Rule*> rules;
      for (const Rule& r : f.layer)
        if (r.ours == rest) rules.push_back(&r);
      if (rules.empty()) throw Error(f.name + " has no name for parameter '" + name + "'");
      const std::vector<int64_t> rows = piece_rows(s, rest);
      int64_t from = 0;
      for (const Rule* r : rules) {
        at::Tensor piece = rules.size() == 1 ? v : v.narrow(0, from, rows.at(static_cast<size_t>(r->slot)));
        if (rules.size() > 1) from += rows.at(static_cast<size_t>(r->slot));
        out.emplace_back(f.layer_prefix + index + "." + r->theirs, (r->transpose ? piece.t() : piece).contiguous());
      }
      continue;
    }
    const auto r = std::find_if(f.top.begin(), f.top.end(), [&](const Rule& x) { return x.ours == name; });
    if (r == f.top.end()) throw Error(f.name + " has no name for parameter '" + name + "'");
    const bool table = name == "wte.weight" || name == "head.weight";
    out.emplace_back(r->theirs, table ? v.narrow(0, 0, s.vocab).contiguous() : v);
  }
  return out;
}

// ---------------------------------------------------------------- reading

/// The safetensors files of a Hugging Face folder: model.safetensors, or the shards its index names.
std::vector<fs::path> weight_files(const fs::path& dir) {
  if (fs::exists(dir / "model.safetensors")) return {dir / "model.safetensors"};
  const fs::path index = dir / "model.safetensors.index.json";
  if (!fs::exists(index)) {
    const bool bin = fs::exists(dir / "pytorch_model.bin");
    throw Error(dir.string() + ": no model.safetensors or model.safetensors.index.json" +
                (bin ? " (it has pytorch_model.bin, a Python pickle: the safetensors files of the same model load)" : ""));
  }
  if (!fs::is_regular_file(index)) throw Error(index.string() + ": not a regular file (a folder, a pipe or a device)");
  json j;
  try {
    j = json::parse(std::ifstream(index));
  } catch (const json::exception& e) {
    throw Error(index.string() + ": not JSON (" + e.what() + ")");
  }
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
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

/// Tensors named as `f` names them (from each source: a label for messages, and its tensors) by
/// trainkit's names, pieces stacked; refuses unknown names, pieces of other rows, a tied head that
/// is not the table.
void read_family(Published& p, const Family& f, const std::vector<std::pair<std::string, NamedTensors>>& sources) {
  Problems problems;
  std::map<std::string, std::vector<at::Tensor>> pieces;
  std::map<std::string, std::vector<std::string>> origins;
  at::Tensor table, head;
  std::string head_origin;
  for (const auto& [label, tensors] : sources) {
    for (const auto& [name, t] : tensors) {
      const std::string where = label + " '" + name + "'";
      const auto rule = rule_for(f, name, p.shape.layers);
      if (!rule) {
        problems.add(where + ": " + f.name + " has no such tensor (or not in a model of " + std::to_string(p.shape.layers) + " layers)");
        continue;
      }
      if (rule->ours.empty()) continue;
      if (rule->ours == "head.weight" && p.shape.tied) {  // a tied head saved as well: it must be the table
        head = t;
        head_origin = where;
        continue;
      }
      const bool transpose = rule->transpose && t.dim() == 2;
      if (rule->transpose && !transpose) problems.add(where + ": " + std::to_string(t.dim()) + " dimensions, a Conv1D weight has 2");
      auto& slots = pieces[rule->ours];
      auto& from = origins[rule->ours];
      slots.resize(static_cast<size_t>(rule->slots));
      from.resize(static_cast<size_t>(rule->slots));
      const auto slot = static_cast<size_t>(rule->slot);
      if (slots[slot].defined()) problems.add(where + ": given twice");
      slots[slot] = transpose ? t.t().contiguous() : t;
      from[slot] = where + (transpose ? " (transposed)" : "");
      if (rule->ours == "wte.weight") table = t;
    }
  }
  if (head.defined() && table.defined() &&
      (head.sizes() != table.sizes() || head.scalar_type() != table.scalar_type() || !at::equal(head, table)))
    problems.add(head_origin + ": the configuration ties the head to the token table, but this tensor differs from it");
  for (auto& [name, slots] : pieces) {
    const auto& from = origins[name];
    std::string said;
    bool whole = true;
    for (size_t i = 0; i < slots.size(); ++i) {
      said += (i ? " + " : "") + (slots[i].defined() ? from[i] : std::string("(missing piece)"));
      whole = whole && slots[i].defined();
    }
    if (!whole) {
      problems.add("'" + name + "' is made of " + std::to_string(slots.size()) + " tensors, the checkpoint gives " + said);
      continue;
    }
    if (slots.size() > 1) {
      const auto layer = split_layer(name, "blocks.");
      const std::vector<int64_t> rows = piece_rows(p.shape, layer->second);
      bool stack = true;
      for (size_t i = 0; i < slots.size(); ++i)
        if (slots[i].dim() != 2 || slots[i].size(0) != rows[i] || slots[i].size(1) != p.shape.width ||
            slots[i].scalar_type() != slots[0].scalar_type()) {
          problems.add(from[i] + ": shape " + c10::str(slots[i].sizes()) + " " + c10::toString(slots[i].scalar_type()) +
                       ", a piece of '" + name + "' is [" + std::to_string(rows[i]) + ", " + std::to_string(p.shape.width) +
                       "] like its other pieces");
          stack = false;
        }
      if (!stack) continue;
    }
    p.tensors.emplace_back(name, slots.size() > 1 ? at::cat(slots, 0) : slots[0]);
    p.origin[name] = said;
  }
  problems.raise(p.source + ": tensors trainkit cannot place:");
}

Published huggingface_shape(const fs::path& dir) {
  if (!fs::exists(dir / "config.json"))
    throw Error(dir.string() + ": no config.json (a Hugging Face model folder has one, with the model's shape)");
  Config c(dir / "config.json");
  Published p;
  p.source = dir.string();
  const std::string type = c.text("model_type", "");
  if (type == "gpt2") {
    p.format = gpt2_family().name;
    p.shape = gpt2_shape(c);
  } else if (type == "llama") {
    p.format = llama_family().name;
    p.shape = llama_shape(c);
  } else {
    c.problems.raise(c.file() + ":");
    throw Error(c.file() + ": 'model_type' is \"" + type + "\"; trainkit reads \"gpt2\" and \"llama\"");
  }
  c.problems.raise(c.file() + ": fields trainkit's GPT cannot honour:");
  return p;
}

/// llm.c's GPT-2 parameters in the order train_gpt2.py's write_tensors writes them: each kind
/// across all layers; the table has `s.rows` rows.
struct LlmcEntry {
  std::string name;
  std::vector<int64_t> shape;
  bool per_layer;
};
std::vector<LlmcEntry> llmc_order(const GptShape& s) {
  const int64_t C = s.width;
  return {{"wte.weight", {s.rows, C}, false}, {"wpe.weight", {s.context, C}, false}, {"ln1.weight", {C}, true},
          {"ln1.bias", {C}, true}, {"attn.qkv.weight", {3 * C, C}, true}, {"attn.qkv.bias", {3 * C}, true},
          {"attn.proj.weight", {C, C}, true}, {"attn.proj.bias", {C}, true}, {"ln2.weight", {C}, true},
          {"ln2.bias", {C}, true}, {"fc.weight", {4 * C, C}, true}, {"fc.bias", {4 * C}, true},
          {"proj.weight", {C, 4 * C}, true}, {"proj.bias", {C}, true}, {"ln_f.weight", {C}, false},
          {"ln_f.bias", {C}, false}};
}

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t llmc_elements(const GptShape& s) {
  int64_t total = 0;
  for (const auto& e : llmc_order(s)) total += numel(e.shape) * (e.per_layer ? s.layers : 1);
  return total;
}

constexpr int32_t kLlmcMagic = 20240326;

/// llm.c's GPT-2 checkpoint (train_gpt2.py's write_model): 256 int32 of header (magic 20240326,
/// version 3 for float32 or 5 for bfloat16, context, vocabulary, layers, heads, width, padded
/// vocabulary), then every parameter in Linear layout.
Published llmc_shape(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw Error(file.string() + ": cannot read it");
  std::vector<int32_t> h(256);
  if (!in.read(reinterpret_cast<char*>(h.data()), 1024))
    throw Error(file.string() + ": shorter than llm.c's 1024-byte header");
  if (h[0] != kLlmcMagic)
    throw Error(file.string() + ": not an llm.c GPT-2 checkpoint (its magic number is " + std::to_string(h[0]) +
                ", not 20240326)");
  if (h[1] != 3 && h[1] != 5)
    throw Error(file.string() + ": llm.c checkpoint version " + std::to_string(h[1]) +
                "; trainkit reads 3 (float32) and 5 (bfloat16), with the padded vocabulary");
  const char* fields[] = {"", "", "context", "vocabulary", "layers", "heads", "width", "padded vocabulary"};
  for (size_t i = 2; i <= 7; ++i)
    if (h[i] < 1 || h[i] > (1 << 24))
      throw Error(file.string() + ": its header's " + fields[i] + " is " + std::to_string(h[i]));
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
  if (const std::string why = shape_problem(s); !why.empty()) throw Error(file.string() + ": " + why);
  const int64_t item = h[1] == 3 ? 4 : 2;
  const auto size = static_cast<int64_t>(fs::file_size(file));
  const double wanted = 1024.0 + static_cast<double>(llmc_elements(s)) * static_cast<double>(item);
  if (static_cast<double>(size) != wanted)
    throw Error(file.string() + ": " + std::to_string(size) + " bytes, but a " + std::to_string(s.layers) +
                "-layer GPT-2 of width " + std::to_string(s.width) + ", context " + std::to_string(s.context) + " and " +
                std::to_string(s.rows) + " padded tokens takes " + std::to_string(static_cast<int64_t>(wanted)));
  return p;
}

void read_llmc(Published& p) {
  const GptShape& s = p.shape;
  std::ifstream in(p.source, std::ios::binary);
  std::vector<int32_t> h(256);
  in.read(reinterpret_cast<char*>(h.data()), 1024);
  const int64_t total = llmc_elements(s);
  at::Tensor all = at::empty({total}, at::TensorOptions().dtype(h[1] == 3 ? at::kFloat : at::kBFloat16));
  if (!in.read(static_cast<char*>(all.data_ptr()), static_cast<std::streamsize>(all.nbytes())))
    throw Error(p.source + ": cannot read its parameters");
  int64_t at = 0;
  const std::string file = fs::path(p.source).filename().string();
  for (const auto& e : llmc_order(s)) {
    for (int64_t l = 0; l < (e.per_layer ? s.layers : 1); ++l) {
      const std::string full = e.per_layer ? "blocks." + std::to_string(l) + "." + e.name : e.name;
      p.tensors.emplace_back(full, all.narrow(0, at, numel(e.shape)).view(e.shape));
      p.origin[full] = file + " at element " + std::to_string(at);
      at += numel(e.shape);
    }
  }
}

// ---------------------------------------------------------------- writing

std::string joined(const std::vector<std::string>& parts) {
  std::string out;
  for (const auto& w : parts) out += (out.empty() ? "" : ", ") + w;
  return out;
}

/// What keeps a shape out of GPT-2's form: "" when it fits.
std::string gpt2_misfit(const GptShape& s) {
  std::vector<std::string> why;
  if (s.rotary) why.push_back("rotary positions (GPT-2 learns a position table)");
  if (s.rms_norm) why.push_back("RMSNorm (GPT-2 has LayerNorm)");
  if (!s.bias) why.push_back("no biases (GPT-2 has them)");
  if (s.mlp == "swiglu") why.push_back("a SwiGLU MLP (GPT-2's is GELU)");
  if (s.kv_heads != s.heads) why.push_back("grouped-query attention");
  return joined(why);
}

std::string llama_misfit(const GptShape& s) {
  std::vector<std::string> why;
  if (!s.rotary) why.push_back("learned positions (Llama has rotary ones)");
  if (!s.rms_norm) why.push_back("LayerNorm (Llama has RMSNorm)");
  if (s.bias) why.push_back("biases (Llama has none)");
  if (s.mlp != "swiglu") why.push_back("a GELU MLP (Llama's is SwiGLU)");
  return joined(why);
}

std::string torch_dtype(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    default: return "float32";
  }
}

json huggingface_config(const GptShape& s, bool gpt2, at::ScalarType dtype) {
  if (gpt2)
    return {{"model_type", "gpt2"}, {"architectures", {"GPT2LMHeadModel"}}, {"vocab_size", s.vocab},
            {"n_positions", s.context}, {"n_ctx", s.context}, {"n_embd", s.width}, {"n_layer", s.layers},
            {"n_head", s.heads}, {"n_inner", s.mlp_width == 4 * s.width ? json(nullptr) : json(s.mlp_width)},
            {"activation_function", s.mlp == "gelu" ? "gelu" : "gelu_new"}, {"layer_norm_epsilon", s.norm_eps},
            {"resid_pdrop", s.dropout}, {"embd_pdrop", s.dropout}, {"attn_pdrop", s.dropout},
            {"scale_attn_weights", true}, {"tie_word_embeddings", s.tied}, {"torch_dtype", torch_dtype(dtype)}};
  return {{"model_type", "llama"}, {"architectures", {"LlamaForCausalLM"}}, {"vocab_size", s.vocab},
          {"hidden_size", s.width}, {"intermediate_size", s.mlp_width}, {"num_hidden_layers", s.layers},
          {"num_attention_heads", s.heads}, {"num_key_value_heads", s.kv_heads},
          {"max_position_embeddings", s.context}, {"rms_norm_eps", s.norm_eps}, {"rope_theta", s.rotary_base},
          {"hidden_act", "silu"}, {"attention_bias", false}, {"mlp_bias", false}, {"rope_scaling", nullptr},
          {"tie_word_embeddings", s.tied}, {"attention_dropout", s.dropout}, {"torch_dtype", torch_dtype(dtype)}};
}

/// Writes `file` through `fill`, refusing a write that failed (a full disk shows at close).
void write_all(const fs::path& file, const std::function<void(std::ofstream&)>& fill) {
  std::ofstream out(file, std::ios::binary);
  fill(out);
  out.close();
  if (!out) throw Error("cannot write " + file.string());
}

/// A folder for `where`, made beside it and renamed into place when whole: a killed export leaves
/// the whole folder or none. `where` must not hold anything yet.
class NewFolder {
 public:
  explicit NewFolder(fs::path where) : where_(std::move(where)), partial_(where_.string() + ".partial") {
    if (fs::exists(where_) && !(fs::is_directory(where_) && fs::is_empty(where_)))
      throw Error(where_.string() + " exists and is not an empty folder: export into a new one");
    fs::remove_all(partial_);
    fs::create_directories(partial_);
  }
  ~NewFolder() {
    std::error_code ec;
    if (!done_) fs::remove_all(partial_, ec);
  }
  NewFolder(const NewFolder&) = delete;
  NewFolder& operator=(const NewFolder&) = delete;
  const fs::path& path() const { return partial_; }
  void finish() {
    if (fs::exists(where_)) fs::remove(where_);  // the empty folder it may be
    fs::rename(partial_, where_);
    done_ = true;
  }

 private:
  fs::path where_, partial_;
  bool done_ = false;
};

void write_huggingface(const GptShape& s, const NamedTensors& params, const fs::path& dir, int64_t max_file_bytes) {
  const std::string gpt2_why = gpt2_misfit(s), llama_why = llama_misfit(s);
  if (!gpt2_why.empty() && !llama_why.empty())
    throw Error("a Hugging Face folder holds GPT-2 or Llama, and this GPT is neither: as GPT-2 it has " + gpt2_why +
                "; as Llama it has " + llama_why);
  const bool gpt2 = gpt2_why.empty();
  const NamedTensors tensors = to_family(gpt2 ? gpt2_family() : llama_family(), s, params);
  NewFolder folder(dir);
  const std::string config = huggingface_config(s, gpt2, params.front().second.scalar_type()).dump(2) + "\n";
  write_all(folder.path() / "config.json", [&](std::ofstream& out) { out << config; });
  // Files of at most max_file_bytes (a tensor larger than that gets a file of its own).
  std::vector<NamedTensors> files(1);
  int64_t in_file = 0, total = 0;
  for (const auto& nt : tensors) {
    const auto bytes = static_cast<int64_t>(nt.second.nbytes());
    if (in_file > 0 && in_file + bytes > max_file_bytes) {
      files.emplace_back();
      in_file = 0;
    }
    files.back().push_back(nt);
    in_file += bytes;
    total += bytes;
  }
  const Metadata meta = {{"format", "pt"}};
  if (files.size() == 1) {
    save_safetensors(folder.path() / "model.safetensors", files.front(), meta);
  } else {
    json index = {{"metadata", {{"total_size", total}}}, {"weight_map", json::object()}};
    char name[64];
    for (size_t f = 0; f < files.size(); ++f) {
      std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", f + 1, files.size());
      save_safetensors(folder.path() / name, files[f], meta);
      for (const auto& nt : files[f]) index["weight_map"][nt.first] = name;
    }
    const std::string text = index.dump(2) + "\n";
    write_all(folder.path() / "model.safetensors.index.json", [&](std::ofstream& out) { out << text; });
  }
  folder.finish();
}

/// llm.c's .bin: the header, then every parameter in float32, in llmc_order, streamed to a file
/// beside `file` and renamed into place when whole.
void write_llmc(const GptShape& s, const NamedTensors& params, const fs::path& file) {
  std::vector<std::string> why;
  if (const std::string misfit = gpt2_misfit(s); !misfit.empty()) why.push_back(misfit);
  if (s.mlp == "gelu") why.push_back("exact GELU (llm.c computes its tanh form)");
  if (s.mlp_width != 4 * s.width) why.push_back("an MLP not 4x as wide");
  if (!s.tied) why.push_back("an untied head");
  if (s.norm_eps != 1e-5) why.push_back("LayerNorm's epsilon " + std::to_string(s.norm_eps) + " (llm.c's is 1e-5)");
  if (!why.empty()) throw Error("llm.c's .bin holds GPT-2, and this GPT has " + joined(why));
  // As a Hugging Face folder, never over what is there (a run's own pretrained file, say).
  if (fs::is_directory(file)) throw Error(file.string() + " is a folder: llm.c's format is one file; give its name");
  if (fs::exists(file)) throw Error(file.string() + " exists: export into a new file");
  std::map<std::string, at::Tensor> by_name;
  for (const auto& [name, t] : params) by_name[name] = t.detach().cpu().to(at::kFloat).contiguous();
  // A padded table keeps its rows; an unpadded one is padded to a multiple of 128, as llm.c does.
  GptShape padded = s;
  padded.rows = s.rows > s.vocab ? s.rows : (s.rows + 127) / 128 * 128;
  at::Tensor& table = by_name.at("wte.weight");
  if (padded.rows > s.rows) table = at::cat({table, at::zeros({padded.rows - s.rows, s.width}, table.options())});
  std::vector<int32_t> h(256, 0);
  const std::vector<int64_t> fields = {kLlmcMagic, 3, s.context, s.vocab, s.layers, s.heads, s.width, padded.rows};
  for (size_t i = 0; i < fields.size(); ++i) h[i] = static_cast<int32_t>(fields[i]);
  if (file.has_parent_path()) fs::create_directories(file.parent_path());
  const fs::path partial = file.string() + ".partial";
  try {
    write_all(partial, [&](std::ofstream& out) {
      out.write(reinterpret_cast<const char*>(h.data()), 1024);
      for (const auto& e : llmc_order(padded))
        for (int64_t l = 0; l < (e.per_layer ? s.layers : 1); ++l) {
          const at::Tensor& t = by_name.at(e.per_layer ? "blocks." + std::to_string(l) + "." + e.name : e.name);
          out.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
        }
    });
    fs::rename(partial, file);
  } catch (...) {
    std::error_code ec;
    fs::remove(partial, ec);
    throw;
  }
}

}  // namespace

std::string shape_problem(const GptShape& s) {
  const auto n = [](int64_t v) { return std::to_string(v); };
  if (s.width % s.heads != 0) return "width " + n(s.width) + " is not divisible by " + n(s.heads) + " heads";
  if (s.heads % s.kv_heads != 0) return n(s.kv_heads) + " key/value heads do not divide " + n(s.heads) + " heads";
  if (s.rows < s.vocab) return n(s.rows) + " table rows, fewer than the vocabulary of " + n(s.vocab);
  if (s.rotary && s.head_dim() % 2 != 0)
    return "rotary positions turn pairs of features, but each head has " + n(s.head_dim());
  if (s.rotary && !(s.rotary_base > 1.0)) return "the rotary base is " + std::to_string(s.rotary_base) + ", not > 1";
  if (!(s.norm_eps > 0.0)) return "the norms' epsilon is " + std::to_string(s.norm_eps) + ", not > 0";
  return "";
}

/// nanoGPT's ckpt.pt (train.py's torch.save): a dict whose 'model' is the state dict (under
/// "_orig_mod." when the model was compiled) and whose 'model_args' give the shape.
Published nanogpt_shape(const fs::path& file) {
  const PyValue ckpt = read_torch_save(file);
  const PyValue* model = ckpt.get("model");
  const PyValue* args = ckpt.get("model_args");
  if (!model || !args || model->kind != PyValue::Kind::Dict || args->kind != PyValue::Kind::Dict) {
    // A bare state dict of nanoGPT's names ("transformer.wte.weight") lacks the shape model_args give.
    // (Hugging Face's pytorch_model.bin has them too, with its attention's masked_bias buffers.)
    bool gpt_names = false, hugging_face = file.filename() == "pytorch_model.bin";
    if (ckpt.kind == PyValue::Kind::Dict && ckpt.entries)
      for (const auto& [key, value] : *ckpt.entries) {
        if (key.kind != PyValue::Kind::String) continue;
        gpt_names = gpt_names || key.s.find("transformer.wte.") != std::string::npos;
        hugging_face = hugging_face || key.s.find(".attn.masked_bias") != std::string::npos;
      }
    const char* hint = hugging_face ? "; it is a Hugging Face model's pickle: give the folder of its config.json and "
                                      "model.safetensors (the same weights as safetensors)"
                       : gpt_names  ? "; it holds nanoGPT's names without the model_args that give its shape: save "
                                      "train.py's checkpoint dict ({'model': state_dict, 'model_args': {...}})"
                                    : "; a plain dict of tensors by trainkit's names loads with [model] init";
    throw Error(file.string() + ": a torch.save file, but not nanoGPT's checkpoint (a dict with 'model' and 'model_args', "
                "got a " + ckpt.type_name() + ")" + hint);
  }
  Problems problems;
  const auto count = [&](const char* key) -> int64_t {
    const PyValue* v = args->get(key);
    if (!v || v->kind != PyValue::Kind::Int || v->i < 1) {
      problems.add(std::string("model_args['") + key + "']: expected a whole number >= 1, got " + (v ? v->type_name() : "nothing"));
      return 1;
    }
    return v->i;
  };
  Published p;
  p.format = nanogpt_family().name;
  p.source = file.string();
  GptShape& s = p.shape;
  s.layers = count("n_layer");
  s.heads = s.kv_heads = count("n_head");
  s.width = count("n_embd");
  s.context = count("block_size");
  s.vocab = s.rows = count("vocab_size");
  s.mlp_width = 4 * s.width;
  s.mlp = "gelu";  // nn.GELU(), exact
  const PyValue* bias = args->get("bias");
  if (bias && bias->kind != PyValue::Kind::Bool) problems.add("model_args['bias']: expected True or False, got " + bias->type_name());
  s.bias = !bias || bias->kind != PyValue::Kind::Bool || bias->b;
  problems.raise(file.string() + ": nanoGPT's model_args:");
  for (const auto& [key, value] : *model->entries) {
    if (key.kind != PyValue::Kind::String || value.kind != PyValue::Kind::Tensor)
      throw Error(file.string() + ": its 'model' holds a " + key.type_name() + " -> " + value.type_name() + " entry, not name -> tensor");
    const std::string name = key.s.rfind("_orig_mod.", 0) == 0 ? key.s.substr(10) : key.s;  // torch.compile's prefix
    p.raw.emplace_back(name, value.tensor);
  }
  return p;
}

namespace {

/// What `file` is when it is a file trainkit reads as part of another kind of checkpoint, or in
/// another format, from its name and first 9 bytes (`magic`); "" when none of those.
std::string misplaced_kind(const fs::path& file, const unsigned char* magic) {
  uint64_t header = 0;  // a safetensors file: the JSON header's length, little-endian, then '{'
  for (int i = 7; i >= 0; --i) header = header << 8 | magic[i];
  if (file.extension() == ".safetensors" || (magic[8] == '{' && header > 1 && header < (uint64_t{1} << 32)))
    return "a safetensors file: give the folder that holds it with its config.json (a Hugging Face checkpoint)";
  if (file.extension() == ".json" || magic[0] == '{')
    return "a JSON file: give the folder that holds it (a Hugging Face checkpoint: config.json beside model.safetensors)";
  if (magic[0] == 0x80 && magic[1] >= 2 && magic[1] <= 5)  // a pickle: torch.save before PyTorch 1.6 (_use_new_zipfile_serialization=False)
    return "a torch.save file in the legacy format (a pickle, not a zip), which trainkit does not read: save it again "
           "with torch.save of PyTorch 1.6 or later, without _use_new_zipfile_serialization=False";
  return "";
}

}  // namespace

Published read_published_shape(const fs::path& where) {
  if (fs::is_directory(where)) {
    Published p = huggingface_shape(where);
    if (const std::string why = shape_problem(p.shape); !why.empty()) throw Error(where.string() + "/config.json: " + why);
    return p;
  }
  if (!fs::exists(where)) throw Error(where.string() + ": no such file or folder");
  if (!fs::is_regular_file(where))  // a pipe or a device could wait for a writer, or never end
    throw Error(where.string() + ": not a regular file (a pipe or a device?): a checkpoint is a folder or a file of known size");
  unsigned char magic[9] = {};
  std::ifstream(where, std::ios::binary).read(reinterpret_cast<char*>(magic), sizeof magic);
  if (const std::string kind = misplaced_kind(where, magic); !kind.empty()) throw Error(where.string() + ": " + kind);
  if (std::memcmp(magic, "PK\x03\x04", 4) == 0) {  // a zip: torch.save's format
    Published p = nanogpt_shape(where);
    if (const std::string why = shape_problem(p.shape); !why.empty()) throw Error(where.string() + ": " + why);
    return p;
  }
  return llmc_shape(where);
}

void read_published_tensors(Published& p) {
  if (p.format == nanogpt_family().name) {
    const NamedTensors raw = std::move(p.raw);
    p.raw.clear();
    return read_family(p, nanogpt_family(), {{fs::path(p.source).filename().string(), raw}});
  }
  if (p.format == gpt2_family().name || p.format == llama_family().name) {
    std::vector<std::pair<std::string, NamedTensors>> sources;
    for (const auto& file : weight_files(p.source)) sources.emplace_back(file.filename().string(), load_safetensors(file));
    return read_family(p, p.format == gpt2_family().name ? gpt2_family() : llama_family(), sources);
  }
  read_llmc(p);
}

void load_published(const Published& from, const std::vector<std::pair<std::string, at::Tensor>>& params) {
  std::map<std::string, at::Tensor> given(from.tensors.begin(), from.tensors.end());
  Problems problems, damaged;
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
    else if (const int64_t bad = nonfinite_count(src); bad > 0)
      // It would surface as a non-finite loss at the first step, blamed on the learning rate.
      damaged.add("'" + name + "'" + origin(name) + ": " + std::to_string(bad) + " of its " + std::to_string(src.numel()) +
                  " values are NaN or infinite");
    else {
      torch::NoGradGuard no_grad;
      at::Tensor target = dst;
      target.copy_(src);
    }
    given.erase(it);
  }
  for (const auto& [name, t] : given) problems.add("'" + name + "'" + origin(name) + ": the model has no such parameter");
  problems.raise(from.source + " (" + from.format + ") does not fit the model its configuration describes:");
  damaged.raise(from.source + " (" + from.format + ") holds values that are not finite (a damaged or diverged checkpoint):");
}

std::vector<std::string> published_formats() { return {"huggingface", "llmc"}; }

void write_published(const GptShape& s, const NamedTensors& params, const std::string& format, const fs::path& where,
                     int64_t max_file_bytes) {
  if (format == "huggingface") return write_huggingface(s, params, where, max_file_bytes);
  if (format == "llmc") return write_llmc(s, params, where);
  throw Error("no export format '" + format + "' (formats: huggingface, llmc)");
}

}  // namespace tk::models
