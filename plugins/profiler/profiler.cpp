// profiler: a trace of chosen optimizer steps in the Trace Event Format, which Perfetto
// (ui.perfetto.dev) and chrome://tracing open.
//
// Each traced step is a range, and under it the ranges of its phases as the plugin's hooks see
// them: the data of each micro-batch (from the end of the one before to this one's first hook),
// each micro-batch with its forward (with the loss) and its backward, and the boundary's work
// with the optimizer step; validations are ranges of their own. With `operators`, LibTorch's
// profiler (its legacy CPU profiler, which every build has) records the operators run during
// the traced steps, and they appear under those ranges on the thread that ran them.
//
// The plugin measures from its own hooks: other plugins' work in an event falls inside the phase
// when they are nested inside it (list the profiler first: it then opens each phase first and, as
// the events that close a region go in reverse order, closes it last). The trace goes to <output>/trace.json at the
// end of a completed run with an output folder (Plugin::write_files), on rank 0. Training is not
// changed: the plugin reads clocks and nothing else of the run.
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/profiler_legacy.h>
#include <tk/abi.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace {

namespace legacy = torch::autograd::profiler;

/// Microseconds of the realtime clock: the clock LibTorch's legacy profiler stamps events with.
double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::system_clock::now().time_since_epoch()).count();
}

class Profiler final : public tk::Plugin {
 public:
  void bind(tk::OptionBinder& o) override {
    o.add("steps", steps_, "the optimizer steps (1-based) to trace");
    o.add("operators", operators_, "also record LibTorch's operators during the traced steps");
  }
  void init() override {
    if (steps_.empty()) fail_option(steps_, "needs at least one step to trace");
    for (int64_t s : steps_)
      if (s < 1) fail_option(steps_, "steps count from 1, got " + std::to_string(s));
  }

  void on_fit_start(tk::FitStartContext& ctx) override {
    trial_ = ctx.trial();  // trial steps are not the run's: nothing of them is traced
    if (trial_) return;
    t0_ = now_us();
    last_ = t0_;
    say_untraced(ctx);
    maybe_begin(ctx.counters().step + 1);
  }
  void on_micro_batch(tk::MicroBatchContext&) override {
    if (!on_) return;
    const double t = now_us();
    range("data", "phase", last_, t);
    micro_ = t;
  }
  void on_loss(tk::LossContext&) override {
    if (!on_) return;
    loss_ = now_us();
    range("forward", "phase", micro_, loss_);
  }
  void on_backward(tk::BackwardContext& ctx) override {
    if (!on_) return;
    last_ = now_us();
    range("backward", "phase", loss_, last_);
    range("micro-batch " + std::to_string(ctx.window().index), "micro-batch", micro_, last_);
  }
  void on_boundary(tk::BoundaryContext&) override { boundary_ = now_us(); }
  void on_step_end(tk::StepEndContext& ctx) override {
    if (trial_) return;
    const double t = now_us();
    const int64_t step = ctx.counters().step;  // the step just taken
    if (on_) {
      range("boundary and optimizer step", "phase", boundary_, t);
      range("step " + std::to_string(step), "step", begin_, t);
      end_operators();
      on_ = false;
    }
    last_ = t;
    maybe_begin(step + 1);
  }
  void on_validation_start(tk::ValidationStartContext&) override { validation_ = now_us(); }
  void on_validation_end(tk::ValidationEndContext&) override {
    last_ = now_us();
    range("validation", "validation", validation_, last_);
  }
  void on_fit_end(tk::FitEndContext&) override {
    if (trial_) {
      trial_ = false;
      return;
    }
    if (on_) end_operators();  // a run that ended inside a traced step
    on_ = false;
  }

  void write_files(tk::OutputFiles& files) override {
    nlohmann::json trace = {{"traceEvents", events_}, {"displayTimeUnit", "ms"}};
    trace["traceEvents"].push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", 1},
                                    {"args", {{"name", "training"}}}});
    files.write_text("trace.json", trace.dump());
    files.info("wrote " + (files.dir() / "trace.json").string() + " (" + std::to_string(events_.size()) +
               " ranges; open it in ui.perfetto.dev or chrome://tracing)");
  }

 private:
  /// Warns of chosen steps this run never takes: beyond its last, or before the step it resumes at.
  void say_untraced(tk::FitStartContext& ctx) const {
    const tk::Counters& c = ctx.counters();
    std::vector<int64_t> beyond, before;
    for (int64_t s : std::set<int64_t>(steps_.begin(), steps_.end())) {
      if (s > c.total_steps) beyond.push_back(s);
      else if (s <= c.step) before.push_back(s);
    }
    auto said = [](const std::vector<int64_t>& v) {
      std::string l = v.size() == 1 ? "step " : "steps ";
      for (size_t i = 0; i < v.size(); ++i) l += (i ? ", " : "") + std::to_string(v[i]);
      return l + (v.size() == 1 ? " is" : " are");
    };
    if (!beyond.empty())
      ctx.warn(said(beyond) + " beyond the run's " + std::to_string(c.total_steps) + " steps: not traced (" +
               options().where("steps").str() + ")");
    if (!before.empty())
      ctx.warn(said(before) + " of the run before it resumed (after step " + std::to_string(c.step) + "): not traced");
  }

  /// Starts tracing when `step` is one of the chosen ones.
  void maybe_begin(int64_t step) {
    if (std::find(steps_.begin(), steps_.end(), step) == steps_.end()) return;
    on_ = true;
    begin_ = last_;
    if (operators_ && !legacy::profilerEnabled()) {
      legacy::enableProfilerLegacy(torch::profiler::impl::ProfilerConfig(torch::profiler::impl::ProfilerState::CPU));
      profiling_ = true;
    }
  }

  /// Stops LibTorch's profiler and adds its operators as ranges, each on its thread.
  void end_operators() {
    if (!profiling_) return;
    profiling_ = false;
    const legacy::thread_event_lists lists = legacy::disableProfilerLegacy();
    std::map<uint64_t, int> tids;  // LibTorch's thread ids -> the trace's (1: training's thread)
    for (const auto& list : lists) {
      std::vector<const legacy::LegacyEvent*> open;
      for (const auto& e : list) {
        if (e.kindStr() == "push") {
          open.push_back(&e);
        } else if (e.kindStr() == "pop" && !open.empty()) {
          const legacy::LegacyEvent* start = open.back();
          open.pop_back();
          if (std::string(start->name()) == "__start_profile") continue;
          auto [it, added] = tids.emplace(start->threadId(), tids.empty() ? 1 : static_cast<int>(tids.size()) + 1);
          (void)added;
          range(start->name(), "operator", start->cpuUs(), e.cpuUs(), it->second);
        }
      }
    }
  }

  void range(const std::string& name, const char* cat, double from_us, double to_us, int tid = 1) {
    events_.push_back({{"name", name}, {"cat", cat}, {"ph", "X"}, {"pid", 0}, {"tid", tid},
                       {"ts", from_us - t0_}, {"dur", std::max(0.0, to_us - from_us)}});
  }

  std::vector<int64_t> steps_ = {2, 3};
  bool operators_ = true;
  bool on_ = false, profiling_ = false, trial_ = false;
  double t0_ = 0, last_ = 0, begin_ = 0, micro_ = 0, loss_ = 0, boundary_ = 0, validation_ = 0;
  nlohmann::json events_ = nlohmann::json::array();
};

}  // namespace

TK_PLUGIN(Profiler, "profiler", "0.1.0",
          "a Trace Event Format trace (Perfetto, chrome://tracing) of chosen steps: phases and LibTorch's operators")
