// The baselines for trainkit's overhead: the training loops a person writes by hand in LibTorch,
// each the C++ twin of a Python loop in bench/. Gradient accumulation done the usual way, one
// optimizer step per K micro-batches, AdamW. Prints the steady-state time per optimizer step.
//
//   tk-bench-loop mlp FEATURES HIDDEN LAYERS CLASSES SAMPLES MICRO_BATCH K STEPS WARMUP THREADS
//       an MLP on seeded synthetic classification data, (loss / K).backward() (bench_loop.py)
//   tk-bench-loop cnn STEPS WARMUP THREADS [DIR]
//       recipes/fashion-mnist.toml's CNN on Fashion-MNIST, micro-batch 32 x 4 (fashion_loop.py)
//   tk-bench-loop gpt LAYERS WIDTH HEADS T B K STEPS WARMUP THREADS
//       recipes/gpt-tiny.toml's GPT on seeded random bytes, summed losses divided by the tokens
//       (gpt_loop.py)
// THREADS 0: the libraries' defaults; N > 0: N threads for LibTorch and for OpenBLAS (as run.threads).
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/modules/pooling.h>
#include <torch/optim/adamw.h>
#include <tk/compat.h>
#include <tk/kernels.h>
#include <zlib.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

int64_t arg(char** argv, int i) { return std::atoll(argv[i]); }

/// THREADS > 0: that many for LibTorch and for OpenBLAS, as tk-run's run.threads sets them.
void set_threads(int64_t n) {
  if (n > 0) tk::compat::set_cpu_threads(static_cast<int>(n));
}

/// Runs STEPS optimizer steps of `step` and prints the time per step after WARMUP.
template <class Step>
void time_steps(int64_t steps, int64_t warmup, Step step) {
  if (warmup < 0 || steps <= warmup) throw std::runtime_error("STEPS must be larger than WARMUP (>= 0)");
  auto start = Clock::now();
  double loss = 0;
  for (int64_t s = 0; s < steps; ++s) {
    if (s == warmup) start = Clock::now();
    loss = step(s);
  }
  const double secs = std::chrono::duration<double>(Clock::now() - start).count();
  std::printf("ms_per_step %.4f loss %.4f\n", 1000.0 * secs / static_cast<double>(steps - warmup), loss);
}

int mlp(char** argv) {
  const int64_t f = arg(argv, 2), h = arg(argv, 3), layers = arg(argv, 4), c = arg(argv, 5), n = arg(argv, 6);
  const int64_t m = arg(argv, 7), k = arg(argv, 8), steps = arg(argv, 9), warmup = arg(argv, 10);
  set_threads(arg(argv, 11));
  torch::manual_seed(0);
  auto x = torch::randn({n, f});
  auto y = torch::tanh(x.matmul(torch::randn({f, 4 * c}) / std::sqrt(double(f)))).matmul(torch::randn({4 * c, c})).argmax(1);
  torch::nn::Sequential model;
  int64_t width = f;
  for (int64_t i = 0; i < layers; ++i) {
    model->push_back(torch::nn::Linear(width, h));
    model->push_back(torch::nn::GELU());
    width = h;
  }
  model->push_back(torch::nn::Linear(width, c));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  const int64_t per_epoch = n / m;
  torch::Tensor order = torch::randperm(n);
  int64_t b = 0;
  time_steps(steps, warmup, [&](int64_t) {
    double window = 0;
    for (int64_t j = 0; j < k; ++j) {
      if (b == per_epoch) b = 0, order = torch::randperm(n);
      auto idx = order.slice(0, b * m, (b + 1) * m);
      ++b;
      auto loss = torch::nn::functional::cross_entropy(model->forward(x.index_select(0, idx)), y.index_select(0, idx));
      (loss / static_cast<double>(k)).backward();
      window += loss.item<double>() / static_cast<double>(k);
    }
    opt.step();
    opt.zero_grad();
    return window;
  });
  return 0;
}

/// An IDX file (gzipped or not) as a uint8 tensor of its dimensions.
torch::Tensor read_idx(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) throw std::runtime_error("cannot open " + path);
  std::vector<unsigned char> raw;
  unsigned char buf[1 << 16];
  for (int got; (got = gzread(f, buf, sizeof buf)) > 0;) raw.insert(raw.end(), buf, buf + got);
  gzclose(f);
  if (raw.size() < 4 || raw[0] != 0 || raw[1] != 0 || raw[2] != 0x08)
    throw std::runtime_error(path + " is not an IDX file of bytes");
  const int rank = raw[3];
  if (raw.size() < 4 + 4 * static_cast<size_t>(rank)) throw std::runtime_error(path + " ends inside its header");
  std::vector<int64_t> dims;
  for (int i = 0; i < rank; ++i) {
    const unsigned char* d = raw.data() + 4 + 4 * i;
    dims.push_back((int64_t(d[0]) << 24) | (int64_t(d[1]) << 16) | (int64_t(d[2]) << 8) | int64_t(d[3]));
  }
  const size_t offset = 4 + 4 * static_cast<size_t>(rank);
  int64_t count = 1;
  for (int64_t d : dims) count *= d;
  if (raw.size() != offset + static_cast<size_t>(count))
    throw std::runtime_error(path + " holds " + std::to_string(raw.size() - offset) + " bytes of data, its header " +
                             std::to_string(count));
  return torch::from_blob(raw.data() + offset, dims, torch::kUInt8).clone();
}

int cnn(int argc, char** argv) {
  const int64_t steps = arg(argv, 2), warmup = arg(argv, 3);
  set_threads(arg(argv, 4));
  const std::string dir = argc > 5 ? argv[5] : "/usr/share/datasets/fashion-mnist";
  auto images = read_idx(dir + "/train-images-idx3-ubyte.gz").unsqueeze(1);
  auto labels = read_idx(dir + "/train-labels-idx1-ubyte.gz").to(torch::kLong);
  torch::manual_seed(1);
  namespace nn = torch::nn;
  nn::Sequential model(nn::Conv2d(nn::Conv2dOptions(1, 16, 3).padding(1)), nn::ReLU(), nn::MaxPool2d(2),
                       nn::Conv2d(nn::Conv2dOptions(16, 32, 3).padding(1)), nn::ReLU(), nn::MaxPool2d(2),
                       nn::Flatten(), nn::Linear(32 * 7 * 7, 128), nn::ReLU(), nn::Linear(128, 10));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(0.002).weight_decay(0.01));
  const int64_t m = 32, k = 4, n = images.size(0);
  torch::Tensor order = torch::randperm(n);
  int64_t pos = 0;
  time_steps(steps, warmup, [&](int64_t) {
    double last = 0;
    for (int64_t j = 0; j < k; ++j) {
      if (pos + m > n) order = torch::randperm(n), pos = 0;
      auto idx = order.slice(0, pos, pos + m);
      pos += m;
      auto x = (images.index_select(0, idx).to(torch::kFloat) / 255.0 - 0.2860) / 0.3530;
      auto loss = torch::nn::functional::cross_entropy(model->forward(x), labels.index_select(0, idx));
      (loss / static_cast<double>(k)).backward();
      last = loss.item<double>();  // the loop logs its loss, as tk-run does
    }
    opt.step();
    opt.zero_grad();
    return last;
  });
  return 0;
}

/// gpt_loop.py's block: pre-LayerNorm, the causal attention of trainkit's GPT (tk/compat.h).
struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t c, int64_t heads) : heads(heads) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c})));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c})));
    qkv = register_module("qkv", torch::nn::Linear(c, 3 * c));
    proj = register_module("proj", torch::nn::Linear(c, c));
    fc = register_module("fc", torch::nn::Linear(c, 4 * c));
    out = register_module("out", torch::nn::Linear(4 * c, c));
  }
  torch::Tensor forward(torch::Tensor x) {
    const int64_t b = x.size(0), t = x.size(1), c = x.size(2);
    auto qkv_ = qkv->forward(ln1->forward(x)).view({b, t, 3, heads, c / heads}).permute({2, 0, 3, 1, 4});
    auto y = tk::kernels::causal_attention(qkv_[0], qkv_[1], qkv_[2], 0.0);  // the model's own attention
    x = x + proj->forward(y.transpose(1, 2).reshape({b, t, c}));
    return x + out->forward(torch::gelu(fc->forward(ln2->forward(x))));
  }
  int64_t heads;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc{nullptr}, out{nullptr};
};
TORCH_MODULE(Block);

struct GptImpl : torch::nn::Module {
  GptImpl(int64_t layers, int64_t c, int64_t heads, int64_t t) {
    wte = register_module("wte", torch::nn::Embedding(256, c));
    wpe = register_module("wpe", torch::nn::Embedding(t, c));
    for (int64_t i = 0; i < layers; ++i) blocks->push_back(Block(c, heads));
    register_module("blocks", blocks);
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c})));
  }
  torch::Tensor forward(const torch::Tensor& idx) {
    auto x = wte->forward(idx) + wpe->forward(torch::arange(idx.size(1), idx.options()));
    for (auto& b : *blocks) x = b->as<BlockImpl>()->forward(x);
    return torch::matmul(ln_f->forward(x), wte->weight.t());
  }
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::ModuleList blocks;
  torch::nn::LayerNorm ln_f{nullptr};
};
TORCH_MODULE(Gpt);

int gpt(char** argv) {
  const int64_t layers = arg(argv, 2), width = arg(argv, 3), heads = arg(argv, 4), t = arg(argv, 5);
  const int64_t b = arg(argv, 6), k = arg(argv, 7), steps = arg(argv, 8), warmup = arg(argv, 9);
  set_threads(arg(argv, 10));
  if (heads < 1 || width % heads != 0) throw std::runtime_error("WIDTH must be a multiple of HEADS");
  torch::manual_seed(1);
  Gpt model(layers, width, heads, t);
  torch::optim::AdamW opt(model->parameters(),
                          torch::optim::AdamWOptions(3e-3).betas({0.9, 0.95}).weight_decay(0.1));
  auto data = torch::randint(0, 256, {64, b, t + 1}, torch::kLong);
  time_steps(steps, warmup, [&](int64_t step) {
    int64_t tokens = 0;
    double sum = 0;
    for (int64_t i = 0; i < k; ++i) {
      auto batch = data[(step * k + i) % 64];
      auto logits = model->forward(batch.slice(1, 0, t));
      auto loss = torch::nn::functional::cross_entropy(
          logits.reshape({-1, 256}), batch.slice(1, 1).reshape(-1),
          torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
      loss.backward();
      tokens += b * t;
      sum += loss.item<double>();
    }
    for (auto& p : model->parameters()) p.mutable_grad().div_(static_cast<double>(tokens));
    opt.step();
    opt.zero_grad();
    return sum / static_cast<double>(tokens);
  });
  return 0;
}

int usage(const char* self) {
  std::fprintf(stderr,
               "usage: %s mlp FEATURES HIDDEN LAYERS CLASSES SAMPLES MICRO_BATCH K STEPS WARMUP THREADS\n"
               "       %s cnn STEPS WARMUP THREADS [DIR]\n"
               "       %s gpt LAYERS WIDTH HEADS T B K STEPS WARMUP THREADS\n",
               self, self, self);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string what = argc > 1 ? argv[1] : "";
  try {
    if (what == "mlp" && argc == 12) return mlp(argv);
    if (what == "cnn" && (argc == 5 || argc == 6)) return cnn(argc, argv);
    if (what == "gpt" && argc == 11) return gpt(argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tk-bench-loop: %s\n", e.what());
    return 1;
  }
  return usage(argv[0]);
}
