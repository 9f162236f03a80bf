// ema: an exponential moving average of the model's weights, kept beside training.
//
// After every optimizer step that was taken, from step `start_step` (0-based) on, each parameter's
// average becomes decay * average + (1 - decay) * weight. Before that step the average follows the
// weights, so that averaging starts from the weights of that moment; a vetoed step changes no
// weight and is not averaged. The average lives in the parameters' own dtype and device, is part
// of the plugin's state (it survives checkpoints and resumes), and at the end of a completed run
// goes to <output>/ema_weights.pt (option `file`; Plugin::write_files), named like the parameters: a dict that
// Python reads with torch.load. The model itself is never touched: training is bit-identical with
// or without it.
#include <tk/abi.h>

#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

/// State entries of the average are "avg.<parameter name>".
const std::string kAvgPrefix = "avg.";

class Ema final : public tk::Plugin {
 public:
  /// Options a recipe may set: decay and start_step, bound to the members that hold them.
  void bind(tk::OptionBinder& o) override {
    o.add("decay", decay_, "weight of the old average at each update, in [0, 1)");
    o.add("start_step", start_step_, "first optimizer step (0-based) whose weights enter the average");
    o.add("file", file_, "the file the average goes to, in the run's output folder");
  }

  /// Checks the options: the file's name too, so that a bad one is refused at its recipe line
  /// before training, not when the run writes it at its end.
  void init() override {
    if (!(decay_ >= 0.0 && decay_ < 1.0)) fail_option(decay_, "must be in [0, 1)");
    if (start_step_ < 0) fail_option(start_step_, "must be >= 0");
    if (const std::string why = tk::OutputFiles::name_error(file_); !why.empty()) fail_option(file_, why);
  }

  /// Starts the average at the current weights, or checks the one restored from a checkpoint
  /// against the model and moves it to the parameters' device and dtype.
  void on_fit_start(tk::FitStartContext& ctx) override {
    torch::NoGradGuard no_grad;
    std::map<std::string, torch::Tensor> avg;
    for (const auto& p : ctx.model().named_parameters()) {
      const torch::Tensor& w = p.value();
      if (!restored_) {
        avg.emplace(p.key(), w.detach().clone());
        continue;
      }
      auto it = avg_.find(p.key());
      if (it == avg_.end()) throw std::runtime_error("the restored average has no parameter '" + p.key() + "'");
      if (it->second.sizes() != w.sizes())
        throw std::runtime_error("the restored average of '" + p.key() + "' has another shape than the parameter");
      avg.emplace(p.key(), it->second.to(w.device(), w.scalar_type()));
    }
    if (restored_ && avg.size() != avg_.size())
      throw std::runtime_error("the restored average holds parameters the model does not have");
    avg_ = std::move(avg);
    restored_ = false;
  }

  /// Averages the weights of a step that was taken; records the number of updates.
  void on_step_end(tk::StepEndContext& ctx) override {
    if (!ctx.step_vetoed()) {
      torch::NoGradGuard no_grad;
      const bool averaging = ctx.counters().step - 1 >= start_step_;  // step counts this one already
      std::vector<torch::Tensor> avgs, weights;
      for (const auto& p : ctx.model().named_parameters()) {
        avgs.push_back(avg_.at(p.key()));
        weights.push_back(p.value().detach());
      }
      if (averaging) {
        // avg = decay * avg + (1 - decay) * w, as two multi-tensor operations over every parameter.
        at::_foreach_mul_(avgs, decay_);
        at::_foreach_add_(avgs, weights, 1.0 - decay_);
      } else {
        for (size_t i = 0; i < avgs.size(); ++i) avgs[i].copy_(weights[i]);
      }
      if (averaging) ++updates_;
    }
    ctx.metric("ema_updates", static_cast<double>(updates_));
  }

  /// Writes the average (ema_weights.pt unless `file` says otherwise): the core calls it on rank 0 at the end of a completed run with an
  /// output folder, and again on a resume of that run if the file went missing.
  void write_files(tk::OutputFiles& files) override {
    tk::NamedTensors weights;
    for (const auto& p : files.model().named_parameters()) {
      auto it = avg_.find(p.key());
      if (it == avg_.end()) throw std::runtime_error("the average has no parameter '" + p.key() + "'");
      weights.emplace_back(p.key(), it->second);
    }
    files.save_tensors(file_, weights);
    files.info("wrote " + (files.dir() / file_).string() + " (" + std::to_string(updates_) + " updates)");
  }

  /// The average ("avg.<parameter name>") and the number of updates ("updates").
  tk::StateDict state() const override {
    tk::StateDict s{{"updates", torch::tensor(updates_)}};
    for (const auto& [name, t] : avg_) s.emplace(kAvgPrefix + name, t.detach().clone());
    return s;
  }

  /// Restores what state() returned; on_fit_start then checks it against the model.
  void load_state(const tk::StateDict& s) override {
    auto updates = s.find("updates");
    if (updates == s.end()) throw std::runtime_error("ema: the state has no 'updates' entry");
    std::map<std::string, torch::Tensor> avg;
    for (const auto& [key, t] : s) {
      if (key == "updates") continue;
      if (key.compare(0, kAvgPrefix.size(), kAvgPrefix) != 0)
        throw std::runtime_error("ema: unknown state entry '" + key + "'");
      avg.emplace(key.substr(kAvgPrefix.size()), t.detach().clone());
    }
    updates_ = updates->second.item<int64_t>();
    avg_ = std::move(avg);
    restored_ = !avg_.empty();
  }

 private:
  double decay_ = 0.999;
  int64_t start_step_ = 0;
  std::string file_ = "ema_weights.pt";
  int64_t updates_ = 0;                        ///< steps averaged so far
  std::map<std::string, torch::Tensor> avg_;   ///< the average, by parameter name
  bool restored_ = false;                      ///< avg_ came from load_state, not yet checked
};

}  // namespace

TK_PLUGIN(Ema, "ema", "0.2.0", "an exponential moving average of the weights, written to ema_weights.pt")
