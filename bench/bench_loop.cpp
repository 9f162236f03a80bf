// The baseline for trainkit's overhead: the training loop a person writes by hand in LibTorch.
// An MLP on seeded synthetic classification data, AdamW, gradient accumulation done the usual way
// ((loss / k).backward()), one optimizer step per k micro-batches. Prints the steady-state time.
//
//   tk-bench-loop FEATURES HIDDEN LAYERS CLASSES SAMPLES MICRO_BATCH K STEPS WARMUP THREADS
#include <ATen/Parallel.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
  if (argc != 11) {
    std::fprintf(stderr, "usage: %s FEATURES HIDDEN LAYERS CLASSES SAMPLES MICRO_BATCH K STEPS WARMUP THREADS\n", argv[0]);
    return 2;
  }
  auto arg = [&](int i) { return std::atoll(argv[i]); };
  const int64_t f = arg(1), h = arg(2), layers = arg(3), c = arg(4), n = arg(5), m = arg(6), k = arg(7);
  const int64_t steps = arg(8), warmup = arg(9);
  if (arg(10) > 0) at::set_num_threads(static_cast<int>(arg(10)));  // 0: LibTorch's default
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
  int64_t b = 0, epoch = 0;
  double last_loss = 0;
  auto t_start = std::chrono::steady_clock::now();
  for (int64_t step = 0; step < steps; ++step) {
    if (step == warmup) t_start = std::chrono::steady_clock::now();
    double window = 0;
    for (int64_t j = 0; j < k; ++j) {
      if (b == per_epoch) {
        b = 0;
        order = torch::randperm(n);
        ++epoch;
      }
      auto idx = order.slice(0, b * m, (b + 1) * m);
      ++b;
      auto out = model->forward(x.index_select(0, idx));
      auto loss = torch::nn::functional::cross_entropy(out, y.index_select(0, idx));
      (loss / static_cast<double>(k)).backward();
      window += loss.item<double>() / static_cast<double>(k);
    }
    opt.step();
    opt.zero_grad();
    last_loss = window;
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  std::printf("ms_per_step %.4f loss %.4f\n", 1000.0 * s / static_cast<double>(steps - warmup), last_loss);
  return 0;
}
