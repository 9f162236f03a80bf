// Gradient accumulation is exact: k micro-batches of m take the step one batch of k*m takes.
//
// Each case compares three runs: trainkit with grad_accum (k x m), trainkit without it (one batch
// of k*m), and an independent hand-written LibTorch loop over the same windows with an explicitly
// written loss. Tolerances: 1e-12 in float64, 1e-5 in float32.
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <functional>

#include "recipe.h"
#include "support.h"

using torch::Tensor;

namespace {


struct Run {
  Tensor params;
  Tensor initial;  ///< the parameters before the first step
  std::shared_ptr<tkt::Capture> capture;
  tk::FitResult result;
};

/// trainkit on kAccumRecipe + overrides, optionally with grad_accum given as TOML lines.
Run train(const std::vector<std::string>& sets, const std::string& accum = "", const char* base = kAccumRecipe) {
  const std::string text = accum.empty() ? std::string(base) : with_grad_accum(accum, base);
  auto r = tkt::recipe(sets, text.c_str());
  tk::Trainer t(r, tkt::quiet());
  auto cap = std::make_shared<tkt::Capture>();
  t.add_plugin(cap, "capture");
  Run run;
  run.initial = tkt::flat_params(t.model());
  run.result = t.fit();
  run.params = tkt::flat_params(t.model());
  run.capture = cap;
  return run;
}

/// The index sets of every window, built directly from the data order: micro-batches of m per
/// epoch, grouped k at a time, with the given last-window policy.
std::vector<Tensor> windows_for(int64_t n, int64_t m, int64_t k, tk::LastWindow policy, int64_t epochs,
                                uint64_t seed) {
  std::vector<Tensor> out;
  std::vector<Tensor> pending;
  for (int64_t e = 0; e < epochs; ++e) {
    Tensor order = tk::epoch_order(n, seed, e, true);
    std::vector<Tensor> micro;
    for (int64_t s = 0; s < n; s += m) micro.push_back(order.slice(0, s, std::min(n, s + m)));
    if (policy != tk::LastWindow::Carry) pending.clear();
    for (auto& mb : micro) {
      pending.push_back(mb);
      if (static_cast<int64_t>(pending.size()) == k) {
        out.push_back(torch::cat(pending));
        pending.clear();
      }
    }
    if (policy == tk::LastWindow::Step && !pending.empty()) out.push_back(torch::cat(pending));
  }
  if (policy == tk::LastWindow::Carry && !pending.empty()) out.push_back(torch::cat(pending));
  return out;
}

/// Mean cross-entropy over the items whose target is not -100, written out by hand.
Tensor reference_ce(const Tensor& out, const Tensor& y) {
  const int64_t c = out.size(-1);
  Tensor logp = torch::log_softmax(out.reshape({-1, c}), 1);
  Tensor t = y.reshape({-1});
  Tensor keep = (t != -100).to(logp.scalar_type());
  Tensor nll = -logp.gather(1, t.clamp_min(0).unsqueeze(1)).squeeze(1);
  return (nll * keep).sum() / keep.sum();
}

using OptMaker = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<Tensor>)>;

/// The independent loop: one big-batch step per window on a fresh copy of the initial model.
Run reference(const std::vector<std::string>& sets, std::vector<Tensor> windows, const OptMaker& make_opt,
              size_t steps = 5, const char* base = kAccumRecipe) {
  if (windows.size() > steps) windows.resize(steps);
  auto r = tkt::recipe(sets, base);
  tk::Trainer fresh(r, tkt::quiet());  // only for the initial model and the data
  auto& model = fresh.model();
  auto& ds = dynamic_cast<const tk::TensorDataset&>(*fresh.data().train);
  auto dtype = model.parameters()[0].scalar_type();
  auto opt = make_opt(model.parameters());
  Run run;
  run.capture = std::make_shared<tkt::Capture>();
  for (const auto& idx : windows) {
    Tensor x = ds.inputs().index_select(0, idx).to(dtype);
    Tensor y = ds.targets().index_select(0, idx);
    Tensor loss = reference_ce(model.forward(x), y);
    loss.backward();
    run.capture->grads.push_back(tkt::flat_grads(model));
    run.capture->window_losses.push_back(loss.item<double>());
    opt->step();
    opt->zero_grad();
  }
  run.params = tkt::flat_params(model);
  return run;
}

/// The tolerance of runs in float64 (kAccumRecipe's dtype).
const tkt::Tol kF64 = tkt::tol_for(torch::kDouble);

void check_same_steps(const Run& a, const Run& b, tkt::Tol tol) {
  REQUIRE(a.capture->grads.size() == b.capture->grads.size());
  for (size_t i = 0; i < a.capture->grads.size(); ++i) {
    CAPTURE(i);
    CHECK(tkt::excess(a.capture->grads[i], b.capture->grads[i], tol) <= 1.0);
  }
  CHECK(tkt::excess(a.params, b.params, tol) <= 1.0);
}

struct OptCase {
  const char* name;
  std::vector<std::string> sets;
  OptMaker make;
};

std::vector<OptCase> optimizer_cases() {
  using namespace torch::optim;
  return {
      {"sgd+nesterov+wd",
       {"optimizer.name=sgd", "optimizer.lr=0.1", "optimizer.momentum=0.9", "optimizer.nesterov=true",
        "optimizer.weight_decay=0.001"},
       [](std::vector<Tensor> p) {
         return std::make_unique<SGD>(p, SGDOptions(0.1).momentum(0.9).nesterov(true).weight_decay(0.001));
       }},
      {"adam", {"optimizer.name=adam", "optimizer.lr=0.01"},
       [](std::vector<Tensor> p) { return std::make_unique<Adam>(p, AdamOptions(0.01)); }},
      {"adamw", {"optimizer.name=adamw", "optimizer.lr=0.01", "optimizer.weight_decay=0.05"},
       [](std::vector<Tensor> p) { return std::make_unique<AdamW>(p, AdamWOptions(0.01).weight_decay(0.05)); }},
  };
}



}  // namespace

TEST_SUITE("accumulation") {
  TEST_CASE("k micro-batches of m == one batch of k*m, for every optimizer, in float64 and float32") {
    for (const char* dtype : {"float64", "float32"}) {
      const tkt::Tol tol = tkt::tol_for(std::string(dtype) == "float64" ? torch::kDouble : torch::kFloat);
      for (const auto& oc : optimizer_cases()) {
        CAPTURE(oc.name);
        CAPTURE(dtype);
        auto sets = oc.sets + std::vector<std::string>{std::string("run.dtype=") + dtype};
        Run accum = train(sets + std::vector<std::string>{"batch.micro_batch=8"}, "steps = 4");
        Run big = train(sets + std::vector<std::string>{"batch.micro_batch=32"});
        Run ref = reference(sets, windows_for(256, 8, 4, tk::LastWindow::Step, 1, 11), oc.make);
        check_same_steps(accum, big, tol);
        check_same_steps(accum, ref, tol);
        CHECK(accum.result.micro_steps == 20);
        CHECK(big.result.micro_steps == 5);
        // The parameters really moved from where they started: equality is not that of a no-op.
        CHECK(tkt::distance(accum.params, accum.initial) > 1e-3);
        CHECK(tkt::distance(big.params, big.initial) > 1e-3);
      }
    }
  }

  TEST_CASE("normalize = samples: sum losses divided by the window's examples, uneven micro-batches included") {
    // 250 examples, micro-batches of 8: the last one has 2, so the last window has 26 examples.
    std::vector<std::string> sets = {"data.samples=250", "run.steps=0", "run.epochs=1"};
    Run accum = train(sets + std::vector<std::string>{"loss.reduction=sum"}, "steps = 4\nnormalize = \"samples\"");
    Run big = train(sets + std::vector<std::string>{"batch.micro_batch=32"});
    REQUIRE(accum.capture->window_sizes.back() == 4);
    check_same_steps(accum, big, kF64);
    auto ref = reference(sets, windows_for(250, 8, 4, tk::LastWindow::Step, 1, 11), [](std::vector<Tensor> p) {
      return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1));
    }, 8);
    check_same_steps(accum, ref, kF64);
  }

  TEST_CASE("normalize = tokens is exact for variable-length sequences; the mean of means is not") {
    const std::vector<std::string> tok = {"data.name=synthetic-tokens", "data.seq_len=12", "data.min_len=1",
                                          "data.samples=128", "batch.micro_batch=4"};
    Run accum = train(tok + std::vector<std::string>{"loss.reduction=sum"}, "steps = 4\nnormalize = \"tokens\"");
    Run big = train(tok + std::vector<std::string>{"batch.micro_batch=16"});
    check_same_steps(accum, big, kF64);
    auto ref = reference(tok, windows_for(128, 4, 4, tk::LastWindow::Step, 1, 11), [](std::vector<Tensor> p) {
      return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1));
    });
    check_same_steps(accum, ref, kF64);
    // The logged loss is the token mean over the whole window, as the big batch computes it.
    for (size_t i = 0; i < big.result.window_losses.size(); ++i)
      CHECK(std::abs(accum.result.window_losses[i] - big.result.window_losses[i]) < 1e-12);

    // Averaging per-micro-batch means weighs short sequences too much: a different step.
    Run naive = train(tok, "steps = 4\nnormalize = \"mean\"");
    CHECK(tkt::distance(naive.capture->grads[0], big.capture->grads[0]) > 1e-3);
  }

  TEST_CASE("regression with a summed MSE, normalized by samples, equals the mean-MSE big batch") {
    std::string base = kAccumRecipe;
    base.replace(base.find("classes = 5"), 11, "outputs = 1");
    const std::vector<std::string> reg = {"data.name=synthetic-regression", "data.samples=200", "loss.name=mse"};
    Run accum = train(reg + std::vector<std::string>{"loss.reduction=sum"}, "steps = 4\nnormalize = \"samples\"",
                      base.c_str());
    Run big = train(reg + std::vector<std::string>{"batch.micro_batch=32"}, "", base.c_str());
    check_same_steps(accum, big, kF64);
    for (size_t i = 0; i < big.result.window_losses.size(); ++i)
      CHECK(std::abs(accum.result.window_losses[i] - big.result.window_losses[i]) < 1e-12);
  }

  TEST_CASE("the short last window is normalized by its actual size (last_window = step)") {
    // 80 examples in micro-batches of 4: 20 per epoch, windows of 6 -> 6, 6, 6, 2.
    std::vector<std::string> sets = {"data.samples=80", "run.steps=0", "run.epochs=2"};
    Run accum = train(sets + std::vector<std::string>{"batch.micro_batch=4"}, "steps = 6");
    Run big = train(sets + std::vector<std::string>{"batch.micro_batch=24"});
    CHECK(accum.capture->window_sizes == std::vector<int64_t>{6, 6, 6, 2, 6, 6, 6, 2});
    check_same_steps(accum, big, kF64);
    // The window is known before each forward pass: the short one says so from its first micro-batch.
    const auto& w = accum.capture->windows;
    REQUIRE(w.size() == 40);
    CHECK(w[18].index == 0);
    CHECK(w[18].size == 2);
    CHECK(w[18].is_short());
    CHECK(w[19].is_last());
  }

  TEST_CASE("last_window = drop skips the tail; carry continues the window into the next epoch") {
    std::vector<std::string> sets = {"data.samples=80", "run.steps=0", "run.epochs=2", "batch.micro_batch=4"};
    Run drop = train(sets, "steps = 6\nlast_window = \"drop\"");
    Run big = train({"data.samples=80", "run.steps=0", "run.epochs=2", "batch.micro_batch=24", "data.drop_last=true"});
    CHECK(drop.capture->window_sizes == std::vector<int64_t>{6, 6, 6, 6, 6, 6});
    check_same_steps(drop, big, kF64);

    Run carry = train(sets, "steps = 6\nlast_window = \"carry\"");
    CHECK(carry.capture->window_sizes == std::vector<int64_t>{6, 6, 6, 6, 6, 6, 4});
    auto sgd = [](std::vector<Tensor> p) {
      return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1));
    };
    Run ref = reference(sets, windows_for(80, 4, 6, tk::LastWindow::Carry, 2, 11), sgd, 7);
    check_same_steps(carry, ref, kF64);
  }

  TEST_CASE("the LR schedule advances once per optimizer step, never per micro-batch") {
    Run accum = train({"schedule.name=warmup_cosine", "schedule.warmup_steps=3", "schedule.min_lr=0.01",
                       "run.steps=8"},
                      "steps = 4");
    const auto& lrs = accum.capture->lrs;
    REQUIRE(lrs.size() == 8);
    CHECK(accum.result.micro_steps == 32);
    // Written from the schedule's definition: step s < 3 warms up linearly to 0.1 (lr (s+1)/3),
    // then cosine over the remaining 5 steps toward 0.01, reached after the last step.
    const double expect[8] = {0.1 / 3,
                              0.2 / 3,
                              0.1,
                              0.1,
                              0.01 + 0.045 * (1 + std::cos(M_PI * 0.2)),
                              0.01 + 0.045 * (1 + std::cos(M_PI * 0.4)),
                              0.01 + 0.045 * (1 + std::cos(M_PI * 0.6)),
                              0.01 + 0.045 * (1 + std::cos(M_PI * 0.8))};
    for (int i = 0; i < 8; ++i) CHECK(lrs[i] == doctest::Approx(expect[i]).epsilon(1e-12));
  }

  TEST_CASE("the logged loss is the true window loss, not a 1/k piece") {
    Run accum = train({}, "steps = 4");
    Run big = train({"batch.micro_batch=32"});
    REQUIRE(accum.result.window_losses.size() == 5);
    for (size_t i = 0; i < 5; ++i) {
      CAPTURE(i);
      CHECK(std::abs(accum.result.window_losses[i] - big.result.window_losses[i]) < 1e-12);
    }
    CHECK(accum.result.window_losses[0] > 1.0);  // ~log(5) at the start: not divided by k
  }

  TEST_CASE("steps = 1 leaves a run bit-identical to a run without the plugin") {
    Run plain = train({});
    Run one = train({}, "steps = 1");
    CHECK(torch::equal(plain.params, one.params));
  }
}
