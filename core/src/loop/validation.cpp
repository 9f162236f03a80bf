// A validation pass and its record (loop.h).
#include <cmath>
#include <cstdio>

#include "loop/loop.h"

namespace tk::detail {

Validator::Validator(Run& run, LoopState& state, Events& events) : r_(run), s_(state), events_(events) {}

std::pair<double, double> Validator::validate() {
  r_.model->eval();
  double loss_sum = 0.0;
  int64_t items = 0, correct = 0;
  const bool classes = r_.data.info.classification;
  {
    torch::NoGradGuard no_grad;  // both validation hooks run in eval mode without grad
    events_.emit(Event::ValidationStart);
    const int64_t n = r_.data.validation->size(), m = r_.plan.micro_batch;
    for (int64_t start = 0; start < n; start += m) {
      Batch b = r_.fetch(*r_.data.validation, at::arange(start, std::min(n, start + m), at::kLong));
      auto out = r_.model->forward(b.input);
      const double l = (*r_.loss)(out, b).item<double>();
      loss_sum += r_.plan.reduction == Reduction::Mean ? l * static_cast<double>(b.tokens) : l;
      items += b.tokens;
      if (classes) correct += (out.argmax(-1) == b.target).sum().item<int64_t>();
    }
    s_.validation_loss = items > 0 ? loss_sum / static_cast<double>(items) : 0.0;
    events_.emit(Event::ValidationEnd);
  }
  r_.model->train();
  return {s_.validation_loss,
          items > 0 && classes ? static_cast<double>(correct) / static_cast<double>(items) : std::nan("")};
}

void Validator::record(StepRecord& line, Progress& progress, std::vector<double>& losses) {
  StepVotes in_record;  // the step's metrics, in its record already, and their plugins
  in_record.writers = s_.step.writers;
  s_.step.clear_metrics();
  auto [vloss, acc] = validate();
  losses.push_back(vloss);
  line.add(metric::kValidationLoss, vloss);
  std::string note = "validation  step " + std::to_string(s_.counters.step) + "  loss " + fmt_loss(vloss);
  if (!std::isnan(acc)) line.add(metric::kValidationAccuracy, acc);
  const DataInfo& info = r_.data.info;
  if (info.next_token) {
    const double ppl = std::exp(vloss);
    line.add(metric::kValidationPerplexity, ppl);
    note += "  perplexity " + fmt_loss(ppl);
    if (!info.baseline_name.empty())
      note += "  (" + info.baseline_name + " baseline loss " + fmt_loss(info.baseline_loss) + ")";
  } else if (!std::isnan(acc)) {
    char pct[32];
    std::snprintf(pct, sizeof pct, "%.2f%%", acc * 100.0);  // rounded as tk-report rounds it
    note += "  accuracy " + std::string(pct);
  }
  for (const auto& [k, v] : s_.step.metrics) {
    if (const std::string by = in_record.writer_of(k); !by.empty())  // a record holds one value a key
      throw Error("plugin '" + s_.step.writer_of(k) + "' reports metric '" + k + "' at validation, which the " +
                  "record of step " + std::to_string(s_.counters.step) + " holds already (plugin '" + by +
                  "' reported it in the step): a record holds one value a key; give validation's its own name");
    line.add_plugin_metric(k, v);
  }
  progress.note(note);
  last_step_ = s_.counters.step;
}

}  // namespace tk::detail
