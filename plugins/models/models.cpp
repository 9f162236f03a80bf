// The built-in models: an MLP, a small CNN, a decoder-only Transformer (GPT), and any module
// exported from Python with TorchScript.
#include <ATen/ops/_sparse_coo_tensor_unsafe.h>
#include <ATen/ops/_unique.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/jit/passes/tensorexpr_fuser.h>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <optional>
#include <utility>

#include <tk/abi.h>
#include <tk/blocks.h>
#include <tk/export.h>
#include <tk/kernels.h>

#include "published.h"

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

/// Refuses a model whose weights (4 bytes a parameter: built in float32) could not fit this
/// machine's memory, before allocating them. Whether its training state fits (gradients, the
/// optimizer's state, each perhaps sharded over the ranks) the core reckons once the run's plugins
/// are known.
void require_parameters_fit(const Options& o, const char* key, double parameters) {
  char n[32];
  std::snprintf(n, sizeof n, "%.3g", parameters);
  require_memory(o, key, 4.0 * parameters, "a model of " + std::string(n) + " parameters (its float32 weights)");
}

/// Refuses token-id inputs for models that take real-valued features.
void need_real_inputs(const Options& o, const DataInfo& d, const std::string& model) {
  if (d.vocab > 0)
    o.fail("name", "model '" + model + "' takes real-valued inputs, but the data gives " + d.describe() +
                       " (use model 'gpt' for token ids)");
}

// ---------------------------------------------------------------- MLP

class Mlp : public Model, public ModelWithBlocks, public ModelWithFlops {
 public:
  Mlp(int64_t in, const std::vector<int64_t>& hidden, int64_t out, std::string activation, bool batchnorm) {
    dims_.push_back(in);
    dims_.insert(dims_.end(), hidden.begin(), hidden.end());
    dims_.push_back(out);
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
  /// Per row of the last dimension: 2 * in * out for each linear layer, times 3 for backward.
  double train_flops(c10::IntArrayRef sizes) const override {
    double rows = 1, macs = 0;
    for (size_t i = 0; i + 1 < sizes.size(); ++i) rows *= static_cast<double>(sizes[i]);
    for (size_t i = 0; i + 1 < dims_.size(); ++i) macs += static_cast<double>(dims_[i]) * static_cast<double>(dims_[i + 1]);
    return 3.0 * 2.0 * rows * macs;
  }

 private:
  std::vector<int64_t> dims_;  // input, hidden..., output
  torch::nn::ModuleList linears_;
  torch::nn::ModuleList norms_;
  torch::nn::Linear head_{nullptr};
  Blocks blocks_;
};

// ---------------------------------------------------------------- CNN

/// conv -> [BatchNorm] -> ReLU -> 2x2 max-pool per entry of `channels`, then a hidden layer and
/// the classifier.
class Cnn : public Model, public ModelWithBlocks, public ModelWithFlops {
 public:
  Cnn(const std::vector<int64_t>& shape, const std::vector<int64_t>& channels, int64_t kernel, int64_t hidden,
      int64_t out, bool batchnorm, double dropout)
      : dropout_(dropout) {
    int64_t c = shape[0], h = shape[1], w = shape[2];
    for (int64_t ch : channels) {
      // A same-padded convolution: every output pixel of the stage's input size, k*k*c_in MACs each.
      per_example_macs_ += static_cast<double>(kernel * kernel * c * ch) * static_cast<double>(h * w);
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
    per_example_macs_ += static_cast<double>(c * h * w * hidden + hidden * out);
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
  /// Per image: the convolutions' and linear layers' MACs, times 2, times 3 for backward.
  double train_flops(c10::IntArrayRef sizes) const override {
    return 3.0 * 2.0 * static_cast<double>(sizes.empty() ? 0 : sizes[0]) * per_example_macs_;
  }

 private:
  double dropout_;
  double per_example_macs_ = 0;
  torch::nn::ModuleList convs_;
  torch::nn::ModuleList norms_;
  torch::nn::Linear fc_{nullptr}, head_{nullptr};
  Blocks blocks_;
};

// ---------------------------------------------------------------- GPT

/// Rotary position embedding (RoPE, Su et al. 2021) in the half-split form GPT-NeoX and LLaMA
/// use: feature i of a head pairs with feature i + D/2, and the pair at position p turns by
/// p * base^(-2i/D). Queries and keys carry their positions, so attention scores depend only on
/// the offset between two positions. The angles are computed in float64 once per sequence length,
/// device and dtype, and shared by every block.
class Rotary {
 public:
  Rotary(int64_t head_dim, double base) : half_(head_dim / 2), base_(base) {}

  /// Turns q or k ([B, H, T, D]).
  torch::Tensor apply(const torch::Tensor& x) {
    auto [cos, sin] = angles(x.size(-2), x.options());
    auto x1 = x.narrow(-1, 0, half_), x2 = x.narrow(-1, half_, half_);
    return at::cat({x1 * cos - x2 * sin, x2 * cos + x1 * sin}, -1);
  }

 private:
  std::pair<torch::Tensor, torch::Tensor> angles(int64_t t, const at::TensorOptions& like) {
    std::lock_guard<std::mutex> lock(mutex_);  // a recomputation may run on the backward's thread
    if (!cos_.defined() || cos_.size(0) != t || cos_.device() != like.device() ||
        cos_.scalar_type() != like.dtype().toScalarType()) {
      auto f64 = at::TensorOptions().dtype(at::kDouble);
      auto inv = at::pow(base_, at::arange(0, half_, f64) * (-2.0 / static_cast<double>(2 * half_)));
      auto theta = at::outer(at::arange(t, f64), inv);  // [T, D/2]
      cos_ = at::cos(theta).to(like);
      sin_ = at::sin(theta).to(like);
    }
    return {cos_, sin_};
  }

  int64_t half_;
  double base_;
  std::mutex mutex_;
  torch::Tensor cos_, sin_;
};

/// RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) * weight over the last dimension,
/// computed in float32 at least (under autocast too), returned in the input's dtype.
class RmsNormImpl : public torch::nn::Module {
 public:
  RmsNormImpl(int64_t width, double eps) : eps_(eps) {
    weight = register_parameter("weight", at::ones({width}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const bool reduced = x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16;
    auto xf = reduced ? x.to(at::kFloat) : x;
    auto y = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps_);
    return (reduced ? y.to(x.scalar_type()) : y) * weight;
  }
  torch::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RmsNorm);

/// LayerNorm over the last dimension with a scale and, optionally, a bias (GPT-2 has one, nanoGPT's
/// bias = False models do not). Its parameters are `weight` and `bias`, as torch::nn::LayerNorm's.
class LayerNormImpl : public torch::nn::Module {
 public:
  LayerNormImpl(int64_t width, double eps, bool bias) : width_(width), eps_(eps) {
    weight = register_parameter("weight", at::ones({width}));
    if (bias) this->bias = register_parameter("bias", at::zeros({width}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return at::layer_norm(x, {width_}, weight, bias, eps_); }
  torch::Tensor weight, bias;

 private:
  int64_t width_;
  double eps_;
};
TORCH_MODULE(LayerNorm);

/// LayerNorm or RMSNorm, by the shape's choice, registered in `owner` under `name`: a LayerNorm's
/// parameters stay `name.weight` and `name.bias`, an RMSNorm has `name.weight` only.
struct Norm {
  Norm() = default;
  Norm(torch::nn::Module& owner, const std::string& name, const GptShape& s) {
    if (s.rms_norm)
      rms = owner.register_module(name, RmsNorm(s.width, s.norm_eps));
    else
      ln = owner.register_module(name, LayerNorm(s.width, s.norm_eps, s.bias));
  }
  torch::Tensor operator()(const torch::Tensor& x) { return rms ? rms->forward(x) : ln->forward(x); }

  LayerNorm ln{nullptr};
  RmsNorm rms{nullptr};
};

/// Causal self-attention with `heads` query heads and `kv_heads` key/value heads: each key/value
/// head serves heads / kv_heads consecutive query heads (grouped-query attention; multi-head when
/// equal). attn.qkv's rows are the queries', then the keys', then the values'.
class CausalSelfAttention : public torch::nn::Module {
 public:
  CausalSelfAttention(const GptShape& s, std::shared_ptr<Rotary> rotary)
      : heads_(s.heads), kv_heads_(s.kv_heads), dim_(s.head_dim()), dropout_(s.dropout), rotary_(std::move(rotary)) {
    qkv_ = register_module("qkv", torch::nn::Linear(torch::nn::LinearOptions(s.width, (s.heads + 2 * s.kv_heads) * dim_).bias(s.bias)));
    proj_ = register_module("proj", torch::nn::Linear(torch::nn::LinearOptions(s.heads * dim_, s.width).bias(s.bias)));
  }
  torch::Tensor forward(const torch::Tensor& x) {  // [B, T, C]
    const int64_t b = x.size(0), t = x.size(1);
    const auto qkv = qkv_->forward(x);
    const auto heads = [&](int64_t from, int64_t n) {  // [B, n, T, D]
      return qkv.narrow(-1, from * dim_, n * dim_).view({b, t, n, dim_}).transpose(1, 2);
    };
    auto q = heads(0, heads_), k = heads(heads_, kv_heads_), v = heads(heads_ + kv_heads_, kv_heads_);
    if (rotary_) {
      q = rotary_->apply(q);
      k = rotary_->apply(k);
    }
    if (kv_heads_ != heads_) {
      k = k.repeat_interleave(heads_ / kv_heads_, 1);
      v = v.repeat_interleave(heads_ / kv_heads_, 1);
    }
    auto y = kernels::causal_attention(q, k, v, is_training() ? dropout_ : 0.0);
    return proj_->forward(y.transpose(1, 2).reshape({b, t, heads_ * dim_}));
  }
  torch::nn::Linear& proj() { return proj_; }

 private:
  int64_t heads_, kv_heads_, dim_;
  double dropout_;
  std::shared_ptr<Rotary> rotary_;
  torch::nn::Linear qkv_{nullptr}, proj_{nullptr};
};

/// A pre-norm block: attention, then an MLP of GELU (exact or GPT-2's tanh form) or SwiGLU, whose
/// fc holds the gate's rows, then the up projection's: proj(silu(gate(x)) * up(x)).
class GptBlock : public torch::nn::Module {
 public:
  GptBlock(const GptShape& s, std::shared_ptr<Rotary> rotary) : dropout_(s.dropout), mlp_(s.mlp) {
    ln1_ = Norm(*this, "ln1", s);
    attn_ = register_module("attn", std::make_shared<CausalSelfAttention>(s, std::move(rotary)));
    ln2_ = Norm(*this, "ln2", s);
    const int64_t fc_rows = (s.mlp == "swiglu" ? 2 : 1) * s.mlp_width;
    fc_ = register_module("fc", torch::nn::Linear(torch::nn::LinearOptions(s.width, fc_rows).bias(s.bias)));
    proj_ = register_module("proj", torch::nn::Linear(torch::nn::LinearOptions(s.mlp_width, s.width).bias(s.bias)));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = x + drop(attn_->forward(ln1_(x)));
    return x + drop(proj_->forward(hidden(fc_->forward(ln2_(x)))));
  }
  /// The two projections that write into the residual stream.
  std::vector<torch::Tensor> residual_weights() { return {attn_->proj()->weight, proj_->weight}; }

 private:
  torch::Tensor hidden(const torch::Tensor& h) const {
    if (mlp_ == "gelu") return at::gelu(h);
    if (mlp_ == "gelu_tanh") return at::gelu(h, "tanh");
    const auto halves = h.chunk(2, -1);
    return at::silu(halves[0]) * halves[1];
  }
  torch::Tensor drop(const torch::Tensor& x) const {
    return dropout_ > 0.0 ? at::dropout(x, dropout_, is_training()) : x;
  }
  double dropout_;
  std::string mlp_;
  Norm ln1_, ln2_;
  std::shared_ptr<CausalSelfAttention> attn_;
  torch::nn::Linear fc_{nullptr}, proj_{nullptr};
};

/// The token embedding's lookup when the head is tied to the table, on the CPU. Its backward hands
/// autograd the table's gradient as a sparse one: a row per distinct token, each the sum of its
/// positions' gradients in position order, as the dense backward sums them. Autograd adds it into
/// the head's dense gradient of the same table, where the dense backward would fill a zeroed
/// table-sized tensor and then add all of it (GPT-2's table is 154 MB in float32: about 460 MB of
/// memory traffic a step saved). The sum is the same to the bit: each row is the head's plus the
/// same sum of positions.
struct TiedLookup : torch::autograd::Function<TiedLookup> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& table, const at::Tensor& ids) {
    ctx->save_for_backward({ids});
    ctx->saved_data["rows"] = table.size(0);
    return at::embedding(table, ids);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor ids = ctx->get_saved_variables()[0].reshape({-1}).to(at::kLong);
    const at::Tensor g = grads[0].reshape({ids.numel(), -1});
    const auto [distinct, inverse] = at::_unique(ids, /*sorted=*/true, /*return_inverse=*/true);
    const at::Tensor sums = at::zeros({distinct.numel(), g.size(1)}, g.options()).index_add_(0, inverse, g);
    at::Tensor rows = at::_sparse_coo_tensor_unsafe(distinct.unsqueeze(0), sums,
                                                    {ctx->saved_data["rows"].toInt(), g.size(1)}, g.options());
    rows._coalesced_(true);
    return {rows, at::Tensor()};
  }
};

/// Decoder-only Transformer with pre-norm blocks: token embeddings with learned or rotary
/// positions, causal self-attention, GELU MLP, LayerNorm or RMSNorm, and a head tied to the token
/// embedding or not.
class Gpt : public Model, public ModelWithBlocks, public ModelWithFlops, public ModelWithExport {
 public:
  explicit Gpt(const GptShape& s) : shape_(s) {
    wte_ = register_module("wte", torch::nn::Embedding(s.rows, s.width));
    if (!s.rotary) wpe_ = register_module("wpe", torch::nn::Embedding(s.context, s.width));
    auto rotary = s.rotary ? std::make_shared<Rotary>(s.head_dim(), s.rotary_base) : nullptr;
    for (int64_t i = 0; i < s.layers; ++i) {
      auto block = std::make_shared<GptBlock>(s, rotary);
      blocks_->push_back(block);
      runs_.add("blocks." + std::to_string(i), std::vector<std::shared_ptr<torch::nn::Module>>(1, block), [block](const torch::Tensor& x) { return block->forward(x); });
    }
    register_module("blocks", blocks_);
    ln_f_ = Norm(*this, "ln_f", s);
    if (!s.tied) head_ = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(s.width, s.rows).bias(false)));
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
    const at::Tensor& table = wte_->weight;
    const bool sparse_rows = !head_ && table.device().is_cpu() && table.requires_grad() && at::GradMode::is_enabled();
    auto x = sparse_rows ? TiedLookup::apply(table, input) : wte_->forward(input);
    if (wpe_) x = x + wpe_->forward(at::arange(t, input.options().dtype(at::kLong)));
    if (shape_.dropout > 0.0) x = at::dropout(x, shape_.dropout, is_training());
    for (size_t i = 0; i < runs_.size(); ++i) x = runs_.run(i, x);
    x = ln_f_(x);
    // Rows past the vocabulary pad the table: their logits are not computed, so the loss and the
    // gradients are those of the unpadded model (and the padding rows' gradients are zero).
    const at::Tensor& out = head_ ? head_->weight : wte_->weight;
    return at::linear(x, out.size(0) == shape_.vocab ? out : out.narrow(0, 0, shape_.vocab));
  }
  Blocks& blocks() override { return runs_; }
  std::vector<std::string> export_formats() const override { return published_formats(); }
  void export_weights(const std::string& format, const std::filesystem::path& where, int64_t max_file_bytes) const override {
    NamedTensors params;
    for (const auto& p : named_parameters()) params.emplace_back(p.key(), p.value());
    write_published(shape_, params, format, where, max_file_bytes);
  }
  /// Per token of a [B, T] batch, forward: each block's matrix products (qkv, attention
  /// projection, MLP: 24 C^2 FLOPs for GPT-2's shape) and its attention (scores and weighted values
  /// against all T positions, as computed: 4 T C), then the head (2 C V); backward is twice that.
  double train_flops(c10::IntArrayRef sizes) const override {
    if (sizes.size() != 2) return 0.0;
    const double b = static_cast<double>(sizes[0]), t = static_cast<double>(sizes[1]);
    return 3.0 * b * t * shape_.forward_flops(t);
  }

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
  Norm ln_f_;
  torch::nn::Linear head_{nullptr};
  Blocks runs_;  // the same blocks, as recomputation sees them
};

// ---------------------------------------------------------------- TorchScript

/// A module exported from Python (torch.jit.script / torch.jit.trace + save). Its parameters and
/// buffers are registered, under the same dotted names, in a mirror of its submodule tree, so the
/// optimizer, checkpoints and weights.pt see exactly the tensors the scripted code uses.
class ScriptedModel : public Model, public CompiledModel {
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

  std::string compiled_as() const override { return "TorchScript module " + file_; }

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
  OptionSpec pretrained = opt_path("pretrained", "", "start from a published checkpoint, which also sets the shape: a "
                                   "Hugging Face folder (config.json, model.safetensors or its index) of GPT-2 or Llama, "
                                   "or llm.c's GPT-2 .bin");
  pretrained.selects = true;  // [model] pretrained = "DIR" needs no name
  return {pretrained,
          opt_int("layers", 4, "Transformer blocks"),
          opt_int("heads", 4, "attention heads per block (width must be divisible by heads)"),
          opt_int("kv_heads", 0, "key/value heads, dividing heads (fewer: grouped-query attention; 0: heads)"),
          opt_int("width", 128, "embedding width (d_model)"),
          opt_int("mlp_width", 0, "hidden width of each MLP (0: 4 * width)"),
          opt_string("mlp", "gelu", "the MLP: GELU, GELU in GPT-2's tanh form, or SwiGLU (Llama's gated SiLU)",
                     {"gelu", "gelu_tanh", "swiglu"}),
          opt_bool("bias", true, "biases in the linear layers and LayerNorms"),
          opt_int("context", 0, "longest sequence, for the position embedding (0: the data's sequence length)"),
          opt_int("padded_vocab", 0, "rows of the token table and head, >= the data's vocabulary; the padding rows are "
                                     "never used and their logits never computed (0: the vocabulary)"),
          opt_float("dropout", 0.0, "dropout on embeddings, attention weights and residual branches"),
          opt_bool("tied_head", true, "the output head reuses the token embedding matrix"),
          opt_string("position", "learned", "positions: a learned embedding added to the tokens, or rotary (RoPE) on queries and keys",
                     {"learned", "rotary"}),
          opt_float("rotary_base", 10000.0, "base of the rotary angles (position \"rotary\")"),
          opt_string("norm", "layernorm", "normalization before each attention and MLP and at the end",
                     {"layernorm", "rmsnorm"}),
          opt_float("norm_eps", 0.0, "epsilon of the norms (0: 1e-5 for LayerNorm, 1e-6 for RMSNorm)")};
}

/// The options that say the GPT's shape, which a pretrained checkpoint sets instead.
constexpr const char* kShapeOptions[] = {"layers", "heads", "kv_heads", "width", "mlp_width", "mlp", "bias", "context",
                                         "padded_vocab", "tied_head", "position", "rotary_base", "norm", "norm_eps"};

GptShape gpt_shape_of(const Options& o, const DataInfo& d) {
  for (const char* k : {"layers", "heads", "width"})
    if (o.get_int(k) < 1) o.fail(k, "must be >= 1, got " + std::to_string(o.get_int(k)));
  for (const char* k : {"kv_heads", "mlp_width", "padded_vocab", "context"})
    if (o.get_int(k) < 0) o.fail(k, "must be >= 0, got " + std::to_string(o.get_int(k)));
  GptShape s;
  s.vocab = d.vocab;
  s.rows = o.get_int("padded_vocab") > 0 ? o.get_int("padded_vocab") : d.vocab;
  s.context = o.get_int("context") > 0 ? o.get_int("context") : d.input_shape[0];
  s.width = o.get_int("width");
  s.heads = o.get_int("heads");
  s.kv_heads = o.get_int("kv_heads") > 0 ? o.get_int("kv_heads") : s.heads;
  s.layers = o.get_int("layers");
  s.mlp_width = o.get_int("mlp_width") > 0 ? o.get_int("mlp_width") : 4 * s.width;
  s.mlp = o.get_string("mlp");
  s.bias = o.get_bool("bias");
  s.tied = o.get_bool("tied_head");
  s.rotary = o.get_string("position") == "rotary";
  s.rotary_base = o.get_float("rotary_base");
  s.rms_norm = o.get_string("norm") == "rmsnorm";
  s.norm_eps = o.get_float("norm_eps") > 0.0 ? o.get_float("norm_eps") : s.rms_norm ? 1e-6 : 1e-5;
  if (o.get_float("norm_eps") < 0.0) o.fail("norm_eps", "must be >= 0");
  if (s.width % s.heads != 0)
    o.fail("heads", "width " + std::to_string(s.width) + " is not divisible by " + std::to_string(s.heads) + " heads");
  if (s.heads % s.kv_heads != 0)
    o.fail("kv_heads", std::to_string(s.kv_heads) + " key/value heads do not divide " + std::to_string(s.heads) + " heads");
  if (s.rows < s.vocab)
    o.fail("padded_vocab", "is " + std::to_string(s.rows) + ", fewer rows than the vocabulary of " + std::to_string(s.vocab));
  if (s.rotary && s.head_dim() % 2 != 0)
    o.fail("position", "rotary positions turn pairs of features, but each head has " + std::to_string(s.head_dim()) +
                           " (width / heads must be even)");
  if (!(s.rotary_base > 1.0)) o.fail("rotary_base", "must be > 1, got " + c10::str(s.rotary_base));
  return s;
}

/// The shape a published checkpoint states, and the checkpoint itself; shape options the recipe
/// also sets are refused (the checkpoint's weights fit its own shape only).
Published pretrained_of(const Options& o) {
  Published p;
  try {
    p = read_published_shape(o.get_path("pretrained"));
  } catch (const std::exception& e) {
    o.fail("pretrained", message_of(e));
  }
  // A shape option set to anything but its default is refused; one at its default is what a run's
  // recipe.toml lists for every option, and the checkpoint's shape stands.
  const OptionSpecs specs = gpt_specs();
  for (const char* k : kShapeOptions) {
    const auto spec = std::find_if(specs.begin(), specs.end(), [&](const OptionSpec& x) { return x.name == k; });
    const OptionValue& def = spec->default_value;
    const bool moved = spec->type == OptionType::Int      ? o.get_int(k) != std::get<int64_t>(def)
                       : spec->type == OptionType::Float  ? o.get_float(k) != std::get<double>(def)
                       : spec->type == OptionType::Bool   ? o.get_bool(k) != std::get<bool>(def)
                                                          : o.get_string(k) != std::get<std::string>(def);
    if (o.is_set(k) && moved) o.fail(k, "is set by the checkpoint (" + p.source + "): remove it from the recipe");
  }
  return p;
}

/// Refuses a published checkpoint the data does not fit, before its tensors are read (a large
/// checkpoint is refused unread): by the shape its configuration states, which its tensors are
/// then held to.
void check_data_fits(const Options& o, const Published& p, const DataInfo& d) {
  if (p.shape.vocab != d.vocab)
    o.fail("pretrained", p.source + " (" + p.format + ") predicts a vocabulary of " + std::to_string(p.shape.vocab) +
                             " tokens by its configuration, the data's is " + std::to_string(d.vocab) +
                             ": tokenize the data with the checkpoint's tokenizer (tk-tokenize --model) and give "
                             "data.vocab = " + std::to_string(p.shape.vocab) + " (or mend its configuration, if its "
                             "token table has other rows)");
  if (p.shape.context < d.input_shape[0])
    o.fail("pretrained", p.source + " has a context of " + std::to_string(p.shape.context) + " positions by its "
                             "configuration, shorter than the data's sequences of " + std::to_string(d.input_shape[0]));
}

ModelPtr make_gpt(const Options& o, const DataInfo& d) {
  if (d.vocab < 1 || d.input_shape.size() != 1)
    o.fail("name", "model 'gpt' needs token-id sequences (e.g. data 'text'), but the data gives " + d.describe());
  if (d.output_dim != d.vocab)
    o.fail("name", "model 'gpt' predicts the next token, but the data's targets have " + std::to_string(d.output_dim) +
                       " classes for a vocabulary of " + std::to_string(d.vocab));
  const bool pretrained = !o.get_path("pretrained").empty();
  std::optional<Published> published;
  if (pretrained) {
    published = pretrained_of(o);
    check_data_fits(o, *published, d);
  }
  GptShape s = pretrained ? published->shape : gpt_shape_of(o, d);
  s.dropout = o.get_float("dropout");
  if (s.dropout < 0.0 || s.dropout >= 1.0) o.fail("dropout", "must be in [0, 1)");
  if (!pretrained && s.context < d.input_shape[0])  // a checkpoint's: check_data_fits
    o.fail("context", "is " + std::to_string(s.context) + ", shorter than the data's sequences of " +
                          std::to_string(d.input_shape[0]));
  require_parameters_fit(o, pretrained ? "pretrained" : o.get_int("context") > 0 ? "context" : "width", s.parameters());
  auto model = std::make_shared<Gpt>(s);
  if (!published) return model;
  try {
    read_published_tensors(*published);  // after the size check: a checkpoint too large is refused unread
  } catch (const std::exception& e) {
    o.fail("pretrained", message_of(e));
  }
  // A float64 checkpoint keeps its precision in a float64 run: the model takes its widest dtype
  // before the values are copied (the run converts the model to its own dtype afterwards).
  for (const auto& [name, t] : published->tensors)
    if (t.scalar_type() == at::kDouble) {
      model->to(at::kDouble);
      break;
    }
  std::vector<std::pair<std::string, at::Tensor>> params;
  for (auto& p : model->named_parameters()) params.emplace_back(p.key(), p.value());
  try {
    load_published(*published, params);
  } catch (const std::exception& e) {
    o.fail("pretrained", message_of(e));
  }
  return model;
}

OptionSpecs torchscript_specs() {
  OptionSpec file = opt_path("torchscript", "", "file written by torch.jit.save");
  file.selects = true;  // [model] torchscript = "file.pt" needs no name
  return {file};
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
              "decoder-only Transformer language model (token embeddings with learned or rotary positions, causal "
              "self-attention, LayerNorm or RMSNorm, GELU MLP, tied or untied head)",
              gpt_specs(), make_gpt);
  r.add_model("torchscript",
              "a module exported from Python with torch.jit.script/trace and torch.jit.save; its parameters are "
              "trained and saved under their Python names (shorthand: [model] torchscript = \"file.pt\")",
              torchscript_specs(), make_torchscript);
}

}  // namespace
}  // namespace tk::models

TK_LIBRARY("models", "0.3.0", tk::models::register_models)
