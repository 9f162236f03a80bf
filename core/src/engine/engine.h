#pragma once
// The engine layer: a step as the plugins see it. The plugins' hooks by event, called in dispatch
// order with each failure named (plugin, event, step); a window's micro-batches through forward,
// loss and backward, and its optimizer step, with the events around each phase. Training runs
// every micro-batch and step through it. Not installed.
#include <array>
#include <chrono>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "api/api.h"
#include "run/run.h"
#include "support/support.h"
#include "tk/output.h"
#include "tk/trainer.h"

namespace tk::detail {

// ---- events.cpp: the plugins' hooks by event ------------------------------------------------------

/// Who handles each event, in dispatch order, and the calls of their hooks. A plugin that
/// declines an event is dropped from its list.
class Events {
 public:
  /// Over `run`'s planned plugins and the state their Context shows; each dispatch is appended to
  /// `trace` when the run traces.
  Events(Run& run, LoopState& state, std::vector<TraceEntry>& trace);
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;

  /// Calls the hook of `e` of every plugin that handles it. A hook's exception is rethrown as a
  /// PluginRuntimeError naming the plugin, the event, the step and the micro-batch.
  void emit(Event e);
  /// on_fit_end of every plugin, each called even when one before it failed; the first failure is
  /// then rethrown.
  void fit_end();
  /// After a failure: on_fit_end (status failed) once for every plugin whose on_fit_start ran (or
  /// that has none); their errors are dropped.
  void fit_end_after_failure();

 private:
  Run& r_;
  LoopState& s_;
  std::vector<TraceEntry>& trace_;
  std::array<std::vector<const Slot*>, kEventCount> handlers_;
  std::set<const Slot*> not_started_;  // plugins whose on_fit_start has not run (yet)
};

// ---- step.cpp: a window's micro-batches and its step ------------------------------------------

/// With run.phase_times: where each window's time went, in ms, for its record. Off, every call is
/// a no-op.
struct PhaseTimes {
  enum Phase { kData, kForward, kBackward, kBoundary, kOptimizer, kValidation, kPhases };
  bool on = false, cuda = false;  // on CUDA each mark waits for the device: the phases' own time
  std::array<double, kPhases> ms{};
  std::chrono::steady_clock::time_point t;

  /// Starts a stretch.
  void mark();
  /// Ends the stretch since the last mark as phase `p` (and starts the next).
  void add(Phase p);
  /// The window's phases into its record (validation_ms only on a step that validated).
  void record(StepRecord& line) const;
};

/// A model's name for messages: "model 'gpt'", with the file it was read from when it has one.
std::string model_label(const Run& run);
/// The files the model was read from (its Path options that the recipe set: a published
/// checkpoint, a TorchScript module), ", "-joined; "" when none.
std::string model_files(const Run& run);

/// The state the plugins' Context shows, for a planned run before its first event.
LoopState loop_state(Run& run);

/// Runs micro-batches and optimizer steps of a planned run, dispatching their events: the one
/// path a window takes in training, in the memory planner's trials and in the verifier.
class StepEngine {
 public:
  StepEngine(Run& run, LoopState& state, Events& events, PhaseTimes& phases);

  /// One micro-batch of the current window (state.window): MicroBatch, forward, the loss, Loss,
  /// backward, Backward. Adds it to the window's totals and the counters.
  void micro_batch(const Batch& batch);
  /// The window's boundary: the learning rate set, Boundary, the step's one read from the device.
  /// The gradients are then those the optimizer steps with.
  void boundary();
  /// The window's optimizer step: boundary(), then the step (or its veto), zero_grad, the
  /// counters, StepEnd. Returns whether a plugin vetoed it. With `diagnose`, a non-finite window
  /// loss stops the run before the step with its account of it. With `step_vetoed`, the optimizer
  /// steps even when vetoed (a trial measures the step's memory: the optimizer's state included).
  bool step(const std::function<std::string()>& diagnose, bool step_vetoed = false);

 private:
  Run& r_;
  LoopState& s_;
  Events& events_;
  PhaseTimes& phases_;
};

// ---- trial.cpp: steps that leave nothing behind ---------------------------------------------------

/// Steps of a planned run for the memory planner's trials and the accumulation verifier: the
/// plugins' whole cycle (on_fit_start, each window's events, on_fit_end with status Trial) through
/// the run's own engine, with ctx.trial() true and the plugins' info lines left out of the log.
/// What the steps change (parameters, buffers, generators, the optimizer, the plugins' states)
/// the caller puts back (TrialGuard).
class TrialRun {
 public:
  /// Dispatches on_fit_start.
  explicit TrialRun(Run& run);
  /// on_fit_end, when finish() did not run (after a failure: its errors dropped).
  ~TrialRun();
  TrialRun(const TrialRun&) = delete;
  TrialRun& operator=(const TrialRun&) = delete;

  /// Opens a window of `size` micro-batches.
  void open_window(int64_t size);
  /// The window's next micro-batch.
  void micro_batch(const Batch& batch);
  /// The window's boundary, without the optimizer step.
  void boundary() { engine_.boundary(); }
  /// The window's whole step: the optimizer steps even when a plugin vetoes (an overflow of the
  /// loss scaler's first scale, say), and a non-finite loss is no error: the trial measures memory.
  void step() { engine_.step({}, /*step_vetoed=*/true); }
  /// on_fit_end (status Trial); its errors propagate.
  void finish();
  const LoopState& state() const noexcept { return s_; }

 private:
  Run& r_;
  LoopState s_;
  std::vector<TraceEntry> trace_;  // not kept
  Events events_;
  PhaseTimes phases_;  // off
  StepEngine engine_;
  int64_t next_ = 0;  // the window's next micro-batch
  bool finished_ = false;
};

}  // namespace tk::detail
