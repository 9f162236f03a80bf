// The training loop: windows of micro-batches, the events around each phase, the optimizer step,
// validation, checkpoints. Everything else about a run is assembled before it starts (assembly.cpp).
#include <spdlog/spdlog.h>

#include <array>
#include <chrono>
#include <cmath>
#include <mutex>

#include "prefetch.h"
#include "run.h"

namespace fs = std::filesystem;

namespace tk::detail {
namespace {

class Loop {
 public:
  Loop(Run& run, const TrainerOptions& opts, std::vector<TraceEntry>& trace);
  FitResult fit(const Recipe& recipe);

 private:
  void emit(Event e);
  void micro_batch(Batch& batch);
  bool optimizer_step();
  std::pair<double, double> validate();
  std::string validation_record(JsonLine& line, FitResult& result);
  void fit_end_after_failure();

  /// What a window changes before its step, kept at its start to redo it after a back-off.
  struct WindowStart {
    int64_t batch = 0;  // its first micro-batch in the epoch
    Counters counters;
    RngStates rng;
  };
  /// With a micro-batch picked by memory, an out-of-memory error halves it.
  bool back_off_ready() const noexcept { return r_.plan.micro_batch_auto; }
  WindowStart open_window(int64_t b);
  /// Undoes the window that began at `w`, halves the micro-batch (k doubles) and returns the
  /// micro-batch, in the new size, where the window starts again; refuses when it cannot.
  int64_t back_off(const WindowStart& w, const std::string& what);

  Run& r_;
  const TrainerOptions& opts_;
  std::vector<TraceEntry>& trace_;
  LoopContext ctx_;
  const int64_t n_;  // examples this rank reads per epoch
  std::string backoff_note_;  // for the next step's record
  std::array<std::vector<const Slot*>, kEventCount> handlers_;  // who still handles each event, in order
};

Loop::Loop(Run& run, const TrainerOptions& opts, std::vector<TraceEntry>& trace)
    : r_(run), opts_(opts), trace_(trace), n_(run.shard_size()) {
  ctx_.model_ = run.model.get();
  ctx_.optimizer_ = run.optimizer.get();
  ctx_.plan_ = &run.plan;
  ctx_.reduction_ = run.loss->reduction();
  ctx_.counters_.total_steps = run.total_steps;
  ctx_.log_ = [&run](int level, const std::string& msg) {
    if (level > 0) run.warn(msg);
    else spdlog::info("{}", msg);
  };
  for (auto& list : handlers_)
    for (size_t i : run.order) list.push_back(&run.slots[i]);
}

void Loop::emit(Event e) {
  auto& list = handlers_[static_cast<size_t>(e)];
  for (size_t i = 0; i < list.size();) {
    const Slot& s = *list[i];
    ctx_.current_plugin_ = s.name;
    auto failure = [&](const std::string& what) {
      return PluginRuntimeError("plugin '" + s.name + "' failed in event " + to_string(e) + " at step " +
                                std::to_string(ctx_.counters_.step) + " (micro-batch " +
                                std::to_string(ctx_.counters_.micro_step) + "): " + what);
    };
    try {
      dispatch(*s.plugin, e, ctx_);
    } catch (const std::exception& err) {  // LibTorch's among them: one line, no C++ stack
      throw failure(message_of(err));
    } catch (...) {
      throw failure("an unknown exception");
    }
    if (!s.plugin->handles(e)) {  // the base hook ran: never call it again
      list.erase(list.begin() + static_cast<std::ptrdiff_t>(i));
      continue;
    }
    if (r_.tracing) trace_.push_back({s.name, e, ctx_.counters_.step, ctx_.counters_.micro_step});
    ++i;
  }
  ctx_.current_plugin_.clear();
}

void Loop::micro_batch(Batch& batch) {
  if (fault_due("oom")) TORCH_CHECK_WITH(OutOfMemoryError, false, "out of memory (injected by TK_FAULT=oom)");
  emit(Event::MicroBatch);
  at::Tensor out = r_.model->forward(batch.input);
  ctx_.loss_ = (*r_.loss)(out, batch);
  // The loss stays on the device: no host read per micro-batch (loss_value() reads on demand).
  ctx_.loss_item_ = ctx_.loss_.detach();
  ctx_.loss_read_ = false;
  emit(Event::Loss);
  ctx_.loss_.backward();
  ctx_.loss_ = at::Tensor();
  Counters& c = ctx_.counters_;
  WindowTotals& t = ctx_.totals_;
  ++c.micro_step;
  c.samples_seen += batch.samples;
  c.tokens_seen += batch.tokens;
  t.micro_batches += 1;
  t.samples += batch.samples;
  t.tokens += batch.tokens;
  at::Tensor weighted = ctx_.loss_item_.to(at::kDouble);
  if (ctx_.reduction_ == Reduction::Mean) weighted = weighted * static_cast<double>(batch.tokens);
  t.loss = t.loss.defined() ? t.loss + weighted : weighted;
  emit(Event::Backward);
}

bool Loop::optimizer_step() {
  ctx_.lr_ = r_.schedule->lr(ctx_.counters_.schedule_step, r_.total_steps);
  set_lr(*r_.optimizer, ctx_.lr_);
  ctx_.veto_reason_.clear();
  ctx_.vetoed_by_.clear();
  ctx_.veto_advances_schedule_ = false;
  ctx_.metrics_.clear();
  ctx_.deferred_.clear();
  ctx_.flagged_.clear();
  emit(Event::Boundary);
  // After the boundary (a sync plugin may have replaced the totals with sums over all ranks):
  // the step's one read from the device.
  ctx_.read_step_values();
  const WindowTotals& t = ctx_.totals_;
  ctx_.window_loss_ = t.tokens > 0 ? t.loss_sum / static_cast<double>(t.tokens) : 0.0;
  const bool skipped = ctx_.step_vetoed();
  if (!skipped && !std::isfinite(ctx_.window_loss_))
    throw Error("the loss is " + std::to_string(ctx_.window_loss_) + " at step " +
                std::to_string(ctx_.counters_.step + 1) + ": training diverged; nothing was stepped (lower the learning rate?)");
  if (!skipped) r_.optimizer->step();
  else ++ctx_.counters_.skipped_steps;
  r_.optimizer->zero_grad();
  ++ctx_.counters_.step;
  if (!skipped || ctx_.veto_advances_schedule_) ++ctx_.counters_.schedule_step;
  emit(Event::StepEnd);
  return skipped;
}

Loop::WindowStart Loop::open_window(int64_t b) { return {b, ctx_.counters_, save_rng()}; }

int64_t Loop::back_off(const WindowStart& w, const std::string& what) {
  const int64_t m = r_.plan.micro_batch, k = r_.plan.accumulation;
  std::string why_not;
  if (r_.plan.world_size > 1) why_not = "under DDP, where every rank would have to back off together";
  else if (r_.plan.ramp.active()) why_not = "during a batch ramp";
  else if (r_.plan.last_window == LastWindow::Carry) why_not = "with last_window = \"carry\"";
  const int64_t smaller = why_not.empty() ? backed_off_micro_batch(r_) : 0;
  if (why_not.empty() && smaller == 0) why_not = "below a micro-batch of " + std::to_string(m);
  const std::string where = "out of memory at step " + std::to_string(w.counters.step + 1) + " with micro-batches of " +
                            std::to_string(m) + " (" + what + ")";
  if (!why_not.empty()) throw Error(where + "; it cannot back off " + why_not);
  // Nothing of the window stays: its gradients, counts and random draws.
  ctx_.loss_ = at::Tensor();
  for (auto& p : r_.model->parameters()) p.mutable_grad() = at::Tensor();
  ctx_.counters_ = w.counters;
  restore_rng(w.rng);
  const int64_t first_example = w.batch * m;
  rebatch(r_, smaller);
  backoff_note_ = "micro-batch " + std::to_string(m) + " x " + std::to_string(k) + " -> " + std::to_string(smaller) +
                  " x " + std::to_string(r_.plan.accumulation);
  r_.warn(where + "; backing off to " + std::to_string(smaller) + " x " + std::to_string(r_.plan.accumulation) +
          " micro-batches, and the step is redone from its first");
  return first_example / smaller;
}

/// Loss (item-weighted) and accuracy over the validation split.
std::pair<double, double> Loop::validate() {
  r_.model->eval();
  double loss_sum = 0.0;
  int64_t items = 0, correct = 0;
  const bool classes = r_.data.info.classification;
  {
    torch::NoGradGuard no_grad;  // both validation hooks run in eval mode without grad
    emit(Event::ValidationStart);
    const int64_t n = r_.data.validation->size(), m = r_.plan.micro_batch;
    for (int64_t start = 0; start < n; start += m) {
      Batch b = r_.fetch(*r_.data.validation, at::arange(start, std::min(n, start + m), at::kLong));
      auto out = r_.model->forward(b.input);
      const double l = (*r_.loss)(out, b).item<double>();
      loss_sum += ctx_.reduction_ == Reduction::Mean ? l * static_cast<double>(b.tokens) : l;
      items += b.tokens;
      if (classes) correct += (out.argmax(-1) == b.target).sum().item<int64_t>();
    }
    ctx_.validation_loss_ = items > 0 ? loss_sum / static_cast<double>(items) : 0.0;
    emit(Event::ValidationEnd);
  }
  r_.model->train();
  return {ctx_.validation_loss_,
          items > 0 && classes ? static_cast<double>(correct) / static_cast<double>(items) : std::nan("")};
}

/// Runs validation and adds its values to the step's record; returns the progress line.
std::string Loop::validation_record(JsonLine& line, FitResult& result) {
  auto [vloss, acc] = validate();
  result.validation_losses.push_back(vloss);
  line.add("validation_loss", vloss);
  std::string note = "validation  step " + std::to_string(ctx_.counters_.step) + "  loss " + fmt_loss(vloss);
  if (!std::isnan(acc)) line.add("validation_accuracy", acc);
  const DataInfo& info = r_.data.info;
  if (info.next_token) {
    const double ppl = std::exp(vloss);
    line.add("validation_perplexity", ppl);
    note += "  perplexity " + fmt_loss(ppl);
    if (!info.baseline_name.empty())
      note += "  (" + info.baseline_name + " baseline loss " + fmt_loss(info.baseline_loss) + ")";
  } else if (!std::isnan(acc)) {
    note += "  accuracy " + std::to_string(acc * 100.0).substr(0, 5) + "%";
  }
  return note;
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

/// After a failure every plugin gets fit_end (status failed) once; its errors then are dropped.
void Loop::fit_end_after_failure() {
  if (ctx_.status_ != FitStatus::Running) return;  // fit_end itself failed: it ran once already
  ctx_.status_ = FitStatus::Failed;
  for (const Slot* s : handlers_[static_cast<size_t>(Event::FitEnd)]) {
    try {
      ctx_.current_plugin_ = s->name;
      s->plugin->on_fit_end(ctx_);
    } catch (...) {
    }
  }
}

FitResult Loop::fit(const Recipe& recipe) {
  FitResult result;
  RunOutputs outputs(r_, recipe, opts_);
  outputs.claim();  // the folder is this run's until it ends
  // Resuming: model, optimizer and RNG come back now, plugin states before fit_start.
  std::optional<Checkpoint> resumed;
  if (opts_.resume)
    resumed = resume_from(r_, *opts_.resume, outputs.dir(), outputs.identity(), opts_.allow_changes);
  if (outputs.active()) result.output_dir = ctx_.output_dir_ = outputs.dir();
  if (resumed && resumed->position.counters.step >= r_.total_steps) {
    // The final checkpoint: the run is complete. Nothing is trained, recorded or rewritten, but
    // the weights of a run killed right after its last checkpoint.
    if (!outputs.has_weights()) outputs.write_weights(r_);
    result.already_complete = true;
    result.status = FitStatus::Completed;
    result.checkpoint = resumed->dir;
    result.steps = resumed->position.counters.step;
    result.micro_steps = resumed->position.counters.micro_step;
    result.skipped_steps = resumed->position.counters.skipped_steps;
    return result;
  }
  outputs.open(resumed);
  int64_t start_epoch = 0, start_batch = 0;
  if (resumed) {
    // The checkpoint counts micro-batches in the size it trained with: after a back-off from an
    // out-of-memory error, a smaller one than this run picked.
    const int64_t saved_m = resumed->position.micro_batch;
    if (saved_m > 0 && saved_m != r_.plan.micro_batch) {
      if (!r_.plan.micro_batch_auto)
        throw RunRefused(resumed->dir.string() + " was trained with micro-batches of " + std::to_string(saved_m) +
                         ", this run has " + std::to_string(r_.plan.micro_batch));
      spdlog::info("micro-batch {} as in the checkpoint (this run measured {})", saved_m, r_.plan.micro_batch);
      rebatch(r_, saved_m);
    }
    ctx_.counters_ = resumed->position.counters;
    start_epoch = resumed->position.next_epoch;
    start_batch = resumed->position.next_batch;
    spdlog::info("resuming from {} at step {} (epoch {}, micro-batch {})", resumed->dir.string(),
                 ctx_.counters_.step, start_epoch + 1, start_batch);
  }
  Progress progress(r_.plan.rank == 0 ? opts_.progress : ProgressMode::None, r_.total_steps,
                    r_.run.get_int("log_every"));
  const int64_t checkpoint_every = r_.run.get_int("checkpoint_every"), validate_every = r_.run.get_int("validate_every");
  const auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  int64_t last_validation_step = -1;
  auto record_validation = [&](JsonLine& line) {
    progress.note(validation_record(line, result));
    last_validation_step = ctx_.counters_.step;
  };
  Counters& c = ctx_.counters_;
  outputs.status("running", c.step);

  try {
    emit(Event::FitStart);
    r_.optimizer->zero_grad();
    bool done = c.step >= r_.total_steps;
    const int64_t world = r_.plan.world_size;
    bool in_window = false;  // checkpoints and resumes are at boundaries: a run starts outside a window
    WindowStart opened;
    // A micro-batch picked by memory, or any run on CUDA (where reading the caching allocator's
    // peak costs nothing): each step's record says how much it took.
    std::optional<MemoryMeter> meter;
    if (r_.plan.micro_batch_auto || r_.device.is_cuda()) meter.emplace(r_);
    Prefetcher prefetch(r_, *r_.data.train);
    if (prefetch.active()) spdlog::debug("prefetch: on ({})", prefetch.reason());
    for (int64_t epoch = start_epoch; !done && (r_.bound.by_steps() || epoch < r_.bound.count); ++epoch) {
      at::Tensor order = r_.shard_order(epoch);
      c.epoch = epoch;
      const int64_t first = epoch == start_epoch ? start_batch : 0;
      if (first == 0) emit(Event::EpochStart);
      for (int64_t b = first; b < r_.batches_per_epoch && !done; ++b) {
        if (!in_window) {
          auto w = r_.windows->start(epoch, b, c.step, c.samples_seen * world);
          if (!w) break;  // the policy drops the rest of this epoch
          ctx_.window_ = *w;
          ctx_.totals_ = WindowTotals{};
          ctx_.host_reads_ = 0;
          in_window = true;
          if (back_off_ready()) opened = open_window(b);
        } else {
          ++ctx_.window_.index;
        }
        const int64_t m = r_.plan.micro_batch;
        auto indices = [&](int64_t i) { return order.slice(0, i * m, std::min(n_, (i + 1) * m)); };
        Batch batch;
        try {
          // A batch made ahead may be the one that ran out of memory: it backs off like the step.
          batch = prefetch.take({epoch, b, m}, indices(b));
          // The next micro-batch of this epoch is made while this one trains.
          if (b + 1 < r_.batches_per_epoch) prefetch.ahead({epoch, b + 1, m}, indices(b + 1));
          ctx_.batch_ = &batch;
          c.batch_in_epoch = b;
          micro_batch(batch);
        } catch (const c10::OutOfMemoryError& e) {
          ctx_.batch_ = nullptr;
          prefetch.drain();  // its memory back before the window is redone
          if (!back_off_ready()) throw;
          b = back_off(opened, message_of(e)) - 1;  // the window again, from its first micro-batch
          in_window = false;
          continue;
        }
        ctx_.batch_ = nullptr;
        if (!ctx_.window_.is_last()) continue;
        in_window = false;

        // The window is complete: one optimizer step.
        const bool skipped = optimizer_step();
        result.window_losses.push_back(ctx_.window_loss_);
        result.step_metrics.emplace_back(ctx_.metrics_.begin(), ctx_.metrics_.end());
        const double t = elapsed();
        JsonLine line = step_record(ctx_, epoch, skipped, t);
        if (meter) {
          constexpr double kMiB = 1024.0 * 1024.0;
          if (r_.plan.micro_batch_auto) line.add("micro_batch", r_.plan.micro_batch);
          line.add("step_peak_mib", meter->take_peak() / kMiB);
          if (r_.plan.memory_budget > 0) line.add("memory_budget_mib", r_.plan.memory_budget / kMiB);
        }
        if (!backoff_note_.empty()) {
          line.add("backoff", backoff_note_);
          backoff_note_.clear();
        }
        done = c.step >= r_.total_steps;
        if (r_.data.validation && ((validate_every > 0 && c.step % validate_every == 0) || done)) {
          record_validation(line);
          if (meter) meter->take_peak();  // validation's memory is not the next step's
        }
        // Stop early at this boundary when asked to (a signal) or out of time; with a checkpoint.
        if (!done && opts_.stop_requested && opts_.stop_requested()) result.status = FitStatus::StoppedBySignal;
        else if (!done && elapsed() >= r_.max_time_s) result.status = FitStatus::StoppedByTime;
        if (result.status != FitStatus::Running) done = true;
        // The step's record first: a checkpoint never holds a step whose record could be lost.
        outputs.record(line);
        if (outputs.active() && (done || (checkpoint_every > 0 && c.step % checkpoint_every == 0)))
          result.checkpoint = outputs.checkpoint(r_, c, epoch, b);
        progress.update(c.step, epoch, ctx_.window_loss_, ctx_.lr_,
                        static_cast<double>(c.samples_seen) / std::max(t, 1e-9), t);
      }
      emit(Event::EpochEnd);
    }
    if (result.status == FitStatus::Running) result.status = FitStatus::Completed;
    if (r_.data.validation && result.status == FitStatus::Completed && last_validation_step != c.step) {
      JsonLine line;
      line.add("step", c.step);
      record_validation(line);
      outputs.record(line);
    }
    ctx_.status_ = result.status;
    emit(Event::FitEnd);
  } catch (...) {
    if (opts_.on_failure) opts_.on_failure();
    progress.finish();
    fit_end_after_failure();
    record_failure(outputs, c.step);
    throw;
  }
  progress.finish();
  try {
    outputs.finish(r_, trace_);
  } catch (...) {
    record_failure(outputs, c.step);
    throw;
  }
  outputs.status(to_string(result.status), c.step);
  result.stopped = result.status == FitStatus::StoppedBySignal ? "signal"
                   : result.status == FitStatus::StoppedByTime ? "max_time" : "";
  result.steps = c.step;
  result.micro_steps = c.micro_step;
  result.skipped_steps = c.skipped_steps;
  result.seconds = elapsed();
  result.peak_rss_mib = peak_rss_mib();
  return result;
}

}  // namespace

FitResult train(Run& run, const Recipe& recipe, const TrainerOptions& opts, std::vector<TraceEntry>& trace) {
  return Loop(run, opts, trace).fit(recipe);
}

}  // namespace tk::detail
