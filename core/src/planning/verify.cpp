// The accumulation verifier: is k x m really the step of one batch of k*m for this model and
// data? Computed in float64 on the run's own model, so that only the model's own batch
// dependence (BatchNorm, dropout, a loss that averages unequal counts) can make a difference.
#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <tuple>

#include "assemble/assemble.h"
#include "engine/engine.h"
#include "planning/planning.h"

namespace tk::detail {
namespace {

/// Gradients of the trainable parameters after `pass` ran backward; cleared for the next pass.
std::vector<at::Tensor> gradients_of(Run& r, const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) {
    out.push_back(p.grad().defined() ? p.grad().detach().clone() : at::zeros_like(p));
    const_cast<at::Tensor&>(p).mutable_grad() = at::Tensor();
  }
  return out;
}

/// The module a parameter belongs to: its name without the last component.
std::string owner_of(const std::string& param) {
  const auto dot = param.rfind('.');
  return dot == std::string::npos ? "(the model itself)" : param.substr(0, dot);
}

/// Whether the model's forward in training mode draws random numbers (dropout written as a
/// function, not a module): two forwards of the micro-batch `idx` under other seeds differ.
bool draws_random(Run& r, const at::Tensor& idx) {
  TrialGuard guard(r);  // the generators and everything else come back
  const at::NoGradGuard no_grad;
  const Batch b = r.fetch(*r.data.train, idx);
  auto forward = [&](uint64_t seed) {
    for (auto& [key, g] : generators()) {
      const std::lock_guard<std::mutex> lock(g.mutex());
      g.set_current_seed(seed);
    }
    return r.model->forward(b.input);
  };
  // The same seed twice first: a forward that differs run to run without chance (a GPU's atomic
  // sums, a NaN) says nothing of random numbers.
  const at::Tensor once = forward(1);
  const bool differ = once.equal(forward(1)) && !once.equal(forward(2));
  guard.restore();
  return differ;
}

/// What explains a difference: the modules known to depend on the batch or on chance in
/// training mode, a forward that draws random numbers, a mean over unequal token counts, else the
/// modules whose gradients differ.
void explain(Run& r, AccumulationCheck& check, int64_t used, const at::Tensor& first, bool unequal_counts,
             const std::set<std::string>& differing) {
  bool explained = false;
  for (const auto& item : r.model->named_modules("model")) {
    const auto& mod = item.value();
    if (!mod->is_training()) continue;
    const std::string type = mod->name();
    if (type.find("BatchNorm") != std::string::npos) {
      check.findings.push_back(item.key() + " (" + type + "): BatchNorm in training mode normalizes each micro-batch of " +
                               std::to_string(check.micro_batch) + " by its own statistics, not the window's " +
                               std::to_string(used));
      explained = true;
    } else if (type.find("Dropout") != std::string::npos) {
      check.findings.push_back(item.key() + " (" + type + "): dropout may draw other masks for micro-batches than for "
                               "one batch; accumulation is then exact in expectation only");
      explained = true;
    }
  }
  if (!explained && draws_random(r, first)) {
    check.findings.push_back("the model's forward draws random numbers in training mode (two forwards of one "
                             "micro-batch under other seeds differ: dropout, say): the micro-batches draw other masks "
                             "than one batch does; accumulation is then exact in expectation only");
    explained = true;
  }
  if (r.loss->reduction() == Reduction::Mean && unequal_counts) {
    const std::string items = r.data.info.ignore_index ? "counted tokens" : "examples";
    check.findings.push_back("the loss is a mean over " + items + ", and micro-batches count different numbers of "
                             "them: a mean of their means is not the window's mean; use reduction = \"sum\" with "
                             "normalization by the window's " + items + " (by a plugin that provides grads.normalized)");
  } else if (!explained) {
    std::string list;
    for (const auto& d : differing) list += (list.empty() ? "" : ", ") + d;
    check.findings.push_back("the gradients of " + list + " differ: something in the model's forward depends on the "
                             "other examples of its batch");
  }
}

/// The trainable parameters and their names, gradients cleared.
std::pair<std::vector<at::Tensor>, std::vector<std::string>> trainable(Run& r) {
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  for (auto& [name, p] : distinct_named(r.model->named_parameters()))  // a tied parameter once
    if (p.requires_grad()) {
      names.push_back(name);
      p.mutable_grad() = at::Tensor();
      params.push_back(p);
    }
  return {params, names};
}

}  // namespace

AccumulationCheck verify_accumulation(Run& r) {
  plan_run(r);
  AccumulationCheck check;
  check.micro_batch = r.plan.micro_batch;
  check.micro_batches = r.windows->size_at(0, 0);  // the first window (smaller under a ramp)
  check.tolerance = r.dtype == at::kDouble ? 1e-9 : 1e-5;
  const int64_t m = r.plan.micro_batch, k = check.micro_batches;
  const at::Tensor order = r.shard_order(0);
  const int64_t used = std::min(order.size(0), k * m);
  if (used <= m) check.micro_batches = 1;

  TrialGuard guard(r);  // parameters, buffers, generators, the optimizer and plugin states come back afterwards
  std::vector<at::Tensor> accumulated, whole;
  std::vector<int64_t> counted;  // each micro-batch's counted targets
  std::vector<std::string> names;
  {
    const at::ScalarType dtype = r.dtype;
    r.dtype = at::kDouble;  // fetch() places floating data in float64
    r.model->to(at::kDouble);
    struct RestoreDtype {
      Run& r;
      at::ScalarType t;
      ~RestoreDtype() { r.dtype = t; }
    } restore{r, dtype};
    std::vector<at::Tensor> params;
    std::tie(params, names) = trainable(r);
    // Both sides are the run's own window through the engine: its plugins' events, the
    // normalization, unscaling and clipping of its boundary; the gradients compared are those the
    // optimizer would step with. Each side starts from the same state, random generators
    // included: dropout's difference is its mask, not its seed.
    auto side = [&](const std::vector<at::Tensor>& pieces) {
      TrialGuard each(r);
      TrialRun trial(r);
      trial.open_window(static_cast<int64_t>(pieces.size()));
      for (const auto& idx : pieces) trial.micro_batch(r.fetch(*r.data.train, idx));
      trial.boundary();
      auto grads = gradients_of(r, params);
      trial.finish();
      each.restore();
      return grads;
    };
    std::vector<at::Tensor> pieces;
    for (int64_t start = 0; start < used; start += m) pieces.push_back(order.slice(0, start, std::min(used, start + m)));
    for (const auto& idx : pieces) counted.push_back(r.data.train->get(idx).tokens);
    accumulated = side(pieces);
    whole = side({order.slice(0, 0, used)});
  }
  guard.restore();

  std::set<std::string> differing;
  for (size_t i = 0; i < whole.size(); ++i) {
    const double scale = whole[i].abs().max().item<double>();
    const double diff = (accumulated[i] - whole[i]).abs().max().item<double>();
    const double rel = scale > 0 ? diff / scale : diff;
    check.parameters.push_back({names[i], rel});
    check.max_difference = std::max(check.max_difference, rel);
    if (rel > check.tolerance) differing.insert(owner_of(names[i]));
  }
  const bool unequal = std::adjacent_find(counted.begin(), counted.end(), std::not_equal_to<>()) != counted.end();
  if (!check.exact()) explain(r, check, used, order.slice(0, 0, std::min(used, m)), unequal, differing);
  return check;
}

}  // namespace tk::detail
