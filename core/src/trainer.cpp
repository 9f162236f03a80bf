#include "tk/trainer.h"

#include "tk/checkpoint.h"
#include "tk/tensor_io.h"

#include <ATen/Parallel.h>
#include <torch/cuda.h>
#include <sys/resource.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <fstream>
#include <optional>
#include <sstream>

namespace fs = std::filesystem;

namespace tk {

void Context::veto_step(const std::string& reason, bool advance_schedule) {
  if (veto_reason.empty()) {
    veto_reason = reason.empty() ? std::string("(no reason given)") : reason;
    vetoed_by = current_plugin;
    veto_advances_schedule = advance_schedule;
  }
}
void Context::info(const std::string& msg) const {
  if (log_sink) log_sink(0, msg);
}
void Context::warn(const std::string& msg) const {
  if (log_sink) log_sink(1, msg);
}

namespace {

const std::vector<std::string> kSections = {"run", "model", "data", "loss", "optimizer", "schedule", "plugins"};

OptionSpecs run_specs() {
  return {opt_string("name", "run", "name of the run"),
          opt_int("seed", 0, "seed of initialization, data order and synthetic data"),
          opt_int("epochs", 0, "epochs to train (give epochs or steps)"),
          opt_int("steps", 0, "optimizer steps to train (give epochs or steps)"),
          opt_string("output", "", "output folder (default runs/<name>)"),
          opt_string("dtype", "float32", "parameter and data type", {"float32", "float64"}),
          opt_string("device", "auto", "where to train (auto: CUDA when available)", {"auto", "cpu", "cuda"}),
          opt_int("log_every", 10, "optimizer steps between plain progress lines"),
          opt_int("validate_every", 0, "optimizer steps between validations (0: only at the end)"),
          opt_int("threads", 0, "intra-op CPU threads (0: LibTorch's default)"),
          opt_bool("trace", false, "record every plugin dispatch in trace.jsonl"),
          opt_int("checkpoint_every", 0, "optimizer steps between checkpoints (0: only at the end)"),
          opt_int("checkpoint_keep", 3, "newest checkpoints to keep"),
          opt_string("max_time", "", "stop at the first boundary after this long, e.g. \"90s\", \"10m\", \"2h\" (\"\": no limit)")};
}

OptionSpecs loader_specs() {
  return {opt_int("micro_batch", 32, "examples per micro-batch"),
          opt_bool("shuffle", true, "shuffle every epoch (a pure function of seed and epoch)"),
          opt_bool("drop_last", false, "drop an epoch's last, smaller micro-batch")};
}

template <class Fn>
const Component<Fn>& pick(const Recipe& r, const char* section, const char* fallback,
                          const std::vector<Component<Fn>>& list) {
  return *find_component(list, r.component(section, fallback, component_names(list)));
}

/// A loss or perplexity for people: 4 significant digits.
std::string fmt_loss(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

/// Peak resident memory of this process so far, in MiB.
double peak_rss_mib() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / 1024.0;
}

/// "90s", "10m", "1.5h", "250ms" -> seconds; "" -> infinity.
double parse_duration(const Options& o, const std::string& key) {
  const std::string& v = o.get_string(key);
  if (v.empty()) return std::numeric_limits<double>::infinity();
  size_t pos = 0;
  double x = 0;
  try {
    x = std::stod(v, &pos);
  } catch (const std::exception&) {
    o.fail(key, "expected a duration like \"90s\", \"10m\" or \"2h\", got \"" + v + "\"");
  }
  const std::string unit = v.substr(pos);
  const double scale = unit == "ms" ? 1e-3 : unit == "s" ? 1 : unit == "m" ? 60 : unit == "h" ? 3600 : -1;
  if (scale < 0 || x < 0)
    o.fail(key, "expected a duration like \"90s\", \"10m\" or \"2h\" (units ms, s, m, h), got \"" + v + "\"");
  return x * scale;
}

struct Slot {
  std::shared_ptr<Plugin> plugin;
  std::string name, version, file;
  Options options;
  EventSet events;
};

class Sink : public MetricsSink {
 public:
  void put(const std::string& name, double v) override {
    for (auto& [k, old] : values)
      if (k == name) {
        old = v;
        return;
      }
    values.emplace_back(name, v);
  }
  std::vector<std::pair<std::string, double>> values;
};

}  // namespace

struct Trainer::Impl {
  const Recipe& recipe;
  TrainerOptions topts;
  Options run, data_opts, model_opts, loss_opts, opt_opts, sched_opts;
  std::string model_name, data_name, loss_name, opt_name, sched_name;
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  double max_time_s = 0;
  bool tracing = false;  // run.trace, read once: emit() is on the per-micro-batch path
  DataSplits data;
  ModelPtr model;
  std::unique_ptr<LossFn> loss;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::unique_ptr<LrSchedule> schedule;
  double base_lr = 0.0;
  std::vector<Slot> slots;
  std::vector<size_t> order;
  RunPlan plan;
  bool prepared = false;
  int64_t batches_per_epoch = 0, total_steps = 0;
  std::unique_ptr<WindowSchedule> windows;
  std::vector<TraceEntry> trace;
  std::vector<std::string> warnings;
  bool fitted = false;

  Impl(const Recipe& r, TrainerOptions o) : recipe(r), topts(std::move(o)) {}

  void warn(const std::string& msg) {
    warnings.push_back(msg);
    spdlog::warn("{}", msg);
  }

  void build();
  void prepare();
  void emit(Event e, Context& ctx);
  Batch fetch(const Dataset& ds, const torch::Tensor& idx) const;
  /// Examples this rank sees per epoch: all of them alone; with several ranks, an equal share
  /// (the remainder of the division, under world_size examples, is left out of that epoch).
  int64_t shard_size() const { return data.train->size() / plan.world_size; }
  /// This rank's examples of `epoch`, in order: the same seeded shuffle on every rank, strided by rank.
  torch::Tensor shard_order(int64_t epoch) const {
    const torch::Tensor all = epoch_order(data.train->size(), static_cast<uint64_t>(run.get_int("seed")), epoch,
                                          data_opts.get_bool("shuffle"));
    if (plan.world_size == 1) return all;
    return all.slice(0, plan.rank, shard_size() * plan.world_size, plan.world_size);
  }
  std::pair<double, double> validate(Context& ctx);
  void save_weights(const fs::path& file) const;

  // The parts of fit().
  /// Hands each plugin its saved state (before fit_start); warns about states nobody loads.
  void restore_plugins(Checkpoint& resumed);
  /// Creates the output folder, writes the resolved recipe and opens metrics.jsonl (cut back to
  /// the checkpoint's step when resuming).
  void open_outputs(const fs::path& outdir, const std::optional<Checkpoint>& resumed, std::ofstream& metrics);
  /// Forward, loss and backward of one micro-batch, with their events and the window's totals.
  void micro_batch(Context& ctx, Batch& batch);
  /// Completes a window: LR, boundary, the optimizer step unless vetoed, step_end. True when skipped.
  bool optimizer_step(Context& ctx, Sink& sink);
  /// The metrics record of the step just taken.
  JsonLine step_record(const Context& ctx, int64_t epoch, bool skipped, const Sink& sink, double wall_time) const;
  /// After a failure every plugin still gets fit_end to clean up (leave autocast, close files);
  /// errors it raises then are dropped: the first error stands.
  void fit_end_after_failure(Context& ctx);
  /// Runs validation and adds its values to the step's record; returns the progress line.
  std::string validation_record(Context& ctx, JsonLine& line, FitResult& result);
  /// Checkpoints the run after micro-batch `b` of `epoch` into `dir`; returns the checkpoint.
  fs::path checkpoint(const Context& ctx, int64_t epoch, int64_t b, const fs::path& dir) const;
  void write_trace(const fs::path& file) const;
};

void Trainer::Impl::build() {
  recipe.check_sections(kSections);
  run = recipe.options("run", run_specs());
  if (run.get_int("epochs") < 0) run.fail("epochs", "must be >= 0");
  if (run.get_int("steps") < 0) run.fail("steps", "must be >= 0");
  if (run.get_int("epochs") > 0 && run.get_int("steps") > 0)
    run.fail("steps", "give either epochs or steps, not both");
  if (run.get_int("log_every") < 1) run.fail("log_every", "must be >= 1");
  if (run.get_int("validate_every") < 0) run.fail("validate_every", "must be >= 0");
  if (run.get_int("checkpoint_every") < 0) run.fail("checkpoint_every", "must be >= 0");
  if (run.get_int("checkpoint_keep") < 1) run.fail("checkpoint_keep", "must be >= 1");
  max_time_s = parse_duration(run, "max_time");
  tracing = run.get_bool("trace");
  if (run.get_int("threads") > 0) at::set_num_threads(static_cast<int>(run.get_int("threads")));
  dtype = run.get_string("dtype") == "float64" ? at::kDouble : at::kFloat;
  const std::string& dev = run.get_string("device");
  const bool cuda = torch::cuda::is_available();
  if (dev == "cuda" && !cuda)
    run.fail("device", "CUDA is not available (this LibTorch has no CUDA, or no GPU is visible)");
  device = (dev == "cuda" || (dev == "auto" && cuda)) ? at::Device(at::kCUDA) : at::Device(at::kCPU);
  const uint64_t seed = static_cast<uint64_t>(run.get_int("seed"));

  const auto& dc = pick(recipe, "data", "", datasets());
  OptionSpecs dspecs = loader_specs();
  dspecs.insert(dspecs.end(), dc.specs.begin(), dc.specs.end());
  data_name = dc.name;
  data_opts = recipe.options("data", dspecs, true);
  if (data_opts.get_int("micro_batch") < 1) data_opts.fail("micro_batch", "must be >= 1");
  data = dc.make(data_opts, seed);

  // `[model] torchscript = "file.pt"` needs no name.
  const auto& mc = pick(recipe, "model", recipe.sets("model", "torchscript") ? "torchscript" : "", models());
  model_name = mc.name;
  model_opts = recipe.options("model", mc.specs, true);
  torch::manual_seed(seed);
  model = mc.make(model_opts, data.info);
  model->to(device, dtype);
  model->train();

  const auto& lc = pick(recipe, "loss", data.info.classification ? "cross_entropy" : "mse", losses());
  loss_name = lc.name;
  loss_opts = recipe.options("loss", lc.specs, true);
  loss = lc.make(loss_opts);
  if (data.info.ignore_index && loss_opts.has("ignore_index") &&
      loss_opts.get_int("ignore_index") != *data.info.ignore_index)
    loss_opts.fail("ignore_index", "is " + std::to_string(loss_opts.get_int("ignore_index")) +
                                       ", but the data marks padding with " + std::to_string(*data.info.ignore_index) +
                                       " (data.ignore_index): padding would count toward the loss");
  if (data.info.classification != (loss_name == "cross_entropy"))
    throw RecipeError(loss_opts.section_loc(), "loss '" + loss_name + "' does not fit data '" + data_name + "' (" +
                                              (data.info.classification ? "class labels" : "real-valued targets") +
                                              "); use " + (data.info.classification ? "cross_entropy" : "mse"));

  const auto& oc = pick(recipe, "optimizer", "", optimizers());
  opt_name = oc.name;
  opt_opts = recipe.options("optimizer", oc.specs, true);
  optimizer = oc.make(opt_opts, model->parameters());
  base_lr = opt_opts.get_float("lr");

  const auto& sc = pick(recipe, "schedule", "constant", schedules());
  sched_name = sc.name;
  sched_opts = recipe.options("schedule", sc.specs, true);
  schedule = sc.make(sched_opts, base_lr);

  PluginLoader loader(topts.plugin_dirs ? *topts.plugin_dirs : PluginLoader::default_dirs(recipe.dir()));
  auto entries = recipe.plugins();
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto& e = entries[i];
    LoadedPlugin lp;
    try {
      lp = e.path.empty() ? loader.load_by_name(e.name) : loader.load(e.path);
    } catch (const PluginLoadError& err) {
      throw PluginLoadError(e.where.str() + ": " + err.what());
    }
    if (!e.name.empty() && lp.name != e.name)
      throw PluginLoadError(e.where.str() + ": " + lp.file.string() + " is plugin '" + lp.name +
                            "', but the recipe asks for '" + e.name + "'");
    Options o = recipe.plugin_options(i, lp.plugin->option_specs());
    Slot s{lp.plugin, lp.name, lp.version, lp.file.string(), o, {}};
    try {
      s.plugin->init(o);
      s.events = s.plugin->events();
    } catch (const RecipeError&) {
      throw;
    } catch (const std::exception& err) {
      throw PluginLoadError(e.where.str() + ": plugin '" + lp.name + "' (" + s.file + ") rejected its options: " + err.what());
    }
    slots.push_back(std::move(s));
  }
}

void Trainer::Impl::prepare() {
  if (prepared) return;
  plan = RunPlan{};
  plan.micro_batch = data_opts.get_int("micro_batch");
  plan.loss_reduction = to_string(loss->reduction());
  plan.device = device.type();
  for (auto& s : slots)
    for (const auto& cap : s.plugin->contract().provides) plan.capabilities.insert(cap);
  std::vector<PluginDecl> decls;
  for (auto& s : slots) {
    try {
      s.plugin->configure(plan);
      decls.push_back({s.name, s.plugin->contract()});
    } catch (const RecipeError&) {
      throw;
    } catch (const std::exception& err) {
      throw Error("plugin '" + s.name + "' (" + s.file + "): " + err.what());
    }
  }
  order = order_plugins(decls);

  const int64_t n = shard_size(), m = plan.micro_batch;
  batches_per_epoch = data_opts.get_bool("drop_last") ? n / m : (n + m - 1) / m;
  if (batches_per_epoch < 1)
    data_opts.fail("micro_batch", "is larger than the " + std::string(plan.world_size > 1 ? "rank's share of the " : "") +
                                      "data set (" + std::to_string(n) + " examples) and drop_last is on: an epoch "
                                      "has no micro-batch");
  const int64_t epochs = run.get_int("epochs"), steps = run.get_int("steps");
  windows = std::make_unique<WindowSchedule>(batches_per_epoch, plan.accumulation, plan.last_window,
                                             steps > 0 ? 0 : std::max<int64_t>(1, epochs));
  total_steps = steps > 0 ? steps : windows->steps_in(std::max<int64_t>(1, epochs));
  if (total_steps < 1) throw Error("the run would take no optimizer step");
  if (plan.accumulation > 1 && has_batchnorm(*model))
    warn("the model has BatchNorm and accumulates " + std::to_string(plan.accumulation) +
         " micro-batches per step: its statistics are computed per micro-batch of " + std::to_string(m) +
         " examples, not per window of " + std::to_string(m * plan.accumulation));
  prepared = true;
}

void Trainer::Impl::emit(Event e, Context& ctx) {
  for (size_t i : order) {
    Slot& s = slots[i];
    if (!s.events.contains(e)) continue;
    ctx.current_plugin = s.name;
    if (tracing) trace.push_back({s.name, e, ctx.counters.step, ctx.counters.micro_step});
    auto failure = [&](const std::string& what) {
      return PluginRuntimeError("plugin '" + s.name + "' failed in event " + to_string(e) + " at step " +
                                std::to_string(ctx.counters.step) + " (micro-batch " +
                                std::to_string(ctx.counters.micro_step) + "): " + what);
    };
    try {
      s.plugin->on_event(e, ctx);
    } catch (const c10::Error& err) {  // LibTorch's own errors: without the C++ stack trace
      throw failure(err.what_without_backtrace());
    } catch (const std::exception& err) {
      throw failure(err.what());
    } catch (...) {
      throw failure("an unknown exception");
    }
  }
  ctx.current_plugin.clear();
}

Batch Trainer::Impl::fetch(const Dataset& ds, const torch::Tensor& idx) const {
  Batch b = ds.get(idx);
  auto place = [&](const torch::Tensor& t) {
    return at::isFloatingType(t.scalar_type()) ? t.to(device, dtype) : t.to(device);
  };
  b.input = place(b.input);
  b.target = place(b.target);
  return b;
}

/// Loss (item-weighted) and accuracy over the validation split.
std::pair<double, double> Trainer::Impl::validate(Context& ctx) {
  emit(Event::ValidationStart, ctx);
  model->eval();
  double loss_sum = 0.0;
  int64_t items = 0, correct = 0;
  {
    torch::NoGradGuard no_grad;
    const int64_t n = data.validation->size(), m = plan.micro_batch;
    for (int64_t start = 0; start < n; start += m) {
      Batch b = fetch(*data.validation, at::arange(start, std::min(n, start + m), at::kLong));
      auto out = model->forward(b.input);
      double l = (*loss)(out, b).item<double>();
      loss_sum += loss->reduction() == Reduction::Mean ? l * static_cast<double>(b.tokens) : l;
      items += b.tokens;
      if (data.info.classification) correct += (out.argmax(-1) == b.target).sum().item<int64_t>();
    }
  }
  model->train();
  const double vloss = items > 0 ? loss_sum / static_cast<double>(items) : 0.0;
  ctx.validation_loss = vloss;
  emit(Event::ValidationEnd, ctx);
  return {vloss, items > 0 && data.info.classification ? static_cast<double>(correct) / static_cast<double>(items)
                                                       : std::nan("")};
}

void Trainer::Impl::save_weights(const fs::path& file) const {
  NamedTensors tensors;
  for (const auto& p : model->named_parameters()) tensors.emplace_back(p.key(), p.value());
  for (const auto& b : model->named_buffers()) tensors.emplace_back(b.key(), b.value());
  save_tensor_dict(file, tensors);
}

Trainer::Trainer(const Recipe& recipe, TrainerOptions opts) : impl_(std::make_unique<Impl>(recipe, std::move(opts))) {
  impl_->build();
}
Trainer::~Trainer() = default;

void Trainer::add_plugin(std::shared_ptr<Plugin> plugin, const Options& opts) {
  if (impl_->prepared) throw Error("add_plugin() must come before fit() or describe()");
  if (plugin->name().empty()) throw Error("a plugin added in code needs a name (Plugin::set_name)");
  plugin->init(opts);
  Slot s{plugin, plugin->name(), "(in-process)", "(in-process)", opts, plugin->events()};
  impl_->slots.push_back(std::move(s));
}

Model& Trainer::model() { return *impl_->model; }
torch::optim::Optimizer& Trainer::optimizer() { return *impl_->optimizer; }
const RunPlan& Trainer::plan() {
  impl_->prepare();
  return impl_->plan;
}
const DataSplits& Trainer::data() const { return impl_->data; }
const std::vector<TraceEntry>& Trainer::trace() const { return impl_->trace; }
const std::vector<std::string>& Trainer::warnings() const { return impl_->warnings; }
std::vector<std::string> Trainer::plugin_order() {
  impl_->prepare();
  std::vector<std::string> out;
  for (size_t i : impl_->order) out.push_back(impl_->slots[i].name);
  return out;
}

std::string Trainer::describe() {
  Impl& d = *impl_;
  d.prepare();
  std::ostringstream out;
  int64_t params = 0;
  for (const auto& p : d.model->parameters()) params += p.numel();
  const auto& p = d.plan;
  const int64_t epochs = d.run.get_int("epochs"), steps = d.run.get_int("steps");
  out << "recipe        " << d.recipe.source() << "\n"
      << "model         " << d.model_name << " (" << params << " parameters, " << d.run.get_string("dtype") << ", on "
      << d.device.str() << ")\n"
      << "data          " << d.data_name << ": " << d.data.train->size() << " training examples";
  if (d.data.validation) out << ", " << d.data.validation->size() << " validation";
  out << "; " << d.data.info.describe();
  if (!d.data.info.baseline_name.empty())
    out << "; " << d.data.info.baseline_name << " baseline loss " << fmt_loss(d.data.info.baseline_loss);
  out << "\n"
      << "loss          " << d.loss_name << " (reduction " << p.loss_reduction << ")\n"
      << "optimizer     " << d.opt_name << " (lr " << to_toml(d.base_lr) << ")\n"
      << "schedule      " << d.sched_name << ", advanced once per optimizer step\n"
      << "micro-batch   " << p.micro_batch << " examples per rank, " << d.batches_per_epoch << " per epoch"
      << (p.world_size > 1 ? " (each rank reads " + std::to_string(d.shard_size()) + " examples per epoch)" : "")
      << "\n"
      << "accumulation  " << p.accumulation << " micro-batches per step (last window: " << to_string(p.last_window)
      << (p.window_owner.empty() ? "" : ", set by " + p.window_owner) << ")\n"
      << "world size    " << p.world_size << (p.world_owner.empty() ? "" : " (set by " + p.world_owner + ")") << "\n"
      << "effective     " << p.effective_batch() << " examples per optimizer step (" << p.micro_batch << " x "
      << p.accumulation << " x " << p.world_size << ")"
      << (p.world_size > 1 ? "; " + std::to_string(p.micro_batch * p.accumulation) + " per rank" : "") << "\n"
      << "steps         " << d.total_steps << " optimizer steps"
      << (steps > 0 ? "" : " (" + std::to_string(std::max<int64_t>(1, epochs)) + " epochs)") << "\n"
      << "plugins       " << (d.slots.empty() ? "(none)" : "in dispatch order:") << "\n";
  int i = 1;
  for (size_t idx : d.order) {
    const Slot& s = d.slots[idx];
    out << "  " << i++ << ". " << s.name << " " << s.version << "  " << s.file << "\n";
    for (const auto& [k, v] : s.options.values()) out << "       " << k << " = " << to_toml(v) << "\n";
  }
  for (const auto& w : d.warnings) out << "warning       " << w << "\n";
  return out.str();
}

void Trainer::Impl::restore_plugins(Checkpoint& resumed) {
  for (auto& slot : slots) {
    auto it = resumed.plugin_states.find(slot.name);
    if (it == resumed.plugin_states.end()) {
      warn("plugin '" + slot.name + "' has no state in " + resumed.dir.string() + "; it starts fresh");
      continue;
    }
    slot.plugin->load_state(it->second);
    resumed.plugin_states.erase(it);
  }
  for (const auto& [name, st] : resumed.plugin_states)
    warn("the checkpoint holds state of plugin '" + name + "', which this run does not load; ignored");
}

void Trainer::Impl::open_outputs(const fs::path& outdir, const std::optional<Checkpoint>& resumed,
                                 std::ofstream& metrics) {
  std::error_code ec;
  fs::create_directories(outdir, ec);
  if (ec) throw Error("cannot create output folder '" + outdir.string() + "': " + ec.message());
  write_atomic(outdir / "recipe.toml", recipe.resolved());
  const fs::path file = outdir / "metrics.jsonl";
  if (resumed) {  // keep the records up to the checkpoint, drop any written after it
    std::ifstream in(file);
    std::string kept;
    for (std::string line; std::getline(in, line);) {
      const auto pos = line.find("\"step\": ");
      if (pos != std::string::npos && std::stoll(line.substr(pos + 8)) <= resumed->position.counters.step)
        kept += line + "\n";
    }
    write_atomic(file, kept);
    metrics.open(file, std::ios::app);
  } else {
    metrics.open(file, std::ios::trunc);
  }
  if (!metrics) throw Error("cannot write '" + file.string() + "'");
}

void Trainer::Impl::micro_batch(Context& ctx, Batch& batch) {
  emit(Event::MicroBatch, ctx);
  torch::Tensor out = model->forward(batch.input);
  ctx.loss = (*loss)(out, batch);
  ctx.loss_value = ctx.loss.item<double>();
  emit(Event::Loss, ctx);
  ctx.loss.backward();
  ctx.loss = torch::Tensor();
  ++ctx.counters.micro_step;
  ctx.counters.samples_seen += batch.samples;
  ctx.counters.tokens_seen += batch.tokens;
  ctx.totals.micro_batches += 1;
  ctx.totals.samples += batch.samples;
  ctx.totals.tokens += batch.tokens;
  ctx.totals.loss_sum +=
      loss->reduction() == Reduction::Mean ? ctx.loss_value * static_cast<double>(batch.tokens) : ctx.loss_value;
  emit(Event::Backward, ctx);
}

bool Trainer::Impl::optimizer_step(Context& ctx, Sink& sink) {
  ctx.lr = schedule->lr(ctx.counters.schedule_step, total_steps);
  set_lr(*optimizer, ctx.lr);
  ctx.veto_reason.clear();
  ctx.vetoed_by.clear();
  ctx.veto_advances_schedule = false;
  sink.values.clear();
  emit(Event::Boundary, ctx);
  // After the boundary: a sync plugin may have replaced the totals with sums over all ranks.
  ctx.window_loss = ctx.totals.tokens > 0 ? ctx.totals.loss_sum / static_cast<double>(ctx.totals.tokens) : 0.0;
  const bool skipped = ctx.step_vetoed();
  if (!skipped && !std::isfinite(ctx.window_loss))
    throw Error("the loss is " + std::to_string(ctx.window_loss) + " at step " + std::to_string(ctx.counters.step + 1) +
                ": training diverged; nothing was stepped (lower the learning rate?)");
  if (!skipped) optimizer->step();
  else ++ctx.counters.skipped_steps;
  optimizer->zero_grad();
  ++ctx.counters.step;
  if (!skipped || ctx.veto_advances_schedule) ++ctx.counters.schedule_step;
  emit(Event::StepEnd, ctx);
  return skipped;
}

JsonLine Trainer::Impl::step_record(const Context& ctx, int64_t epoch, bool skipped, const Sink& sink,
                                    double wall_time) const {
  JsonLine line;
  line.add("step", ctx.counters.step)
      .add("epoch", epoch)
      .add("loss", ctx.window_loss)
      .add("lr", ctx.lr)
      .add("micro_batches", ctx.totals.micro_batches)
      .add("samples", ctx.counters.samples_seen)
      .add("tokens", ctx.counters.tokens_seen)
      .add("wall_time", wall_time)
      .add("peak_rss_mib", peak_rss_mib());
  if (skipped) line.add("skipped", ctx.vetoed_by + ": " + ctx.veto_reason);
  for (const auto& [k, v] : sink.values) line.add(k, v);
  return line;
}

void Trainer::Impl::fit_end_after_failure(Context& ctx) {
  for (size_t i : order) {
    if (!slots[i].events.contains(Event::FitEnd)) continue;
    try {
      ctx.current_plugin = slots[i].name;
      slots[i].plugin->on_event(Event::FitEnd, ctx);
    } catch (...) {
    }
  }
}

std::string Trainer::Impl::validation_record(Context& ctx, JsonLine& line, FitResult& result) {
  auto [vloss, acc] = validate(ctx);
  result.validation_losses.push_back(vloss);
  line.add("validation_loss", vloss);
  std::string note = "validation  step " + std::to_string(ctx.counters.step) + "  loss " + fmt_loss(vloss);
  if (!std::isnan(acc)) line.add("validation_accuracy", acc);
  if (data.info.next_token) {
    const double ppl = std::exp(vloss);
    line.add("validation_perplexity", ppl);
    note += "  perplexity " + fmt_loss(ppl);
    if (!data.info.baseline_name.empty())
      note += "  (" + data.info.baseline_name + " baseline loss " + fmt_loss(data.info.baseline_loss) + ")";
  } else if (!std::isnan(acc)) {
    note += "  accuracy " + std::to_string(acc * 100.0).substr(0, 5) + "%";
  }
  return note;
}

fs::path Trainer::Impl::checkpoint(const Context& ctx, int64_t epoch, int64_t b, const fs::path& dir) const {
  TrainingPosition pos{ctx.counters, epoch, b + 1};
  if (pos.next_batch >= batches_per_epoch || !windows->at(epoch, pos.next_batch)) {
    pos.next_epoch = epoch + 1;
    pos.next_batch = 0;
  }
  std::vector<std::pair<std::string, StateDict>> states;
  for (const auto& slot : slots) states.emplace_back(slot.name, slot.plugin->state());
  return save_checkpoint(dir, *model, *optimizer, states, pos, run.get_int("checkpoint_keep"));
}

void Trainer::Impl::write_trace(const fs::path& file) const {
  std::string text;
  for (const auto& e : trace)
    text += JsonLine().add("plugin", e.plugin).add("event", std::string(to_string(e.event)))
                .add("step", e.step).add("micro_step", e.micro_step).str() + "\n";
  write_atomic(file, text);
}

FitResult Trainer::fit() {
  Impl& d = *impl_;
  if (d.fitted) throw Error("fit() can run once per Trainer");
  d.fitted = true;
  d.prepare();
  FitResult result;

  fs::path outdir;
  std::ofstream metrics_file;
  {
    std::string o = d.run.get_string("output");
    outdir = o.empty() ? fs::path("runs") / d.run.get_string("name") : fs::path(o);
  }
  // Resuming: model, optimizer and RNG come back now, plugin states before fit_start.
  std::optional<Checkpoint> resumed;
  if (d.topts.resume) {
    resumed = load_checkpoint(resolve_checkpoint(*d.topts.resume, outdir), *d.model, *d.optimizer);
    d.restore_plugins(*resumed);
    if (resumed->position.counters.total_steps != d.total_steps)
      throw Error(resumed->dir.string() + ": the checkpoint is of a run of " +
                  std::to_string(resumed->position.counters.total_steps) + " steps, this one has " +
                  std::to_string(d.total_steps) + ": resume with the recipe it was made with");
  }
  if (d.topts.write_outputs && d.plan.rank == 0) {  // one rank writes for the world
    d.open_outputs(outdir, resumed, metrics_file);
    result.output_dir = outdir;
  }
  const bool writes_outputs = metrics_file.is_open();  // this process writes the outputs

  Sink sink;
  Context ctx(*d.model, *d.optimizer, d.plan, sink, d.loss->reduction());
  ctx.counters.total_steps = d.total_steps;
  int64_t start_epoch = 0, start_batch = 0;
  if (resumed) {
    ctx.counters = resumed->position.counters;
    start_epoch = resumed->position.next_epoch;
    start_batch = resumed->position.next_batch;
    spdlog::info("resuming from {} at step {} (epoch {}, micro-batch {})", resumed->dir.string(), ctx.counters.step,
                 start_epoch + 1, start_batch);
  }
  const int64_t checkpoint_every = d.run.get_int("checkpoint_every");
  ctx.log_sink = [&d, &ctx](int level, const std::string& msg) {
    std::string line = ctx.current_plugin.empty() ? msg : ctx.current_plugin + ": " + msg;
    if (level > 0) d.warn(line);
    else spdlog::info("{}", line);
  };
  Progress progress(d.plan.rank == 0 ? d.topts.progress : ProgressMode::None, d.total_steps,
                    d.run.get_int("log_every"));

  const int64_t n = d.shard_size(), m = d.plan.micro_batch;
  const int64_t steps_target = d.total_steps;
  const int64_t epochs = d.run.get_int("steps") > 0 ? -1 : std::max<int64_t>(1, d.run.get_int("epochs"));
  const int64_t validate_every = d.run.get_int("validate_every");
  auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  double last_validation_step = -1;

  auto record_validation = [&](JsonLine& line) {
    progress.note(d.validation_record(ctx, line, result));
    last_validation_step = static_cast<double>(ctx.counters.step);
  };

  try {
    d.emit(Event::FitStart, ctx);
    d.optimizer->zero_grad();
    bool done = false;
    done = ctx.counters.step >= steps_target;
    for (int64_t epoch = start_epoch; !done && (epochs < 0 || epoch < epochs); ++epoch) {
      const torch::Tensor order = d.shard_order(epoch);
      ctx.counters.epoch = epoch;
      const int64_t first = epoch == start_epoch ? start_batch : 0;
      if (first == 0) d.emit(Event::EpochStart, ctx);
      for (int64_t b = first; b < d.batches_per_epoch && !done; ++b) {
        auto w = d.windows->at(epoch, b);
        if (!w) break;  // the policy drops the rest of this epoch
        Batch batch = d.fetch(*d.data.train, order.slice(0, b * m, std::min(n, (b + 1) * m)));
        ctx.window = *w;
        ctx.batch = &batch;
        ctx.counters.batch_in_epoch = b;
        if (w->is_first()) ctx.totals = WindowTotals{};
        d.micro_batch(ctx, batch);
        ctx.batch = nullptr;
        if (!w->is_last()) continue;

        // The window is complete: one optimizer step.
        const bool skipped = d.optimizer_step(ctx, sink);
        result.window_losses.push_back(ctx.window_loss);

        const double t = elapsed();
        JsonLine line = d.step_record(ctx, epoch, skipped, sink, t);
        if (ctx.counters.step >= steps_target) done = true;
        if (d.data.validation && ((validate_every > 0 && ctx.counters.step % validate_every == 0) ||
                                  (done && validate_every >= 0)))
          record_validation(line);
        // Stop early at this boundary when asked to (a signal) or out of time; with a checkpoint.
        if (!done && d.topts.stop_requested && d.topts.stop_requested()) result.stopped = "signal";
        if (!done && elapsed() >= d.max_time_s) result.stopped = "max_time";
        if (!result.stopped.empty()) done = true;
        if (writes_outputs && (done || (checkpoint_every > 0 && ctx.counters.step % checkpoint_every == 0)))
          result.checkpoint = d.checkpoint(ctx, epoch, b, outdir / "checkpoints");
        if (metrics_file.is_open()) metrics_file << line.str() << std::endl;
        progress.update(ctx.counters.step, epoch, ctx.window_loss, ctx.lr,
                        static_cast<double>(ctx.counters.samples_seen) / std::max(t, 1e-9), t);
      }
      d.emit(Event::EpochEnd, ctx);
    }
    if (d.data.validation && result.stopped.empty() && last_validation_step != static_cast<double>(ctx.counters.step)) {
      JsonLine line;
      line.add("step", ctx.counters.step);
      record_validation(line);
      if (metrics_file.is_open()) metrics_file << line.str() << std::endl;
    }
    d.emit(Event::FitEnd, ctx);
  } catch (...) {
    if (d.topts.on_failure) d.topts.on_failure();
    progress.finish();
    if (metrics_file.is_open()) metrics_file.flush();
    d.fit_end_after_failure(ctx);
    throw;
  }
  progress.finish();
  if (writes_outputs) d.save_weights(outdir / "weights.pt");
  if (writes_outputs && d.tracing) d.write_trace(outdir / "trace.jsonl");
  result.steps = ctx.counters.step;
  result.micro_steps = ctx.counters.micro_step;
  result.skipped_steps = ctx.counters.skipped_steps;
  result.seconds = elapsed();
  result.peak_rss_mib = peak_rss_mib();
  return result;
}

}  // namespace tk
