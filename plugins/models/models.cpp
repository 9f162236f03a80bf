// The built-in models: an MLP, a small CNN, a decoder-only Transformer (GPT), and any module
// exported from Python with TorchScript.
#include <torch/csrc/jit/passes/tensorexpr_fuser.h>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cmath>
#include <cstdio>
#include <filesystem>

#include <tk/abi.h>
#include <tk/blocks.h>
#include <tk/compat.h>

namespace tk::models {
namespace {

torch::Tensor activate(const std::string& name, const torch::Tensor& x) {
  if (name == "relu") return at::relu(x);
  if (name == "gelu") return at::gelu(x);
  return at::tanh(x);
}

void check_widths(const Options& o, const char* key) {
  for (int64_t w : o.get_ints(key))
    if (w < 1) o.fail(key, "every entry must be >= 1, got " + std::to_string(w));
}

/// Refuses a model whose parameters, gradients and optimizer state (16 bytes a parameter in
/// float32, before any activation) could not fit this machine's memory, before allocating it.
void require_parameters_fit(const Options& o, const char* key, double parameters) {
  char n[32];
  std::snprintf(n, sizeof n, "%.3g", parameters);
  require_memory(o, key, 16.0 * parameters, "a model of " + std::string(n) + " parameters (weights, gradients, optimizer state)");
}

/// Refuses token-id inputs for models that take real-valued features.
void need_real_inputs(const Options& o, const DataInfo& d, const std::string& model) {
  if (d.vocab > 0)
    o.fail("name", "model '" + model + "' takes real-valued inputs, but the data gives " + d.describe() +
                       " (use model 'gpt' for token ids)");
}

// ---------------------------------------------------------------- MLP

class Mlp : public Model, public ModelWithBlocks {
 public:
  Mlp(int64_t in, const std::vector<int64_t>& hidden, int64_t out, std::string activation, bool batchnorm) {
    int64_t width = in;
    for (int64_t h : hidden) {
      linears_->push_back(torch::nn::Linear(width, h));
      if (batchnorm) norms_->push_back(torch::nn::BatchNorm1d(h));
      width = h;
    }
    head_ = register_module("head", torch::nn::Linear(width, out));
    register_module("layers", linears_);
    if (batchnorm) register_module("norms", norms_);
    // Each hidden layer is a block: linear -> [BatchNorm] -> activation.
    for (size_t i = 0; i < linears_->size(); ++i) {
      auto linear = std::dynamic_pointer_cast<torch::nn::LinearImpl>(linears_[i]);
      auto norm = batchnorm ? std::dynamic_pointer_cast<torch::nn::BatchNorm1dImpl>(norms_[i]) : nullptr;
      std::vector<std::shared_ptr<torch::nn::Module>> modules(1, linear);
      if (norm) modules.push_back(norm);
      blocks_.add("layers." + std::to_string(i), std::move(modules), [linear, norm, activation](const torch::Tensor& x) {
        auto y = linear->forward(x);
        if (norm) y = norm->forward(y);
        return activate(activation, y);
      });
    }
  }

  torch::Tensor forward(const torch::Tensor& input) override {
    torch::Tensor x = input;
    for (size_t i = 0; i < blocks_.size(); ++i) x = blocks_.run(i, x);
    return head_->forward(x);
  }
  Blocks& blocks() override { return blocks_; }

 private:
  torch::nn::ModuleList linears_;
  torch::nn::ModuleList norms_;
  torch::nn::Linear head_{nullptr};
  Blocks blocks_;
};

// ---------------------------------------------------------------- CNN

/// conv -> [BatchNorm] -> ReLU -> 2x2 max-pool per entry of `channels`, then a hidden layer and
/// the classifier.
class Cnn : public Model, public ModelWithBlocks {
 public:
  Cnn(const std::vector<int64_t>& shape, const std::vector<int64_t>& channels, int64_t kernel, int64_t hidden,
      int64_t out, bool batchnorm, double dropout)
      : dropout_(dropout) {
    int64_t c = shape[0], h = shape[1], w = shape[2];
    for (int64_t ch : channels) {
      convs_->push_back(torch::nn::Conv2d(torch::nn::Conv2dOptions(c, ch, kernel).padding(kernel / 2)));
      if (batchnorm) norms_->push_back(torch::nn::BatchNorm2d(ch));
      c = ch;
      h /= 2;
      w /= 2;
    }
    register_module("convs", convs_);
    if (batchnorm) register_module("norms", norms_);
    fc_ = register_module("fc", torch::nn::Linear(c * h * w, hidden));
    head_ = register_module("head", torch::nn::Linear(hidden, out));
    // Each stage is a block: conv -> [BatchNorm] -> ReLU -> max-pool.
    for (size_t i = 0; i < convs_->size(); ++i) {
      auto conv = std::dynamic_pointer_cast<torch::nn::Conv2dImpl>(convs_[i]);
      auto norm = batchnorm ? std::dynamic_pointer_cast<torch::nn::BatchNorm2dImpl>(norms_[i]) : nullptr;
      std::vector<std::shared_ptr<torch::nn::Module>> modules(1, conv);
      if (norm) modules.push_back(norm);
      blocks_.add("convs." + std::to_string(i), std::move(modules), [conv, norm](const torch::Tensor& x) {
        auto y = conv->forward(x);
        if (norm) y = norm->forward(y);
        return at::max_pool2d(at::relu(y), {2, 2});
      });
    }
  }

  torch::Tensor forward(const torch::Tensor& input) override {
    torch::Tensor x = input;
    for (size_t i = 0; i < blocks_.size(); ++i) x = blocks_.run(i, x);
    x = at::relu(fc_->forward(x.flatten(1)));
    if (dropout_ > 0.0) x = at::dropout(x, dropout_, is_training());
    return head_->forward(x);
  }
  Blocks& blocks() override { return blocks_; }

 private:
  double dropout_;
  torch::nn::ModuleList convs_;
  torch::nn::ModuleList norms_;
  torch::nn::Linear fc_{nullptr}, head_{nullptr};
  Blocks blocks_;
};

// ---------------------------------------------------------------- GPT

struct GptShape {
  int64_t vocab, context, width, heads, layers;
  double dropout;
};

class CausalSelfAttention : public torch::nn::Module {
 public:
  explicit CausalSelfAttention(const GptShape& s) : heads_(s.heads), dropout_(s.dropout) {
    qkv_ = register_module("qkv", torch::nn::Linear(s.width, 3 * s.width));
    proj_ = register_module("proj", torch::nn::Linear(s.width, s.width));
  }
  torch::Tensor forward(const torch::Tensor& x) {  // [B, T, C]
    const int64_t b = x.size(0), t = x.size(1), c = x.size(2);
    auto qkv = qkv_->forward(x).view({b, t, 3, heads_, c / heads_}).permute({2, 0, 3, 1, 4});  // [3, B, H, T, D]
    auto y = compat::causal_attention(qkv[0], qkv[1], qkv[2], is_training() ? dropout_ : 0.0);
    return proj_->forward(y.transpose(1, 2).reshape({b, t, c}));
  }
  torch::nn::Linear& proj() { return proj_; }

 private:
  int64_t heads_;
  double dropout_;
  torch::nn::Linear qkv_{nullptr}, proj_{nullptr};
};

class GptBlock : public torch::nn::Module {
 public:
  explicit GptBlock(const GptShape& s) : dropout_(s.dropout) {
    ln1_ = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({s.width})));
    attn_ = register_module("attn", std::make_shared<CausalSelfAttention>(s));
    ln2_ = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({s.width})));
    fc_ = register_module("fc", torch::nn::Linear(s.width, 4 * s.width));
    proj_ = register_module("proj", torch::nn::Linear(4 * s.width, s.width));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = x + drop(attn_->forward(ln1_->forward(x)));
    return x + drop(proj_->forward(at::gelu(fc_->forward(ln2_->forward(x)))));
  }
  /// The two projections that write into the residual stream.
  std::vector<torch::Tensor> residual_weights() { return {attn_->proj()->weight, proj_->weight}; }

 private:
  torch::Tensor drop(const torch::Tensor& x) const {
    return dropout_ > 0.0 ? at::dropout(x, dropout_, is_training()) : x;
  }
  double dropout_;
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  std::shared_ptr<CausalSelfAttention> attn_;
  torch::nn::Linear fc_{nullptr}, proj_{nullptr};
};

/// Decoder-only Transformer with pre-LayerNorm blocks: token + learned position embeddings,
/// causal self-attention, GELU MLP, final LayerNorm, and a head tied to the token embedding or not.
class Gpt : public Model, public ModelWithBlocks {
 public:
  Gpt(const GptShape& s, bool tied) : shape_(s) {
    wte_ = register_module("wte", torch::nn::Embedding(s.vocab, s.width));
    wpe_ = register_module("wpe", torch::nn::Embedding(s.context, s.width));
    for (int64_t i = 0; i < s.layers; ++i) {
      auto block = std::make_shared<GptBlock>(s);
      blocks_->push_back(block);
      runs_.add("blocks." + std::to_string(i), std::vector<std::shared_ptr<torch::nn::Module>>(1, block), [block](const torch::Tensor& x) { return block->forward(x); });
    }
    register_module("blocks", blocks_);
    ln_f_ = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({s.width})));
    if (!tied) head_ = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(s.width, s.vocab).bias(false)));
    initialize();
  }

  torch::Tensor forward(const torch::Tensor& input) override {
    if (input.dim() != 2 || at::isFloatingType(input.scalar_type()))
      throw Error("model 'gpt' expects token ids [batch, positions], got " +
                  std::string(c10::toString(input.scalar_type())) + " " + c10::str(input.sizes()));
    const int64_t t = input.size(1);
    if (t > shape_.context)
      throw Error("model 'gpt': sequences of " + std::to_string(t) + " positions exceed its context of " +
                  std::to_string(shape_.context) + " (model.context)");
    auto pos = at::arange(t, input.options().dtype(at::kLong));
    auto x = wte_->forward(input) + wpe_->forward(pos);
    if (shape_.dropout > 0.0) x = at::dropout(x, shape_.dropout, is_training());
    for (size_t i = 0; i < runs_.size(); ++i) x = runs_.run(i, x);
    x = ln_f_->forward(x);
    return head_ ? head_->forward(x) : at::linear(x, wte_->weight);
  }
  Blocks& blocks() override { return runs_; }

 private:
  /// GPT-2's initialisation: N(0, 0.02) weights, zero biases, residual projections scaled by
  /// 1/sqrt(2 * layers).
  void initialize() {
    torch::NoGradGuard no_grad;
    for (const auto& m : modules(/*include_self=*/false)) {
      if (auto* linear = m->as<torch::nn::Linear>()) {
        linear->weight.normal_(0.0, 0.02);
        if (linear->bias.defined()) linear->bias.zero_();
      } else if (auto* embedding = m->as<torch::nn::Embedding>()) {
        embedding->weight.normal_(0.0, 0.02);
      }
    }
    const double scaled = 0.02 / std::sqrt(2.0 * static_cast<double>(shape_.layers));
    for (const auto& block : *blocks_)
      for (auto& w : block->as<GptBlock>()->residual_weights()) w.normal_(0.0, scaled);
  }

  GptShape shape_;
  torch::nn::Embedding wte_{nullptr}, wpe_{nullptr};
  torch::nn::ModuleList blocks_;
  torch::nn::LayerNorm ln_f_{nullptr};
  torch::nn::Linear head_{nullptr};
  Blocks runs_;  // the same blocks, as recomputation sees them
};

// ---------------------------------------------------------------- TorchScript

/// A module exported from Python (torch.jit.script / torch.jit.trace + save). Its parameters and
/// buffers are registered, under the same dotted names, in a mirror of its submodule tree, so the
/// optimizer, checkpoints and weights.pt see exactly the tensors the scripted code uses.
class ScriptedModel : public Model {
 public:
  ScriptedModel(torch::jit::Module module, std::string file) : module_(std::move(module)), file_(std::move(file)) {
    // The profiling executor would hand hot graphs to the TensorExpr fuser, whose LLVM compile
    // never finished for a small MLP on Debian's LibTorch 2.6; kernels run unfused instead.
    torch::jit::setTensorExprFuserEnabled(false);
    mirror(*this, module_);
  }

  torch::Tensor forward(const torch::Tensor& input) override {
    c10::IValue out = module_.forward({input});
    if (!out.isTensor())
      throw Error("TorchScript model " + file_ + ": forward must return one tensor, got " + out.tagKind());
    return out.toTensor();
  }

  void train(bool on) override {
    torch::nn::Module::train(on);
    module_.train(on);
  }

 private:
  static void mirror(torch::nn::Module& into, const torch::jit::Module& from) {
    for (const auto& p : from.named_parameters(/*recurse=*/false))
      into.register_parameter(p.name, p.value, p.value.requires_grad());
    for (const auto& b : from.named_buffers(/*recurse=*/false)) into.register_buffer(b.name, b.value);
    for (const auto& child : from.named_children()) {
      // Named after the scripted module's class ("BatchNorm2d"), which TorchScript keeps: what
      // the BatchNorm note and the accumulation verifier look for.
      auto sub = std::make_shared<torch::nn::Module>(class_of(child.value, child.name));
      mirror(*sub, child.value);
      into.register_module(child.name, sub);
    }
  }

  static std::string class_of(const torch::jit::Module& m, const std::string& fallback) {
    const auto type = m.type();
    return type && type->name() ? "TorchScript " + type->name()->name() : fallback;
  }

  torch::jit::Module module_;
  std::string file_;
};

OptionSpecs mlp_specs() {
  return {opt_ints("hidden", {64, 64}, "widths of the hidden layers"),
          opt_string("activation", "relu", "activation between layers", {"relu", "gelu", "tanh"}),
          opt_bool("batchnorm", false, "BatchNorm1d after each hidden layer (statistics are per micro-batch)")};
}

ModelPtr make_mlp(const Options& o, const DataInfo& d) {
  need_real_inputs(o, d, "mlp");
  check_widths(o, "hidden");
  double params = 0, in = static_cast<double>(d.input_dim);
  for (int64_t w : o.get_ints("hidden")) {
    params += (in + 1) * static_cast<double>(w);
    in = static_cast<double>(w);
  }
  require_parameters_fit(o, "hidden", params + (in + 1) * static_cast<double>(d.output_dim));
  return std::make_shared<Mlp>(d.input_dim, o.get_ints("hidden"), d.output_dim, o.get_string("activation"),
                               o.get_bool("batchnorm"));
}

OptionSpecs cnn_specs() {
  return {opt_ints("channels", {32, 64}, "output channels of each conv -> ReLU -> 2x2 max-pool stage"),
          opt_int("kernel", 3, "convolution kernel size (odd; padded to keep the size)"),
          opt_int("hidden", 128, "width of the fully connected layer before the classifier"),
          opt_bool("batchnorm", false, "BatchNorm2d after each convolution (statistics are per micro-batch)"),
          opt_float("dropout", 0.0, "dropout before the classifier")};
}

ModelPtr make_cnn(const Options& o, const DataInfo& d) {
  need_real_inputs(o, d, "cnn");
  if (d.input_shape.size() != 3)
    o.fail("name", "model 'cnn' needs image inputs [channels, height, width], but the data gives " + d.describe());
  check_widths(o, "channels");
  const int64_t k = o.get_int("kernel");
  if (k < 1 || k % 2 == 0) o.fail("kernel", "must be odd and >= 1, got " + std::to_string(k));
  if (o.get_int("hidden") < 1) o.fail("hidden", "must be >= 1");
  const double p = o.get_float("dropout");
  if (p < 0.0 || p >= 1.0) o.fail("dropout", "must be in [0, 1)");
  const int64_t pools = static_cast<int64_t>(o.get_ints("channels").size());
  if ((d.input_shape[1] >> pools) < 1 || (d.input_shape[2] >> pools) < 1)
    o.fail("channels", std::to_string(pools) + " stages halve a " + std::to_string(d.input_shape[1]) + "x" +
                           std::to_string(d.input_shape[2]) + " image to nothing");
  double params = 0, in = static_cast<double>(d.input_shape[0]);
  for (int64_t c : o.get_ints("channels")) {
    params += (in * static_cast<double>(k * k) + 1) * static_cast<double>(c);
    in = static_cast<double>(c);
  }
  const double flat = in * static_cast<double>(d.input_shape[1] >> pools) * static_cast<double>(d.input_shape[2] >> pools);
  const double hidden = static_cast<double>(o.get_int("hidden"));
  require_parameters_fit(o, "hidden", params + (flat + 1) * hidden + (hidden + 1) * static_cast<double>(d.output_dim));
  return std::make_shared<Cnn>(d.input_shape, o.get_ints("channels"), k, o.get_int("hidden"), d.output_dim,
                               o.get_bool("batchnorm"), p);
}

OptionSpecs gpt_specs() {
  return {opt_int("layers", 4, "Transformer blocks"),
          opt_int("heads", 4, "attention heads per block (width must be divisible by heads)"),
          opt_int("width", 128, "embedding width (d_model)"),
          opt_int("context", 0, "longest sequence, for the position embedding (0: the data's sequence length)"),
          opt_float("dropout", 0.0, "dropout on embeddings, attention weights and residual branches"),
          opt_bool("tied_head", true, "the output head reuses the token embedding matrix")};
}

ModelPtr make_gpt(const Options& o, const DataInfo& d) {
  if (d.vocab < 1 || d.input_shape.size() != 1)
    o.fail("name", "model 'gpt' needs token-id sequences (e.g. data 'text'), but the data gives " + d.describe());
  for (const char* k : {"layers", "heads", "width"})
    if (o.get_int(k) < 1) o.fail(k, "must be >= 1, got " + std::to_string(o.get_int(k)));
  GptShape s{d.vocab, o.get_int("context") > 0 ? o.get_int("context") : d.input_shape[0], o.get_int("width"),
             o.get_int("heads"), o.get_int("layers"), o.get_float("dropout")};
  if (s.width % s.heads != 0)
    o.fail("heads", "width " + std::to_string(s.width) + " is not divisible by " + std::to_string(s.heads) + " heads");
  if (s.context < d.input_shape[0])
    o.fail("context", "is " + std::to_string(s.context) + ", shorter than the data's sequences of " +
                          std::to_string(d.input_shape[0]));
  if (s.dropout < 0.0 || s.dropout >= 1.0) o.fail("dropout", "must be in [0, 1)");
  if (d.output_dim != d.vocab)
    o.fail("name", "model 'gpt' predicts the next token, but the data's targets have " + std::to_string(d.output_dim) +
                       " classes for a vocabulary of " + std::to_string(d.vocab));
  const double w = static_cast<double>(s.width);
  require_parameters_fit(o, o.get_int("context") > 0 ? "context" : "width",
                         static_cast<double>(s.vocab) * w * (o.get_bool("tied_head") ? 1 : 2) +
                             static_cast<double>(s.context) * w + static_cast<double>(s.layers) * (12 * w * w + 13 * w));
  return std::make_shared<Gpt>(s, o.get_bool("tied_head"));
}

OptionSpecs torchscript_specs() {
  return {opt_path("torchscript", "", "file written by torch.jit.save")};
}

ModelPtr make_torchscript(const Options& o, const DataInfo&) {
  const std::string& file = o.get_path("torchscript");
  if (file.empty()) o.fail("torchscript", "needs the file written by torch.jit.save(torch.jit.script(model), path)");
  require_file(o, "torchscript");
  torch::jit::Module m;
  try {
    m = torch::jit::load(file, at::Device(at::kCPU));
  } catch (const c10::Error& e) {
    o.fail("torchscript", file + " is not a TorchScript module this LibTorch (" + std::string(TORCH_VERSION) +
                              ") can load: " + e.what_without_backtrace());
  }
  if (!m.find_method("forward")) o.fail("torchscript", file + " has no forward method");
  if (m.parameters().size() == 0) o.fail("torchscript", file + " has no parameters to train");
  return std::make_shared<ScriptedModel>(std::move(m), file);
}

void register_models(Registry& r) {
  r.add_model("mlp", "multi-layer perceptron; acts on the last dimension (so also per sequence position)",
              mlp_specs(), make_mlp);
  r.add_model("cnn", "convolutional classifier for images [C, H, W]: conv -> ReLU -> max-pool stages, one hidden layer",
              cnn_specs(), make_cnn);
  r.add_model("gpt",
              "decoder-only Transformer language model (token + position embeddings, causal self-attention, "
              "LayerNorm, GELU MLP, tied or untied head)",
              gpt_specs(), make_gpt);
  r.add_model("torchscript",
              "a module exported from Python with torch.jit.script/trace and torch.jit.save; its parameters are "
              "trained and saved under their Python names (shorthand: [model] torchscript = \"file.pt\")",
              torchscript_specs(), make_torchscript);
}

}  // namespace
}  // namespace tk::models

TK_LIBRARY("models", "0.2.0", tk::models::register_models)
