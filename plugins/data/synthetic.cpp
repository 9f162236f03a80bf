// trainkit's data sets: synthetic ones generated from a seed, tensors saved from Python, and the
// file-backed ones of files.cpp, registered by name like any user's.
#include <ATen/CPUGeneratorImpl.h>
#include <tk/abi.h>
#include <tk/tensor_io.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>

#include "data_sets.h"

namespace tk::data {
namespace {

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
    if (o.get_int(k) < 1 && std::strcmp(k, "classes") != 0) o.fail(k, "must be >= 1, got " + std::to_string(o.get_int(k)));
  // One class is every example's target: a cross-entropy over it is 0 whatever the model computes.
  if (o.has("classes") && o.get_int("classes") < 2)
    o.fail("classes", "must be >= 2, got " + std::to_string(o.get_int("classes")) + ": with one class every target "
                      "is that class, and a loss over one class is 0 whatever the model predicts (nothing to learn)");
  if (o.has("noise") && !(std::isfinite(o.get_float("noise")) && o.get_float("noise") >= 0))
    o.fail("noise", "must be a finite number >= 0, got " + c10::str(o.get_float("noise")));
}

/// Refuses synthetic data whose tensors (`values` numbers per example, float32, a few temporaries
/// while generating) could not fit this machine's memory.
void require_data_fits(const Options& o, double values_per_example) {
  const int64_t train = o.get_int("samples"), val = std::max<int64_t>(0, o.get_int("validation_samples"));
  const double n = static_cast<double>(train) + static_cast<double>(val);
  // The split that asks for more is the one named.
  const char* key = val > train ? "validation_samples" : "samples";
  require_memory(o, key, 3 * 4 * n * values_per_example,
                 std::to_string(train) + " training and " + std::to_string(val) + " validation examples of " +
                     std::to_string(o.get_int("features")) + " features");
}

/// A fixed random teacher maps inputs to targets: a learnable task with a known structure.
DataSplits classification(const Options& o, uint64_t run_seed) {
  check_positive(o, {"samples", "features", "classes"});
  require_data_fits(o, static_cast<double>(o.get_int("features")) + 5.0 * static_cast<double>(o.get_int("classes")));
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
  require_data_fits(o, static_cast<double>(o.get_int("features")) + 33.0 + static_cast<double>(o.get_int("outputs")));
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
  require_data_fits(o, static_cast<double>(o.get_int("seq_len")) *
                           (static_cast<double>(o.get_int("features")) + 2.0 * static_cast<double>(o.get_int("classes")) + 2.0));
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
  const std::string& path = o.get_path("path");
  if (path.empty()) o.fail("path", "needs the file written by torch.save({\"inputs\": ..., \"targets\": ...})");
  require_file(o, "path");
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
  if (x.numel() == 0 || y.numel() == 0)
    o.fail("inputs", "the inputs " + c10::str(x.sizes()) + " and targets " + c10::str(y.sizes()) +
                         " hold no values: every example needs at least one input and one target");
  const bool tokens_in = o.get_bool("token_inputs");
  if (tokens_in && (x.dim() != 2 || at::isFloatingType(x.scalar_type()) || x.min().item<int64_t>() < 0))
    o.fail("token_inputs", "needs inputs of non-negative integer token ids [N, T], got " +
                               std::string(c10::toString(x.scalar_type())) + " " + c10::str(x.sizes()));
  // Floating data keeps its precision (the run converts each batch to its dtype); integer
  // features become floats that hold them exactly.
  if (tokens_in) x = x.to(at::kLong);
  else if (!at::isFloatingType(x.scalar_type())) x = x.to(c10::elementSize(x.scalar_type()) <= 2 ? at::kFloat : at::kDouble);
  const bool classes = !at::isFloatingType(y.scalar_type());
  if (!classes && o.get_int("classes") > 0)
    o.fail("classes", "is " + std::to_string(o.get_int("classes")) + ", but the targets are " +
                          std::string(c10::toString(y.scalar_type())) +
                          ": class targets are integer class indices (real-valued targets need no classes)");
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
  if (classes) y = y.to(at::kLong);
  else if (y.dim() == 1) y = y.unsqueeze(1);
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

struct Entry {
  std::string name, doc;
  OptionSpecs specs;
  DataMaker make;
};

void register_data(Registry& r) {
  auto cls = synthetic_common();
  cls.push_back(opt_int("classes", 10, "number of classes"));
  auto reg = synthetic_common();
  reg.push_back(opt_int("outputs", 1, "regression targets per example"));
  auto tok = synthetic_common();
  tok.push_back(opt_int("classes", 10, "number of classes per position"));
  tok.push_back(opt_int("seq_len", 16, "positions per sequence"));
  tok.push_back(opt_int("min_len", 1, "shortest sequence; lengths are uniform in [min_len, seq_len]"));
  tok.push_back(opt_int("ignore_index", -100, "target value of padded positions"));
  for (auto& e : std::vector<Entry>{
        {"synthetic-classification", "seeded Gaussian inputs labelled by a fixed random teacher network", cls,
         classification},
        {"synthetic-regression", "seeded Gaussian inputs, targets from a fixed random teacher network plus noise",
         reg, regression},
        {"synthetic-tokens", "variable-length sequences with per-position classes; padding is ignored", tok,
         tokens},
        {"tensors", "a dict of tensors saved by torch.save (inputs, targets, optional mask); the last "
                    "validation_fraction of the examples is held out",
         {opt_path("path", "", "the file"),
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
         fashion_mnist_specs(), make_fashion_mnist},
        {"text", "byte- or character-level language modelling on a text file: predict each next token",
         text_specs(), make_text},
        {"tokens", "pre-tokenized shards in llm.c's format (256 int32 of header, magic 20240520; uint16 tokens, or "
                   "uint32 with version 2), memory-mapped: predict each next token",
         tokens_specs(), make_tokens},
})
    r.add_data(std::move(e.name), std::move(e.doc), std::move(e.specs),
               [make = std::move(e.make)](const Options& o, uint64_t seed) {
                 // Without a [loss] section: trainkit's cross-entropy for labels, squared error otherwise.
                 DataSplits d = make(o, seed);
                 d.info.default_loss = d.info.classification ? "cross_entropy" : "mse";
                 return d;
               });
}

}  // namespace
}  // namespace tk::data

TK_LIBRARY("data", "0.2.0", tk::data::register_data)
