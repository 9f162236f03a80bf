// The training loop: windows of micro-batches, the events around each phase, the optimizer step,
// validation, checkpoints. Everything else about a run is assembled and planned before it starts.
#include <torch/serialize/output-archive.h>
#include <spdlog/spdlog.h>

#include <array>
#include <chrono>
#include <cmath>
#include <set>

#include "loop/loop.h"
#include "tk/compat.h"
#include "assemble/assemble.h"
#include "planning/planning.h"

namespace fs = std::filesystem;

namespace tk::detail {
namespace {

/// The plugins' Context over the loop's state.
class LoopView final : public Context {
 public:
  explicit LoopView(LoopState* s) noexcept : Context(s) {}
};

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
  void emit(Event e);
  void open_window(int64_t epoch, int64_t b);
  /// Trains micro-batch `b`; false when it ran out of memory and the window starts again at `b`.
  bool train_micro_batch(int64_t epoch, int64_t& b, const at::Tensor& order);
  void micro_batch(Batch& batch);
  bool optimizer_step();
  /// After the window's last micro-batch: the step, its record, validation, a stop, a checkpoint.
  void end_window(int64_t epoch, int64_t b);
  /// The step's throughput (examples_per_s, tokens_per_s) and, for a model that counts its FLOPs,
  /// model_gflop, gflops and, with run.peak_gflops, mfu.
  void add_rates(JsonLine& line) const;
  JsonLine step_record(int64_t epoch, bool skipped, double wall_time);
  void record_validation(JsonLine& line);
  std::pair<double, double> validate();
  void fit_end();
  void fit_end_after_failure();
  std::string model_label() const;
  std::string non_finite_loss();

  /// What a window changes before its step, kept at its start to redo it after a back-off.
  struct WindowStart {
    int64_t batch = 0;  // its first micro-batch in the epoch
    Counters counters;
    RngStates rng;
  };
  /// With a micro-batch picked by memory, an out-of-memory error halves it.
  bool back_off_ready() const noexcept { return r_.plan.micro_batch_auto; }
  /// Undoes the window that began at `w`, halves the micro-batch (k doubles) and returns the
  /// micro-batch, in the new size, where the window starts again; refuses when it cannot.
  int64_t back_off(const WindowStart& w, const std::string& what);

  double elapsed() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count(); }
  /// A run that time stopped before its schedule's end never took its last learning rates: says
  /// so, with the run.steps that this run's pace fits into run.max_time.
  void note_unfinished_schedule();

  Run& r_;
  const TrainerOptions& opts_;
  std::vector<TraceEntry>& trace_;
  LoopState s_;
  LoopView ctx_{&s_};
  const int64_t n_;  // examples this rank reads per epoch
  std::array<std::vector<const Slot*>, kEventCount> handlers_;  // who handles each event, in order
  std::set<const Slot*> not_started_;  // plugins whose on_fit_start has not run (yet)

  // State of the fit in progress.
  FitResult result_;
  RunOutputs* outputs_ = nullptr;
  std::optional<Progress> progress_;
  std::optional<MemoryMeter> meter_;
  std::optional<Prefetcher> prefetch_;
  std::chrono::steady_clock::time_point t0_;
  int64_t checkpoint_every_ = 0, validate_every_ = 0, last_validation_step_ = -1;
  int64_t first_step_ = 0;  // the step this process started from (0, or a resume's)
  /// With run.phase_times: where each window's time went, in ms, for its record.
  enum Phase { kData, kForward, kBackward, kBoundary, kOptimizer, kValidation, kPhases };
  struct PhaseTimes {
    bool on = false, cuda = false;  // on CUDA each mark waits for the device: the phases' own time
    std::array<double, kPhases> ms{};
    std::chrono::steady_clock::time_point t;
    void mark() {
      if (!on) return;
      if (cuda) compat::cuda_synchronize();
      t = std::chrono::steady_clock::now();
    }
    void add(Phase p) {
      if (!on) return;
      const auto before = t;
      mark();
      ms[static_cast<size_t>(p)] += std::chrono::duration<double, std::milli>(t - before).count();
    }
    /// The window's phases into its record (validation_ms only on a step that validated).
    void record(JsonLine& line) const {
      static const char* const kNames[kPhases] = {"data_ms",     "forward_ms",   "backward_ms",
                                                  "boundary_ms", "optimizer_ms", "validation_ms"};
      if (!on) return;
      for (size_t p = 0; p < kPhases; ++p)
        if (p != kValidation || ms[p] > 0.0) line.add(kNames[p], ms[p]);
    }
  } phases_;
  // Each window's arithmetic and its time, for its record's rates.
  const ModelWithFlops* flops_ = nullptr;  // the model, when it counts its FLOPs
  double window_flops_ = 0;
  double peak_gflops_ = 0;    // run.peak_gflops
  std::chrono::steady_clock::time_point window_t0_;
  /// The order of `epoch`'s examples on this rank, kept for the one asked for last (the epoch in
  /// training, or the next one when its first micro-batch is made ahead).
  const at::Tensor& order_of(int64_t epoch);
  int64_t order_epoch_ = -1;
  at::Tensor order_;
  bool done_ = false, in_window_ = false;  // checkpoints and resumes are at boundaries
  WindowStart opened_;
  std::vector<at::Tensor> window_indices_;  // the examples of the window's micro-batches, for a diagnosis
  std::string backoff_note_;  // for the next step's record
};

Loop::Loop(Run& run, const TrainerOptions& opts, std::vector<TraceEntry>& trace)
    : r_(run), opts_(opts), trace_(trace), n_(run.shard_size()) {
  s_.model = run.model.get();
  s_.optimizer = run.optimizer.get();
  s_.plan = &run.plan;
  s_.counters.total_steps = run.total_steps;
  s_.d.log = run.dispatch.log;
  for (int e = 0; e < kEventCount; ++e)
    for (size_t i : run.order)
      if (run.slots[i].plugin->handles(static_cast<Event>(e))) handlers_[e].push_back(&run.slots[i]);
}

void Loop::emit(Event e) {
  auto& list = handlers_[static_cast<size_t>(e)];
  for (size_t i = 0; i < list.size();) {
    const Slot& s = *list[i];
    if (!s.plugin->handles(e)) {  // it declined the event (in this hook or another)
      list.erase(list.begin() + static_cast<std::ptrdiff_t>(i));
      continue;
    }
    s_.d.enter(s.name, hook_name(e), e);
    auto failure = [&](const std::string& what) {
      s_.d.leave();
      return PluginRuntimeError("plugin '" + s.name + "' failed in event " + to_string(e) + " at step " +
                                std::to_string(s_.counters.step) + " (micro-batch " +
                                std::to_string(s_.counters.micro_step) + "): " + what);
    };
    try {
      dispatch(*s.plugin, e, ctx_);
    } catch (const std::exception& err) {  // LibTorch's among them: one line, no C++ stack
      throw failure(message_of(err));
    } catch (...) {
      throw failure("an unknown exception");
    }
    if (e == Event::FitStart) not_started_.erase(&s);
    if (r_.tracing) trace_.push_back({s.name, e, s_.counters.step, s_.counters.micro_step});
    ++i;
  }
  s_.d.leave();
}

void Loop::micro_batch(Batch& batch) {
  if (fault_due("oom")) TORCH_CHECK_WITH(OutOfMemoryError, false, "out of memory (injected by TK_FAULT=oom)");
  phases_.mark();
  if (flops_) window_flops_ += flops_->train_flops(batch.input.sizes());
  emit(Event::MicroBatch);
  at::Tensor out = r_.model->forward(batch.input);
  s_.loss = (*r_.loss)(out, batch);
  if (!s_.loss.requires_grad())
    throw Error(model_label() + ": its output does not depend on a trainable parameter (it is detached, or computed "
                "without grad): backward has nothing to differentiate");
  // The loss stays on the device: no host read per micro-batch (loss_value() reads on demand).
  s_.loss_item = s_.loss.detach();
  s_.loss_read = false;
  emit(Event::Loss);
  phases_.add(kForward);
  s_.loss.backward();
  s_.loss = at::Tensor();
  Counters& c = s_.counters;
  WindowTotals& t = s_.totals;
  ++c.micro_step;
  c.samples_seen += batch.samples;
  c.tokens_seen += batch.tokens;
  t.micro_batches += 1;
  t.samples += batch.samples;
  t.tokens += batch.tokens;
  // The item-weighted sum, in place: one device op per micro-batch. A float32 (or 16-bit) loss
  // times a count below 2^29 is exact in float64, so the fused add rounds as a mul and an add would.
  const double items = r_.plan.reduction == Reduction::Mean ? static_cast<double>(batch.tokens) : 1.0;
  if (t.loss.defined()) {
    t.loss.add_(s_.loss_item, items);
  } else {
    t.loss = s_.loss_item.to(at::kDouble, /*non_blocking=*/false, /*copy=*/true);  // not an alias of the loss
    if (items != 1.0) t.loss.mul_(items);
  }
  emit(Event::Backward);
  phases_.add(kBackward);
}

bool Loop::optimizer_step() {
  s_.lr = r_.schedule->lr(s_.counters.schedule_step, r_.total_steps);
  set_lr(*r_.optimizer, s_.lr);
  s_.step.clear();
  phases_.mark();
  emit(Event::Boundary);
  // After the boundary (a sync plugin may have replaced the totals with sums over all ranks):
  // the step's one read from the device.
  s_.read_step_values();
  phases_.add(kBoundary);
  const WindowTotals& t = s_.totals;
  s_.window_loss = t.tokens > 0 ? t.loss_sum / static_cast<double>(t.tokens) : 0.0;
  const bool skipped = !s_.step.veto_reason.empty();
  if (!skipped && !std::isfinite(s_.window_loss)) throw Error(non_finite_loss());
  if (!skipped) r_.optimizer->step();
  else ++s_.counters.skipped_steps;
  zero_grads(r_);
  ++s_.counters.step;
  if (!skipped || s_.step.veto_advances_schedule) ++s_.counters.schedule_step;
  emit(Event::StepEnd);
  phases_.add(kOptimizer);
  return skipped;
}

void Loop::note_unfinished_schedule() {
  if (r_.sched_name == "constant" || r_.plan.rank != 0) return;
  const int64_t done = s_.counters.step - first_step_;
  const double seconds = elapsed();
  if (done < 1 || seconds <= 0.0) return;
  const auto fit = static_cast<int64_t>(std::floor(static_cast<double>(done) * r_.max_time_s / seconds));
  r_.warn(fmt::format("run.max_time stopped the run at step {} of run.steps = {}: schedule '{}' had not ended (lr "
                      "{:.3g} at this step, {:.3g} at its last). At this run's pace ({:.3g} s a step) about {} steps "
                      "fit in run.max_time; set run.steps to that for a schedule that ends with the time",
                      s_.counters.step, r_.total_steps, r_.sched_name, s_.lr,
                      r_.schedule->lr(r_.total_steps - 1, r_.total_steps), seconds / static_cast<double>(done),
                      first_step_ + fit));
}

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
  s_.loss = at::Tensor();
  zero_grads(r_);
  s_.counters = w.counters;
  restore_rng(w.rng);
  const int64_t first_example = w.batch * m;
  rebatch(r_, smaller);
  backoff_note_ = "micro-batch " + std::to_string(m) + " x " + std::to_string(k) + " -> " + std::to_string(smaller) +
                  " x " + std::to_string(r_.plan.accumulation);
  r_.warn(where + "; backing off to " + std::to_string(smaller) + " x " + std::to_string(r_.plan.accumulation) +
          " micro-batches, and the step is redone from its first");
  return first_example / smaller;
}

std::string Loop::model_label() const {
  const std::string file = r_.model_opts.has("torchscript") ? r_.model_opts.get_path("torchscript") : "";
  return "model '" + r_.model_name + "'" + (file.empty() ? "" : " (" + file + ")");
}

/// Why the window's loss is not finite, looked for only now that it is: the data of the window's
/// micro-batches, the parameters, the model's output; the learning rate when none of those.
std::string Loop::non_finite_loss() {
  const std::string what = "the loss is " + std::to_string(s_.window_loss) + " at step " +
                           std::to_string(s_.counters.step + 1) + "; nothing was stepped: ";
  torch::NoGradGuard no_grad;
  for (const auto& idx : window_indices_) {
    const Batch b = r_.fetch(*r_.data.train, idx);
    for (const auto* t : {&b.input, &b.target}) {
      if (!at::isFloatingType(t->scalar_type())) continue;
      const at::Tensor bad = t->isfinite().logical_not().reshape({t->size(0), -1}).any(1);
      if (bad.any().item<bool>())
        return what + "training example " + std::to_string(idx[bad.nonzero()[0][0]].item<int64_t>()) + " of data '" +
               r_.data_name + "' has a NaN or infinite " + (t == &b.input ? "input" : "target") +
               " (the data check before training reads the first million examples only)";
    }
  }
  for (const auto& p : r_.model->named_parameters())
    if (!p.value().isfinite().all().item<bool>())
      return what + "parameter " + p.key() + " is no longer finite: training diverged (lower the learning rate?)";
  for (const auto& idx : window_indices_) {
    const Batch b = r_.fetch(*r_.data.train, idx);
    if (r_.model->forward(b.input).isfinite().all().item<bool>()) continue;
    if (s_.counters.step == 0)
      return what + model_label() + " gives a non-finite output for finite inputs and its initial parameters";
    double largest = 0;
    for (const auto& p : r_.model->parameters()) largest = std::max(largest, p.abs().max().item<double>());
    return what + model_label() + " gives a non-finite output for finite inputs and parameters (the largest " +
           fmt_loss(largest) + "): training diverged (lower the learning rate?), or the model computes a NaN";
  }
  return what + "the model's outputs are finite, the loss '" + r_.loss_name +
         "' of them is not: training diverged (lower the learning rate?)";
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
      loss_sum += r_.plan.reduction == Reduction::Mean ? l * static_cast<double>(b.tokens) : l;
      items += b.tokens;
      if (classes) correct += (out.argmax(-1) == b.target).sum().item<int64_t>();
    }
    s_.validation_loss = items > 0 ? loss_sum / static_cast<double>(items) : 0.0;
    emit(Event::ValidationEnd);
  }
  r_.model->train();
  return {s_.validation_loss,
          items > 0 && classes ? static_cast<double>(correct) / static_cast<double>(items) : std::nan("")};
}

/// Runs validation, adds its values (and what plugins gave in on_validation_end) to the step's
/// record, and shows its line.
void Loop::record_validation(JsonLine& line) {
  s_.step.metrics.clear();  // the step's own are in its record already
  auto [vloss, acc] = validate();
  result_.validation_losses.push_back(vloss);
  line.add("validation_loss", vloss);
  std::string note = "validation  step " + std::to_string(s_.counters.step) + "  loss " + fmt_loss(vloss);
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
  for (const auto& [k, v] : s_.step.metrics) line.add(k, v);
  progress_->note(note);
  last_validation_step_ = s_.counters.step;
}

void Loop::add_rates(JsonLine& line) const {
  // From the window's first micro-batch to its step's end: what the step itself took (not the
  // validation, checkpoint or record around it). A window redone after a back-off counts anew.
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - window_t0_).count();
  if (s <= 0.0) return;
  line.add("examples_per_s", static_cast<double>(s_.totals.samples) / s);
  if (s_.totals.tokens != s_.totals.samples) line.add("tokens_per_s", static_cast<double>(s_.totals.tokens) / s);
  if (!flops_ || window_flops_ <= 0) return;
  line.add("model_gflop", window_flops_ / 1e9).add("gflops", window_flops_ / 1e9 / s);
  if (peak_gflops_ > 0) line.add("mfu", window_flops_ / 1e9 / s / peak_gflops_);
}

JsonLine Loop::step_record(int64_t epoch, bool skipped, double wall_time) {
  JsonLine line;
  line.add("step", s_.counters.step)
      .add("epoch", epoch)
      .add("loss", s_.window_loss)
      .add("lr", s_.lr)
      .add("micro_batches", s_.totals.micro_batches)
      .add("effective_batch", s_.totals.samples)
      .add("samples", s_.counters.samples_seen)
      .add("tokens", s_.counters.tokens_seen)
      .add("wall_time", wall_time)
      .add("peak_rss_mib", peak_rss_mib())
      .add("host_reads", s_.host_reads);
  if (const int64_t held = optimizer_state_bytes(*r_.optimizer); held >= 0)
    line.add("optimizer_state_mib", static_cast<double>(held) / (1024.0 * 1024.0));
  add_rates(line);
  if (skipped) line.add("skipped", s_.step.vetoed_by + ": " + s_.step.veto_reason);
  for (const auto& [k, v] : s_.step.metrics) line.add(k, v);
  constexpr double kMiB = 1024.0 * 1024.0;
  if (r_.plan.micro_batch_auto) line.add("micro_batch", r_.plan.micro_batch);
  if (meter_) line.add("step_peak_mib", meter_->take_peak() / kMiB);
  if (r_.plan.micro_batch_auto && r_.plan.memory_budget > 0) line.add("memory_budget_mib", r_.plan.memory_budget / kMiB);
  if (!backoff_note_.empty()) {
    line.add("backoff", backoff_note_);
    backoff_note_.clear();
  }
  return line;
}

void Loop::end_window(int64_t epoch, int64_t b) {
  const bool skipped = optimizer_step();
  result_.window_losses.push_back(s_.window_loss);
  result_.step_metrics.emplace_back(s_.step.metrics.begin(), s_.step.metrics.end());
  const double t = elapsed();
  JsonLine line = step_record(epoch, skipped, t);
  const Counters& c = s_.counters;
  done_ = c.step >= r_.total_steps;
  auto validate = [&] {
    phases_.mark();
    record_validation(line);
    phases_.add(kValidation);
    if (meter_) meter_->take_peak();  // validation's memory is not the next step's
  };
  if (r_.data.validation && ((validate_every_ > 0 && c.step % validate_every_ == 0) || done_)) validate();
  // Stop early at this boundary when asked to (a signal) or out of time; with a checkpoint.
  // Every rank stops at the same boundary: the world agrees on the strongest reason (a signal
  // over the time limit) any rank has.
  enum : int64_t { kGoOn = 0, kOutOfTime = 1, kSignalled = 2 };
  int64_t stop = kGoOn;
  if (!done_ && opts_.stop_requested && opts_.stop_requested()) stop = kSignalled;
  else if (!done_ && elapsed() >= r_.max_time_s) stop = kOutOfTime;
  if (!done_ && r_.plan.world_size > 1 && r_.plan.max_over_ranks) stop = r_.plan.max_over_ranks(stop);
  // A run out of time ends as a finished one does, with a validation of its last step (a signal
  // asks for a prompt stop: none then).
  if (stop == kOutOfTime) note_unfinished_schedule();  // the pace of training, before the last validation
  if (r_.data.validation && stop == kOutOfTime && last_validation_step_ != c.step) validate();
  if (stop == kSignalled) result_.status = FitStatus::StoppedBySignal;
  else if (stop == kOutOfTime) result_.status = FitStatus::StoppedByTime;
  if (result_.status != FitStatus::Running) done_ = true;
  phases_.record(line);
  // The step's record first: a checkpoint never holds a step whose record could be lost.
  outputs_->record(line);
  if (outputs_->writes() && (done_ || (checkpoint_every_ > 0 && c.step % checkpoint_every_ == 0))) {
    if (outputs_->active()) {
      result_.checkpoint = outputs_->checkpoint(r_, c, epoch, b);
    } else if (!r_.optimizer_wraps.empty()) {
      // A wrapped optimizer's save() may gather its state from every rank: each one takes part.
      torch::serialize::OutputArchive discarded;
      r_.optimizer->save(discarded);
    }
  }
  progress_->update(c.step, epoch, s_.window_loss, s_.lr, static_cast<double>(c.samples_seen) / std::max(t, 1e-9), t);
}

void Loop::open_window(int64_t epoch, int64_t b) {
  s_.totals = WindowTotals{};
  phases_.ms.fill(0.0);
  window_flops_ = 0;
  window_t0_ = std::chrono::steady_clock::now();
  window_indices_.clear();
  s_.host_reads = 0;
  in_window_ = true;
  if (back_off_ready()) opened_ = {b, s_.counters, save_rng()};
}

bool Loop::train_micro_batch(int64_t epoch, int64_t& b, const at::Tensor& order) {
  const int64_t m = r_.plan.micro_batch;
  auto indices = [&](int64_t i) { return order.slice(0, i * m, std::min(n_, (i + 1) * m)); };
  Batch batch;
  try {
    // A batch made ahead may be the one that ran out of memory: it backs off like the step.
    phases_.mark();
    batch = prefetch_->take({epoch, b, m}, indices(b));
    phases_.add(kData);
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
    micro_batch(batch);
  } catch (const c10::OutOfMemoryError& e) {
    s_.batch = nullptr;
    prefetch_->drain();  // its memory back before the window is redone
    if (!back_off_ready()) throw;
    b = back_off(opened_, message_of(e));  // the window again, from its first micro-batch
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
  if (first == 0) emit(Event::EpochStart);
  for (int64_t b = first; b < r_.batches_per_epoch && !done_;) {
    if (!in_window_) {
      auto w = r_.windows->start(epoch, b, s_.counters.step, s_.counters.samples_seen * r_.plan.world_size);
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
  emit(Event::EpochEnd);
}

void Loop::train_epochs(Start start) {
  for (const Slot* s : handlers_[static_cast<size_t>(Event::FitStart)]) not_started_.insert(s);
  zero_grads(r_);  // before fit_start: data parallel's buckets take the gradients as they are made
  emit(Event::FitStart);
  zero_grads(r_);
  done_ = s_.counters.step >= r_.total_steps;
  // On CUDA (where reading the caching allocator's peak costs nothing), or when asked: each step's
  // record says how much it took. On the CPU that counts every allocation under a lock, so a
  // micro-batch picked by memory counts only during its trials unless run.measure_memory asks.
  if (r_.device.is_cuda() || r_.run.get_bool("measure_memory")) meter_.emplace(r_);
  phases_.on = r_.run.get_bool("phase_times");
  peak_gflops_ = r_.run.get_float("peak_gflops");
  flops_ = flops_of(*r_.model);
  phases_.cuda = r_.device.is_cuda();
  prefetch_.emplace(r_, *r_.data.train);
  if (prefetch_->active()) spdlog::debug("prefetch: on ({})", prefetch_->reason());
  for (int64_t epoch = start.epoch; !done_ && (r_.bound.by_steps() || epoch < r_.bound.count); ++epoch)
    train_epoch(epoch, epoch == start.epoch ? start.batch : 0);
  prefetch_.reset();
  meter_.reset();
}

/// After the last step: the final validation when the last step had none, and fit_end.
void Loop::finish_training() {
  if (result_.status == FitStatus::Running) result_.status = FitStatus::Completed;
  if (r_.data.validation && result_.status == FitStatus::Completed && last_validation_step_ != s_.counters.step) {
    JsonLine line;
    line.add("step", s_.counters.step);
    record_validation(line);
    outputs_->record(line);
  }
  s_.status = result_.status;
  fit_end();
}

/// Every plugin's on_fit_end, each called even when one before it failed; the first failure is
/// then the run's.
void Loop::fit_end() {
  std::exception_ptr first;
  for (const Slot* s : handlers_[static_cast<size_t>(Event::FitEnd)]) {
    if (!s->plugin->handles(Event::FitEnd)) continue;
    s_.d.enter(s->name, hook_name(Event::FitEnd), Event::FitEnd);
    try {
      s->plugin->on_fit_end(ctx_);
    } catch (const std::exception& err) {
      if (!first)
        first = std::make_exception_ptr(PluginRuntimeError("plugin '" + s->name + "' failed in event fit_end at step " +
                                                           std::to_string(s_.counters.step) + ": " + message_of(err)));
    } catch (...) {
      if (!first)
        first = std::make_exception_ptr(PluginRuntimeError("plugin '" + s->name +
                                                           "' failed in event fit_end: an unknown exception"));
    }
    if (r_.tracing) trace_.push_back({s->name, Event::FitEnd, s_.counters.step, s_.counters.micro_step});
  }
  s_.d.leave();
  if (first) std::rethrow_exception(first);
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

/// After a failure every plugin whose on_fit_start ran (or that has none) gets fit_end (status
/// failed) once; its errors then are dropped.
void Loop::fit_end_after_failure() {
  if (s_.status != FitStatus::Running) return;  // fit_end itself failed: every plugin had it already
  s_.status = FitStatus::Failed;
  for (const Slot* s : handlers_[static_cast<size_t>(Event::FitEnd)]) {
    if (not_started_.count(s) || !s->plugin->handles(Event::FitEnd)) continue;
    try {
      s_.d.enter(s->name, hook_name(Event::FitEnd), Event::FitEnd);
      s->plugin->on_fit_end(ctx_);
    } catch (...) {
    }
  }
  s_.d.leave();
}

std::optional<Checkpoint> Loop::resume(RunOutputs& outputs) {
  std::optional<Checkpoint> resumed;
  // Model, optimizer and RNG come back now, plugin states before fit_start.
  if (opts_.resume) resumed = resume_from(r_, *opts_.resume, outputs.dir(), outputs.identity(), opts_.allow_changes);
  if (outputs.active()) result_.output_dir = s_.output_dir = outputs.dir();
  return resumed;
}

/// The final checkpoint: the run is complete. Nothing is trained, recorded or rewritten but what a
/// run killed right after its last checkpoint did not write (weights.pt, the plugins' files).
FitResult Loop::already_complete(RunOutputs& outputs, const Checkpoint& resumed) {
  outputs.complete_again(r_);
  FitResult result;
  result.already_complete = true;
  result.status = FitStatus::Completed;
  result.output_dir = result_.output_dir;
  result.checkpoint = resumed.dir;
  result.steps = resumed.position.counters.step;
  result.micro_steps = resumed.position.counters.micro_step;
  result.skipped_steps = resumed.position.counters.skipped_steps;
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
    spdlog::info("micro-batch {} as in the checkpoint (this run measured {})", saved_m, r_.plan.micro_batch);
    rebatch(r_, saved_m);
  }
  s_.counters = resumed->position.counters;
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
  result_.seconds = elapsed();
  result_.peak_rss_mib = peak_rss_mib();
  result_.files = outputs_->written();
  return result_;
}

FitResult Loop::fit(const Recipe& recipe) {
  RunOutputs outputs(r_, recipe, opts_);
  outputs_ = &outputs;
  outputs.claim();  // the folder is this run's until it ends
  const std::optional<Checkpoint> resumed = resume(outputs);
  if (resumed && resumed->position.counters.step >= r_.total_steps) return already_complete(outputs, *resumed);
  outputs.open(resumed);
  const Start start = start_from(resumed);
  progress_.emplace(r_.plan.rank == 0 ? opts_.progress : ProgressMode::None, r_.total_steps,
                    r_.run.get_int("log_every"));
  checkpoint_every_ = r_.run.get_int("checkpoint_every");
  validate_every_ = r_.run.get_int("validate_every");
  t0_ = std::chrono::steady_clock::now();
  first_step_ = s_.counters.step;
  outputs.status("running", s_.counters.step);
  try {
    train_epochs(start);
    finish_training();
  } catch (...) {
    if (opts_.on_failure) opts_.on_failure();
    prefetch_.reset();  // no data is read while plugins clean up
    meter_.reset();
    progress_->finish();
    fit_end_after_failure();
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
