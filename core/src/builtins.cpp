#include "tk/builtins.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <filesystem>
#include <map>

#include "components.h"
#include "tk/tensor_io.h"

namespace tk {
namespace {

uint64_t mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

at::Generator generator(uint64_t seed) { return at::detail::createCPUGenerator(seed); }

// ---------------------------------------------------------------- data

OptionSpecs synthetic_common() {
  return {opt_int("samples", 4096, "training examples"),
          opt_int("validation_samples", 1024, "held-out examples (0 for none)"),
          opt_int("features", 32, "input features per example (per position for tokens)"),
          opt_float("noise", 0.1, "label / target noise"),
          opt_int("seed", -1, "seed of the data set itself (-1: the run's seed)")};
}

/// What a data set of real-valued feature vectors tells its model and loss.
DataInfo feature_info(int64_t in, int64_t out, bool classification, std::optional<int64_t> ignore = std::nullopt) {
  DataInfo i;
  i.input_dim = in;
  i.output_dim = out;
  i.classification = classification;
  i.ignore_index = ignore;
  i.input_shape = {in};
  return i;
}

uint64_t data_seed(const Options& o, uint64_t run_seed) {
  int64_t s = o.get_int("seed");
  return s >= 0 ? static_cast<uint64_t>(s) : run_seed;
}

void check_positive(const Options& o, std::initializer_list<const char*> keys) {
  for (const char* k : keys)
    if (o.get_int(k) < 1) o.fail(k, "must be >= 1, got " + std::to_string(o.get_int(k)));
}

/// A fixed random teacher maps inputs to targets: a learnable task with a known structure.
DataSplits classification(const Options& o, uint64_t run_seed) {
  check_positive(o, {"samples", "features", "classes"});
  auto gen = generator(data_seed(o, run_seed));
  const int64_t n = o.get_int("samples"), nv = std::max<int64_t>(0, o.get_int("validation_samples"));
  const int64_t f = o.get_int("features"), c = o.get_int("classes");
  auto teacher1 = at::randn({f, 4 * c}, gen) / std::sqrt(static_cast<double>(f));
  auto teacher2 = at::randn({4 * c, c}, gen);
  auto x = at::randn({n + nv, f}, gen);
  auto logits = at::tanh(x.matmul(teacher1)).matmul(teacher2) + o.get_float("noise") * at::randn({n + nv, c}, gen);
  auto y = logits.argmax(1);
  DataSplits d;
  d.info = feature_info(f, c, true);
  d.train = std::make_shared<TensorDataset>(x.slice(0, 0, n), y.slice(0, 0, n));
  if (nv > 0) d.validation = std::make_shared<TensorDataset>(x.slice(0, n), y.slice(0, n));
  return d;
}

DataSplits regression(const Options& o, uint64_t run_seed) {
  check_positive(o, {"samples", "features", "outputs"});
  auto gen = generator(data_seed(o, run_seed));
  const int64_t n = o.get_int("samples"), nv = std::max<int64_t>(0, o.get_int("validation_samples"));
  const int64_t f = o.get_int("features"), k = o.get_int("outputs");
  auto w1 = at::randn({f, 32}, gen) / std::sqrt(static_cast<double>(f));
  auto w2 = at::randn({32, k}, gen) / std::sqrt(32.0);
  auto x = at::randn({n + nv, f}, gen);
  auto y = at::tanh(x.matmul(w1)).matmul(w2) + o.get_float("noise") * at::randn({n + nv, k}, gen);
  DataSplits d;
  d.info = feature_info(f, k, false);
  d.train = std::make_shared<TensorDataset>(x.slice(0, 0, n), y.slice(0, 0, n));
  if (nv > 0) d.validation = std::make_shared<TensorDataset>(x.slice(0, n), y.slice(0, n));
  return d;
}

/// Variable-length sequences: each example has a random length; padded positions are ignored.
DataSplits tokens(const Options& o, uint64_t run_seed) {
  check_positive(o, {"samples", "features", "classes", "seq_len", "min_len"});
  auto gen = generator(data_seed(o, run_seed));
  const int64_t n = o.get_int("samples"), nv = std::max<int64_t>(0, o.get_int("validation_samples"));
  const int64_t f = o.get_int("features"), c = o.get_int("classes"), t = o.get_int("seq_len");
  const int64_t lo = o.get_int("min_len");
  if (lo > t) o.fail("min_len", "must be <= seq_len (" + std::to_string(t) + "), got " + std::to_string(lo));
  const int64_t ignore = o.get_int("ignore_index");
  auto teacher = at::randn({f, c}, gen);
  auto x = at::randn({n + nv, t, f}, gen);
  auto y = (x.matmul(teacher) + o.get_float("noise") * at::randn({n + nv, t, c}, gen)).argmax(2);
  auto len = at::randint(lo, t + 1, {n + nv, 1}, gen);
  auto pad = at::arange(t).unsqueeze(0) >= len;  // [N, T]
  x = x.masked_fill(pad.unsqueeze(2), 0.0);
  y = y.masked_fill(pad, ignore);
  DataSplits d;
  d.info = feature_info(f, c, true, ignore);
  d.info.input_shape = {t, f};
  d.train = std::make_shared<TensorDataset>(x.slice(0, 0, n), y.slice(0, 0, n), ignore);
  if (nv > 0) d.validation = std::make_shared<TensorDataset>(x.slice(0, n), y.slice(0, n), ignore);
  return d;
}

/// A data set prepared anywhere (typically Python's torch.save of a dict of tensors): inputs
/// [N, ...], targets [N] / [N, T] (class indices) or [N, K] (real values), optional mask [N, T].
DataSplits tensor_file(const Options& o, uint64_t) {
  const std::string& path = o.get_string("path");
  if (path.empty()) o.fail("path", "needs the file written by torch.save({\"inputs\": ..., \"targets\": ...})");
  if (!std::filesystem::is_regular_file(path)) o.fail("path", "no such file: " + path);
  std::map<std::string, torch::Tensor> t;
  for (auto& [k, v] : load_tensor_dict(path)) t.emplace(k, v);
  auto need = [&](const std::string& key) {
    auto it = t.find(o.get_string(key));
    if (it == t.end()) {
      std::string have;
      for (const auto& kv : t) have += (have.empty() ? "" : ", ") + kv.first;
      o.fail(key, "the file has no tensor '" + o.get_string(key) + "'; it has: " + have);
    }
    return it->second;
  };
  torch::Tensor x = need("inputs"), y = need("targets");
  if (x.dim() < 2 || x.size(0) != y.size(0))
    o.fail("inputs", "expected inputs [N, features], [N, T, features] or images [N, C, H, W] and targets with the same N, got " +
                         c10::str(x.sizes()) + " and " + c10::str(y.sizes()));
  const bool tokens_in = o.get_bool("token_inputs");
  if (tokens_in && (x.dim() != 2 || at::isFloatingType(x.scalar_type()) || x.min().item<int64_t>() < 0))
    o.fail("token_inputs", "needs inputs of non-negative integer token ids [N, T], got " +
                               std::string(c10::toString(x.scalar_type())) + " " + c10::str(x.sizes()));
  x = tokens_in ? x.to(at::kLong) : x.to(at::kFloat);
  const bool classes = !at::isFloatingType(y.scalar_type());
  const int64_t ignore = o.get_int("ignore_index");
  std::optional<int64_t> ignore_index;
  if (!o.get_string("mask").empty()) {
    auto m = t.find(o.get_string("mask"));
    if (m == t.end()) o.fail("mask", "the file has no tensor '" + o.get_string("mask") + "'");
    if (!classes || m->second.sizes() != y.sizes())
      o.fail("mask", "a mask needs class targets of its shape, got mask " + c10::str(m->second.sizes()) +
                         " and targets " + c10::str(y.sizes()));
    y = y.masked_fill(m->second == 0, ignore);
    ignore_index = ignore;
  }
  y = classes ? y.to(at::kLong) : (y.dim() == 1 ? y.unsqueeze(1) : y).to(at::kFloat);
  const int64_t n = x.size(0);
  const double frac = o.get_float("validation_fraction");
  if (frac < 0 || frac >= 1) o.fail("validation_fraction", "must be in [0, 1)");
  const int64_t nv = static_cast<int64_t>(std::floor(frac * static_cast<double>(n)));
  DataSplits d;
  int64_t out = y.size(-1);  // regression: targets per example
  if (classes) {              // classes: the largest counted target + 1
    const torch::Tensor counted = y.masked_select(y != ignore);
    out = counted.numel() ? counted.max().item<int64_t>() + 1 : 1;
  }
  d.info = feature_info(x.size(-1), o.get_int("classes") > 0 ? o.get_int("classes") : out, classes, ignore_index);
  d.info.input_shape = x.sizes().slice(1).vec();
  if (tokens_in) {
    // One vocabulary for inputs and targets: a language model predicts the tokens it reads.
    d.info.vocab = std::max(d.info.output_dim, x.max().item<int64_t>() + 1);
    d.info.output_dim = d.info.input_dim = d.info.vocab;
    d.info.next_token = classes && y.sizes() == x.sizes();
  }
  d.train = std::make_shared<TensorDataset>(x.slice(0, 0, n - nv), y.slice(0, 0, n - nv), ignore);
  if (nv > 0) d.validation = std::make_shared<TensorDataset>(x.slice(0, n - nv), y.slice(0, n - nv), ignore);
  return d;
}

// ---------------------------------------------------------------- losses

Reduction reduction_of(const Options& o) {
  return o.get_string("reduction") == "sum" ? Reduction::Sum : Reduction::Mean;
}
int64_t at_reduction(Reduction r) { return r == Reduction::Sum ? at::Reduction::Sum : at::Reduction::Mean; }

class CrossEntropy : public LossFn {
 public:
  explicit CrossEntropy(const Options& o)
      : LossFn(reduction_of(o)), ignore_(o.get_int("ignore_index")), smoothing_(o.get_float("label_smoothing")) {}
  torch::Tensor operator()(const torch::Tensor& out, const Batch& b) const override {
    const int64_t c = out.size(-1);
    return at::cross_entropy_loss(out.reshape({-1, c}), b.target.reshape({-1}), {}, at_reduction(reduction()),
                                  ignore_, smoothing_);
  }

 private:
  int64_t ignore_;
  double smoothing_;
};

class Mse : public LossFn {
 public:
  explicit Mse(const Options& o) : LossFn(reduction_of(o)) {}
  torch::Tensor operator()(const torch::Tensor& out, const Batch& b) const override {
    return at::mse_loss(out, b.target.reshape(out.sizes()), at_reduction(reduction()));
  }
};

// ---------------------------------------------------------------- schedules

class ConstantLr : public LrSchedule {
 public:
  explicit ConstantLr(double lr) : lr_(lr) {}
  double lr(int64_t, int64_t) const override { return lr_; }

 private:
  double lr_;
};

class WarmupCosine : public LrSchedule {
 public:
  WarmupCosine(double base, int64_t warmup, double min_lr) : base_(base), min_(min_lr), warmup_(warmup) {}
  double lr(int64_t step, int64_t total) const override {
    if (step < warmup_) return base_ * static_cast<double>(step + 1) / static_cast<double>(warmup_);
    const double span = static_cast<double>(std::max<int64_t>(1, total - warmup_));
    const double t = std::min(1.0, static_cast<double>(step - warmup_) / span);
    return min_ + 0.5 * (base_ - min_) * (1.0 + std::cos(M_PI * t));
  }

 private:
  double base_, min_;
  int64_t warmup_;
};

void check_lr(const Options& o) {
  if (!(o.get_float("lr") > 0.0)) o.fail("lr", "must be > 0, got " + to_toml(o.get_float("lr")));
}

std::tuple<double, double> betas_of(const Options& o) {
  const auto& b = o.get_floats("betas");
  if (b.size() != 2) o.fail("betas", "expected 2 values, got " + std::to_string(b.size()));
  for (double v : b)
    if (v < 0.0 || v >= 1.0) o.fail("betas", "each must be in [0, 1), got " + to_toml(v));
  return {b[0], b[1]};
}

OptionSpecs adam_specs(double weight_decay) {
  return {opt_float("lr", 1e-3, "learning rate (the schedule's base)"),
          opt_floats("betas", {0.9, 0.999}, "coefficients of the running averages"),
          opt_float("eps", 1e-8, "added to the denominator"),
          opt_float("weight_decay", weight_decay, "weight decay"),
          opt_bool("amsgrad", false, "use the AMSGrad variant")};
}

}  // namespace

std::string DataInfo::describe() const {
  std::string shape = "[";
  for (size_t i = 0; i < input_shape.size(); ++i) shape += (i ? ", " : "") + std::to_string(input_shape[i]);
  shape += "]";
  if (vocab > 0) return "token ids " + shape + " from a vocabulary of " + std::to_string(vocab);
  if (input_shape.size() == 3) return "images " + shape;
  return "features [" + std::to_string(input_dim) + "]";
}

bool has_batchnorm(torch::nn::Module& m) {
  for (const auto& sub : m.modules(/*include_self=*/true)) {
    const std::string n = sub->name();
    if (n.find("BatchNorm") != std::string::npos) return true;
  }
  return false;
}

TensorDataset::TensorDataset(torch::Tensor inputs, torch::Tensor targets, int64_t ignore_index)
    : inputs_(std::move(inputs)), targets_(std::move(targets)), ignore_index_(ignore_index) {
  if (inputs_.size(0) != targets_.size(0))
    throw Error("data set has " + std::to_string(inputs_.size(0)) + " inputs but " +
                std::to_string(targets_.size(0)) + " targets");
}

Batch TensorDataset::get(const torch::Tensor& indices) const {
  Batch b;
  b.input = inputs_.index_select(0, indices);
  b.target = targets_.index_select(0, indices);
  b.samples = indices.size(0);
  b.tokens = at::isFloatingType(b.target.scalar_type()) ? b.samples
                                                        : (b.target != ignore_index_).sum().item<int64_t>();
  return b;
}

torch::Tensor epoch_order(int64_t n, uint64_t seed, int64_t epoch, bool shuffle) {
  if (!shuffle) return at::arange(n, at::kLong);
  auto gen = generator(mix(mix(seed) ^ static_cast<uint64_t>(epoch)));
  return at::randperm(n, gen, at::kLong);
}

double get_lr(const torch::optim::Optimizer& opt) { return opt.param_groups().front().options().get_lr(); }
void set_lr(torch::optim::Optimizer& opt, double lr) {
  for (auto& g : opt.param_groups()) g.options().set_lr(lr);
}

const std::vector<Component<ModelMaker>>& models() {
  static const std::vector<Component<ModelMaker>> list = {
      {"mlp", "multi-layer perceptron; acts on the last dimension (so also per sequence position)",
       detail::mlp_specs(), detail::make_mlp},
      {"cnn", "convolutional classifier for images [C, H, W]: conv -> ReLU -> max-pool stages, one hidden layer",
       detail::cnn_specs(), detail::make_cnn},
      {"gpt", "decoder-only Transformer language model (token + position embeddings, causal self-attention, "
              "LayerNorm, GELU MLP, tied or untied head)",
       detail::gpt_specs(), detail::make_gpt},
      {"torchscript", "a module exported from Python with torch.jit.script/trace and torch.jit.save; its "
                      "parameters are trained and saved under their Python names (shorthand: [model] torchscript = \"file.pt\")",
       detail::torchscript_specs(), detail::make_torchscript},
  };
  return list;
}

const std::vector<Component<DataMaker>>& datasets() {
  static const std::vector<Component<DataMaker>> list = [] {
    auto cls = synthetic_common();
    cls.push_back(opt_int("classes", 10, "number of classes"));
    auto reg = synthetic_common();
    reg.push_back(opt_int("outputs", 1, "regression targets per example"));
    auto tok = synthetic_common();
    tok.push_back(opt_int("classes", 10, "number of classes per position"));
    tok.push_back(opt_int("seq_len", 16, "positions per sequence"));
    tok.push_back(opt_int("min_len", 1, "shortest sequence; lengths are uniform in [min_len, seq_len]"));
    tok.push_back(opt_int("ignore_index", -100, "target value of padded positions"));
    return std::vector<Component<DataMaker>>{
        {"synthetic-classification", "seeded Gaussian inputs labelled by a fixed random teacher network", cls,
         classification},
        {"synthetic-regression", "seeded Gaussian inputs, targets from a fixed random teacher network plus noise",
         reg, regression},
        {"synthetic-tokens", "variable-length sequences with per-position classes; padding is ignored", tok,
         tokens},
        {"tensors", "a dict of tensors saved by torch.save (inputs, targets, optional mask); the last "
                    "validation_fraction of the examples is held out",
         {opt_string("path", "", "the file (relative to the working directory)"),
          opt_string("inputs", "inputs", "key of the inputs [N, features] or [N, T, features]"),
          opt_string("targets", "targets", "key of the targets: class indices [N] / [N, T], or reals [N, K]"),
          opt_string("mask", "", "key of a 0/1 mask [N, T] of the targets that count (\"\": none)"),
          opt_int("classes", 0, "number of classes (0: the largest target + 1); with token_inputs, the vocabulary"),
          opt_bool("token_inputs", false, "inputs are integer token ids [N, T] (for model 'gpt'), not features"),
          opt_int("ignore_index", -100, "target value given to masked-out positions"),
          opt_float("validation_fraction", 0.0, "fraction of the examples, taken from the end, held out")},
         tensor_file},
        {"fashion-mnist", "Fashion-MNIST from Debian's dataset-fashion-mnist package: 60000 training images "
                          "[1, 28, 28] in 10 classes; the 10000 test images validate",
         detail::fashion_mnist_specs(), detail::make_fashion_mnist},
        {"text", "byte- or character-level language modelling on a text file: predict each next token",
         detail::text_specs(), detail::make_text},
    };
  }();
  return list;
}

const std::vector<Component<LossMaker>>& losses() {
  static const std::vector<Component<LossMaker>> list = {
      {"cross_entropy", "cross-entropy over the last dimension; targets equal to ignore_index do not count",
       {opt_string("reduction", "mean", "mean or sum over counted items", {"mean", "sum"}),
        opt_int("ignore_index", -100, "target value that does not count"),
        opt_float("label_smoothing", 0.0, "label smoothing in [0, 1)")},
       [](const Options& o) -> std::unique_ptr<LossFn> {
         double ls = o.get_float("label_smoothing");
         if (ls < 0.0 || ls >= 1.0) o.fail("label_smoothing", "must be in [0, 1), got " + to_toml(ls));
         return std::make_unique<CrossEntropy>(o);
       }},
      {"mse", "mean squared error",
       {opt_string("reduction", "mean", "mean or sum over elements", {"mean", "sum"})},
       [](const Options& o) -> std::unique_ptr<LossFn> { return std::make_unique<Mse>(o); }},
  };
  return list;
}

const std::vector<Component<OptimizerMaker>>& optimizers() {
  using torch::optim::Optimizer;
  static const std::vector<Component<OptimizerMaker>> list = {
      {"sgd", "stochastic gradient descent with optional momentum and Nesterov",
       {opt_float("lr", 0.01, "learning rate (the schedule's base)"),
        opt_float("momentum", 0.0, "momentum factor"), opt_float("dampening", 0.0, "dampening for momentum"),
        opt_float("weight_decay", 0.0, "L2 penalty added to the gradient"),
        opt_bool("nesterov", false, "Nesterov momentum (needs momentum > 0 and dampening = 0)")},
       [](const Options& o, std::vector<torch::Tensor> params) -> std::unique_ptr<Optimizer> {
         check_lr(o);
         if (o.get_bool("nesterov") && (o.get_float("momentum") <= 0.0 || o.get_float("dampening") != 0.0))
           o.fail("nesterov", "needs momentum > 0 and dampening = 0");
         return std::make_unique<torch::optim::SGD>(
             std::move(params), torch::optim::SGDOptions(o.get_float("lr"))
                                    .momentum(o.get_float("momentum"))
                                    .dampening(o.get_float("dampening"))
                                    .weight_decay(o.get_float("weight_decay"))
                                    .nesterov(o.get_bool("nesterov")));
       }},
      {"adam", "Adam", adam_specs(0.0),
       [](const Options& o, std::vector<torch::Tensor> params) -> std::unique_ptr<Optimizer> {
         check_lr(o);
         return std::make_unique<torch::optim::Adam>(
             std::move(params), torch::optim::AdamOptions(o.get_float("lr"))
                                    .betas(betas_of(o))
                                    .eps(o.get_float("eps"))
                                    .weight_decay(o.get_float("weight_decay"))
                                    .amsgrad(o.get_bool("amsgrad")));
       }},
      {"adamw", "Adam with decoupled weight decay", adam_specs(0.01),
       [](const Options& o, std::vector<torch::Tensor> params) -> std::unique_ptr<Optimizer> {
         check_lr(o);
         return std::make_unique<torch::optim::AdamW>(
             std::move(params), torch::optim::AdamWOptions(o.get_float("lr"))
                                    .betas(betas_of(o))
                                    .eps(o.get_float("eps"))
                                    .weight_decay(o.get_float("weight_decay"))
                                    .amsgrad(o.get_bool("amsgrad")));
       }},
  };
  return list;
}

const std::vector<Component<ScheduleMaker>>& schedules() {
  static const std::vector<Component<ScheduleMaker>> list = {
      {"constant", "the optimizer's lr throughout", {},
       [](const Options&, double base) -> std::unique_ptr<LrSchedule> { return std::make_unique<ConstantLr>(base); }},
      {"warmup_cosine", "linear warmup to the optimizer's lr, then cosine decay to min_lr; counts optimizer steps",
       {opt_int("warmup_steps", 0, "optimizer steps of linear warmup"),
        opt_float("min_lr", 0.0, "learning rate at the last step")},
       [](const Options& o, double base) -> std::unique_ptr<LrSchedule> {
         if (o.get_int("warmup_steps") < 0) o.fail("warmup_steps", "must be >= 0");
         return std::make_unique<WarmupCosine>(base, o.get_int("warmup_steps"), o.get_float("min_lr"));
       }},
  };
  return list;
}

}  // namespace tk
