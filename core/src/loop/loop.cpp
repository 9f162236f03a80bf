// The training loop: epochs of windows of micro-batches, one optimizer step per window, and what
// each step's end decides (its record, validation, a stop, a checkpoint). The step itself is the
// engine's; everything else about a run is assembled and planned before it starts.
#include <c10/util/Exception.h>
#include <spdlog/spdlog.h>

#include "loop/loop.h"

namespace fs = std::filesystem;

namespace tk::detail {
namespace {

/// Where the loop starts: the first epoch and its first micro-batch.
struct Start {
  int64_t epoch = 0, batch = 0;
};

class Loop {
 public:
  Loop(Run& run, const TrainerOptions& opts, std::vector<TraceEntry>& trace);
  FitResult fit(const Recipe& recipe);

 private:
  // A run from start to end.
  std::optional<Checkpoint> resume(RunOutputs& outputs);
  FitResult already_complete(RunOutputs& outputs, const Checkpoint& resumed);
  Start start_from(const std::optional<Checkpoint>& resumed);
  void train_epochs(Start start);
  void train_epoch(int64_t epoch, int64_t first);
  void finish_training();
  FitResult summary();

  // A window and its step.
  void open_window(int64_t epoch, int64_t b);
  /// Trains micro-batch `b`; false when it ran out of memory and the window starts again at `b`.
  bool train_micro_batch(int64_t epoch, int64_t& b, const at::Tensor& order);
  /// After the window's last micro-batch: the step, its record, validation, a stop, a checkpoint.
  void end_window(int64_t epoch, int64_t b);
  void validate(StepRecord& line);
  /// The order of `epoch`'s examples on this rank, kept for the one asked for last (the epoch in
  /// training, or the next one when its first micro-batch is made ahead).
  const at::Tensor& order_of(int64_t epoch);

  Run& r_;
  const TrainerOptions& opts_;
  std::vector<TraceEntry>& trace_;
  LoopState s_;
  // The engine and the loop's parts, built once.
  Events events_;
  PhaseTimes phases_;
  StepEngine engine_;
  StepRecorder recorder_;
  Validator validator_;
  StopRule stop_;
  BackOff backoff_;
  const int64_t n_;  // examples this rank reads per epoch

  // State of the fit in progress.
  FitResult result_;
  RunOutputs* outputs_ = nullptr;
  std::optional<CheckpointPolicy> checkpoints_;
  std::optional<Progress> progress_;
  std::optional<Prefetcher> prefetch_;
  int64_t validate_every_ = 0;
  WorldSeen seen_;  // what the world trained on so far
  int64_t seen_at_start_ = 0;  // its examples when this part of the run started (a resume's)
  int64_t order_epoch_ = -1;
  at::Tensor order_;
  bool done_ = false, in_window_ = false;  // checkpoints and resumes are at boundaries
  std::vector<at::Tensor> window_indices_;  // the examples of the window's micro-batches, for a diagnosis
};

Loop::Loop(Run& run, const TrainerOptions& opts, std::vector<TraceEntry>& trace)
    : r_(run),
      opts_(opts),
      trace_(trace),
      s_(loop_state(run)),
      events_(run, s_, trace),
      engine_(run, s_, events_, phases_),
      recorder_(run),
      validator_(run, s_, events_),
      stop_(run, opts),
      backoff_(run),
      n_(run.shard_size()) {
  phases_.on = run.run.get_bool("phase_times");
  phases_.cuda = run.device.is_cuda();
}

void Loop::validate(StepRecord& line) {
  phases_.mark();
  validator_.record(line, *progress_, result_.validation_losses);
  phases_.add(PhaseTimes::kValidation);
  recorder_.restart_peak();  // validation's memory is not the next step's
}

void Loop::end_window(int64_t epoch, int64_t b) {
  const bool skipped = engine_.step([&] { return non_finite_loss(r_, s_, window_indices_); });
  seen_.samples += s_.totals.samples;  // the world's, once a sync plugin summed the totals
  seen_.tokens += s_.totals.tokens;
  result_.window_losses.push_back(s_.window_loss);
  result_.step_metrics.emplace_back(s_.step.metrics.begin(), s_.step.metrics.end());
  const double t = stop_.elapsed();
  StepRecord line = recorder_.make(s_, seen_, epoch, skipped, t);
  const Counters& c = s_.counters;
  done_ = c.step >= r_.total_steps;
  if (r_.data.validation && ((validate_every_ > 0 && c.step % validate_every_ == 0) || done_)) validate(line);
  // Stop early at this boundary when asked to (a signal) or out of time, with a checkpoint. A run
  // out of time ends as a finished one does, with a validation of its last step (a signal asks
  // for a prompt stop: none then).
  if (!done_) result_.status = stop_.decide();
  if (result_.status == FitStatus::StoppedByTime) {
    stop_.note_unfinished_schedule(r_, s_);  // the pace of training, before the last validation
    if (r_.data.validation && validator_.last_step() != c.step) validate(line);
  }
  if (result_.status != FitStatus::Running) done_ = true;
  if (done_) CpuBlockCache::trim();  // training's blocks are not the last checkpoint's and weights'
  phases_.record(line);
  // The step's record first: a checkpoint never holds a step whose record could be lost.
  outputs_->record(line.line());
  if (auto dir = checkpoints_->after_step(c, seen_, epoch, b, done_)) result_.checkpoint = *dir;
  // The world's examples since this part of the run started, over its time.
  progress_->update(c.step, epoch, s_.window_loss, s_.lr, static_cast<double>(seen_.samples - seen_at_start_) / std::max(t, 1e-9),
                    t, recorder_.last_mfu());
}

void Loop::open_window(int64_t epoch, int64_t b) {
  s_.totals = WindowTotals{};
  phases_.ms.fill(0.0);
  recorder_.open_window();
  window_indices_.clear();
  s_.host_reads = 0;
  in_window_ = true;
  backoff_.window_opened(b, s_.counters);
}

bool Loop::train_micro_batch(int64_t epoch, int64_t& b, const at::Tensor& order) {
  const int64_t m = r_.plan.micro_batch;
  auto indices = [&](int64_t i) { return order.slice(0, i * m, std::min(n_, (i + 1) * m)); };
  Batch batch;
  try {
    // A batch made ahead may be the one that ran out of memory: it backs off like the step.
    phases_.mark();
    batch = prefetch_->take({epoch, b, m}, indices(b));
    phases_.add(PhaseTimes::kData);
    // The next micro-batch is made while this one trains: of this epoch, or the next one's first;
    // none after the run's last step.
    const bool last_step = s_.window.is_last() && s_.counters.step + 1 >= r_.total_steps;
    if (prefetch_->active() && !last_step) {
      if (b + 1 < r_.batches_per_epoch)
        prefetch_->ahead({epoch, b + 1, m}, indices(b + 1));
      else if (r_.bound.by_steps() || epoch + 1 < r_.bound.count)
        prefetch_->ahead({epoch + 1, 0, m}, order_of(epoch + 1).slice(0, 0, std::min(n_, m)));
    }
    s_.batch = &batch;
    s_.counters.batch_in_epoch = b;
    window_indices_.push_back(indices(b));
    recorder_.add(batch);
    // TK_FAULT=oom:N makes the N-th micro-batch of training fail as out of memory (trials are not counted).
    if (fault_due("oom")) TORCH_CHECK_WITH(OutOfMemoryError, false, "out of memory (injected by TK_FAULT=oom)");
    engine_.micro_batch(batch);
  } catch (const c10::OutOfMemoryError& e) {
    s_.batch = nullptr;
    prefetch_->drain();  // its memory back before the window is redone
    if (!backoff_.ready()) throw;
    std::string note;
    b = backoff_.back_off(s_, message_of(e), note);  // the window again, from its first micro-batch
    recorder_.note_backoff(std::move(note));
    in_window_ = false;
    return false;
  }
  s_.batch = nullptr;
  return true;
}

const at::Tensor& Loop::order_of(int64_t epoch) {
  if (order_epoch_ != epoch) {
    order_ = r_.shard_order(epoch);
    order_epoch_ = epoch;
  }
  return order_;
}

void Loop::train_epoch(int64_t epoch, int64_t first) {
  const at::Tensor order = order_of(epoch);
  s_.counters.epoch = epoch;
  if (first == 0) events_.emit(Event::EpochStart);
  for (int64_t b = first; b < r_.batches_per_epoch && !done_;) {
    if (!in_window_) {
      auto w = r_.windows->start(epoch, b, s_.counters.step, seen_.samples);
      if (!w) break;  // the policy drops the rest of this epoch
      s_.window = *w;
      open_window(epoch, b);
    } else {
      ++s_.window.index;
    }
    if (!train_micro_batch(epoch, b, order)) continue;
    if (s_.window.is_last()) {
      in_window_ = false;
      end_window(epoch, b);  // the window is complete: one optimizer step
    }
    ++b;
  }
  events_.emit(Event::EpochEnd);
}

void Loop::train_epochs(Start start) {
  clear_grads(r_);  // before fit_start: data parallel's buckets take the gradients as they are made
  events_.emit(Event::FitStart);
  clear_grads(r_);
  done_ = s_.counters.step >= r_.total_steps;
  recorder_.start();
  prefetch_.emplace(r_, *r_.data.train);
  if (prefetch_->active()) spdlog::debug("prefetch: on ({})", prefetch_->reason());
  for (int64_t epoch = start.epoch; !done_ && (r_.bound.by_steps() || epoch < r_.bound.count); ++epoch)
    train_epoch(epoch, epoch == start.epoch ? start.batch : 0);
  prefetch_.reset();
  recorder_.stop();
}

/// After the last step: the final validation when the last step had none, and fit_end.
void Loop::finish_training() {
  if (result_.status == FitStatus::Running) result_.status = FitStatus::Completed;
  if (r_.data.validation && result_.status == FitStatus::Completed && validator_.last_step() != s_.counters.step) {
    StepRecord line;
    line.add(metric::kStep, s_.counters.step);
    validator_.record(line, *progress_, result_.validation_losses);
    outputs_->record(line.line());
  }
  s_.status = result_.status;
  events_.fit_end();
}

/// status.json of a run that fails with the exception in flight: "failed" and its message. Never
/// throws: the run's own error is the one to report.
void record_failure(const RunOutputs& outputs, int64_t step) noexcept {
  try {
    std::string what = "an unknown exception";
    try {
      throw;
    } catch (const std::exception& e) {
      what = message_of(e);
    } catch (...) {
    }
    outputs.status("failed", step, what);
  } catch (...) {
  }
}

std::optional<Checkpoint> Loop::resume(RunOutputs& outputs) {
  std::optional<Checkpoint> resumed;
  // Model, optimizer and RNG come back now, plugin states before fit_start.
  if (outputs.resumes_auto()) {  // the newest checkpoint of this run, or a fresh start
    if (auto dir = checkpoint_to_continue(r_, outputs.dir()))
      resumed = resume_from(r_, dir->string(), outputs.dir(), outputs.identity(), opts_.allow_changes);
    else
      outputs.start_afresh();
  } else if (opts_.resume) {
    resumed = resume_from(r_, *opts_.resume, outputs.dir(), outputs.identity(), opts_.allow_changes);
  }
  if (outputs.active()) result_.output_dir = s_.output_dir = outputs.dir();
  return resumed;
}

/// The final checkpoint: the run is complete. Nothing is trained, recorded or rewritten but what a
/// run killed right after its last checkpoint did not write (weights.pt, the plugins' files).
FitResult Loop::already_complete(RunOutputs& outputs, const Checkpoint& resumed) {
  const int64_t step = resumed.position.counters.step;
  try {
    outputs.complete_again(r_);
  } catch (...) {
    record_failure(outputs, step);
    throw;
  }
  // A run whose end failed (a plugin's file) is complete once what was missing is written.
  const char* completed = to_string(FitStatus::Completed);
  if (outputs.active() && outputs.recorded_status() != completed) outputs.status(completed, step);
  FitResult result;
  result.already_complete = true;
  result.status = FitStatus::Completed;
  result.output_dir = result_.output_dir;
  result.checkpoint = resumed.dir;
  result.steps = step;
  result.micro_steps = resumed.position.counters.micro_step;
  result.skipped_steps = resumed.position.counters.skipped_steps;
  result.resumed_at_step = result.steps;  // nothing trained
  result.resumed_at_micro_step = result.micro_steps;
  result.resumed_skipped_steps = result.skipped_steps;
  result.files = outputs.written();
  return result;
}

Start Loop::start_from(const std::optional<Checkpoint>& resumed) {
  if (!resumed) return {};
  // The checkpoint counts micro-batches in the size it trained with: after a back-off from an
  // out-of-memory error, a smaller one than this run picked.
  const int64_t saved_m = resumed->position.micro_batch;
  if (saved_m > 0 && saved_m != r_.plan.micro_batch) {
    if (!r_.plan.micro_batch_auto)
      throw RunRefused(resumed->dir.string() + " was trained with micro-batches of " + std::to_string(saved_m) +
                       ", this run has " + std::to_string(r_.plan.micro_batch));
    const int64_t measured = r_.plan.micro_batch;
    rebatch(r_, saved_m);
    // The plan printed before says the measured one: the step's shape as it trains (a ramp's end).
    spdlog::info("micro-batch {} as in the checkpoint (this run measured {}): {} micro-batches per step{}", saved_m, measured,
                 r_.plan.accumulation, r_.plan.ramp.active() ? " at the end of the ramp" : "");
  }
  s_.counters = resumed->position.counters;
  result_.resumed_at_step = s_.counters.step;
  result_.resumed_at_micro_step = s_.counters.micro_step;
  result_.resumed_skipped_steps = s_.counters.skipped_steps;
  seen_ = resumed->position.seen;
  const Start start{resumed->position.next_epoch, resumed->position.next_batch};
  spdlog::info("resuming from {} at step {} (epoch {}, micro-batch {})", resumed->dir.string(), s_.counters.step,
               start.epoch + 1, start.batch);
  return start;
}

FitResult Loop::summary() {
  result_.stopped = result_.status == FitStatus::StoppedBySignal ? "signal"
                    : result_.status == FitStatus::StoppedByTime ? "max_time" : "";
  result_.steps = s_.counters.step;
  result_.micro_steps = s_.counters.micro_step;
  result_.skipped_steps = s_.counters.skipped_steps;
  result_.seconds = stop_.elapsed();
  result_.peak_rss_mib = peak_rss_mib();
  result_.files = outputs_->written();
  return result_;
}

FitResult Loop::fit(const Recipe& recipe) {
  RunOutputs outputs(r_, recipe, opts_);
  outputs_ = &outputs;
  agree_on_identity(*r_.world, outputs.identity());  // before any rank touches the folder
  outputs.claim();  // the folder is this run's until it ends
  const std::optional<Checkpoint> resumed = resume(outputs);
  if (resumed && resumed->position.counters.step >= r_.total_steps) return already_complete(outputs, *resumed);
  outputs.open(resumed);
  const Start start = start_from(resumed);
  progress_.emplace(r_.plan.rank == 0 ? opts_.progress : ProgressMode::None, r_.total_steps,
                    r_.run.get_int("log_every"));
  progress_->starting_at(s_.counters.step);
  seen_at_start_ = seen_.samples;
  checkpoints_.emplace(r_, outputs);
  validate_every_ = r_.run.get_int("validate_every");
  stop_.start(s_.counters.step);
  outputs.status("running", s_.counters.step);
  try {
    train_epochs(start);
    finish_training();
  } catch (...) {
    if (opts_.on_failure) opts_.on_failure();
    prefetch_.reset();  // no data is read while plugins clean up
    recorder_.stop();
    progress_->finish();
    events_.fit_end_after_failure();
    record_failure(outputs, s_.counters.step);
    throw;
  }
  progress_->finish();
  try {
    outputs.finish(r_, trace_, result_.status == FitStatus::Completed);
  } catch (...) {
    record_failure(outputs, s_.counters.step);
    throw;
  }
  outputs.status(to_string(result_.status), s_.counters.step);
  return summary();
}

}  // namespace

FitResult train(Run& run, const Recipe& recipe, const TrainerOptions& opts, std::vector<TraceEntry>& trace) {
  return Loop(run, opts, trace).fit(recipe);
}

}  // namespace tk::detail
