// The components of a run: [run] read into its settings, then the data set, model, loss,
// optimizer and schedule the recipe's sections name, each made by its registered maker.
#include <spdlog/spdlog.h>
#include <torch/cuda.h>

#include <fnmatch.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <map>
#include <regex>
#include <set>
#include <thread>

#include "assemble/assemble.h"
#include "support/support.h"
#include "tk/compat.h"
#include "tk/tensor_io.h"

namespace tk::detail {
namespace {

/// The first `shown` of `names`, then how many more there are.
std::string first_of(const std::vector<std::string>& names, size_t shown) {
  const size_t n = std::min(names.size(), shown);
  return join(names.data(), names.data() + n) + (names.size() > n ? " and " + std::to_string(names.size() - n) + " more" : "");
}

/// Whether `name` matches one of the shell-wildcard `patterns`.
bool matches(const std::vector<std::string>& patterns, const std::string& name) {
  return std::any_of(patterns.begin(), patterns.end(),
                     [&](const std::string& p) { return ::fnmatch(p.c_str(), name.c_str(), 0) == 0; });
}

OptionSpecs run_specs() {
  return {opt_string("name", "run", "name of the run"),
          opt_int("seed", 0, "seed of initialization, data order and synthetic data"),
          opt_int("epochs", 0, "epochs to train (give epochs or steps)"),
          opt_int("steps", 0, "optimizer steps to train (give epochs or steps)"),
          opt_string("output", "", "output folder, relative to the working directory (default runs/<name>)"),
          opt_string("dtype", "float32", "parameter and data type", {"float32", "float64"}),
          opt_string("device", "auto", "where to train (auto: CUDA when available)", {"auto", "cpu", "cuda"}),
          opt_int("log_every", 10, "optimizer steps between plain progress lines"),
          opt_int("validate_every", 0, "optimizer steps between validations (0: only at the end)"),
          opt_int("threads", 0, "CPU threads of LibTorch's operations and of OpenBLAS's matrix products (0: the libraries' defaults)"),
          opt_bool("trace", false, "record every plugin dispatch in trace.jsonl"),
          opt_bool("measure_memory", false,
                   "each step's peak memory in metrics.jsonl (step_peak_mib); on the CPU every allocation is then "
                   "counted, under a lock (always on on CUDA; micro_batch = \"auto\" counts during its trials only)"),
          opt_float("peak_gflops", 0.0,
                    "the device's peak rate in GFLOP/s that each step's mfu (the model's FLOP rate over it) is "
                    "measured against (0: this machine's matrix-product peak in the dtype training computes in, "
                    "timed once and kept in ~/.cache/trainkit/peak-gflops.json)"),
          opt_bool("phase_times", false,
                   "each step's time by phase in metrics.jsonl: data_ms, forward_ms (with the loss), backward_ms, "
                   "boundary_ms (the plugins' boundary work: unscaling, clipping, a data-parallel wait), "
                   "optimizer_ms (with the plugins' step-end work), validation_ms; on CUDA each phase then waits for the device"),
          opt_string("prefetch", "auto",
                     "prepare the next micro-batch while the current one trains (auto: on CUDA, and on the CPU "
                     "when preparing data takes a noticeable share of a micro-batch); the results are the same",
                     {"auto", "on", "off"}),
          opt_string("allocator", "caching",
                     "CPU tensor memory: caching keeps freed blocks of 1 MiB and more for the next tensor of their "
                     "size (no page faults for a step's large tensors, up to the peak of large tensors held again as "
                     "free); system hands every block back to the C library's allocator at once",
                     {"caching", "system"}),
          opt_int("checkpoint_every", 0, "optimizer steps between checkpoints (0: only at the end)"),
          opt_int("checkpoint_keep", 3, "newest checkpoints to keep"),
          opt_string("max_time", "", "stop at the first boundary after this long, e.g. \"90s\", \"10m\", \"2h\" (\"\": no limit)")};
}

}  // namespace

OptionSpecs batch_specs() {
  OptionSpec micro = opt_int("micro_batch", 32, "examples per micro-batch on each rank (\"auto\": the largest whose "
                                                "training step fits memory_budget, measured)");
  micro.choices = {"auto"};
  return {micro,
          opt_int("accumulation", 1,
                  "micro-batches per optimizer step (k); 0, or left out with effective_batch given: inferred"),
          opt_int("effective_batch", 0,
                  "examples per optimizer step over all ranks (0: micro_batch x accumulation x world size); give two of "
                  "micro_batch, accumulation and this, and the third is inferred"),
          opt_string("memory_budget", "",
                     "with micro_batch = \"auto\": the memory one training step may use, e.g. \"1.5GiB\" (\"\": the "
                     "GPU's free memory; required on the CPU)"),
          opt_string("last_window", "step",
                     "the short window at the end of an epoch: step (normalized by its size), drop, or carry into the "
                     "next epoch",
                     {"step", "drop", "carry"}),
          opt_int("ramp_from", 0, "effective batch of the first step, ramping linearly up to effective_batch (0: no ramp)"),
          opt_int("ramp_steps", 0, "length of the ramp in optimizer steps"),
          opt_int("ramp_samples", 0, "length of the ramp in examples (over all ranks)")};
}

namespace {

OptionSpecs loader_specs() {
  OptionSpec micro_batch = opt_int("micro_batch", 32, "deprecated: [batch] micro_batch");
  micro_batch.choices = {"auto"};
  micro_batch.retired = true;  // still read, with a warning (planning/geometry.cpp)
  micro_batch.moved_to = "batch.micro_batch";
  return {micro_batch,
          opt_bool("shuffle", true, "shuffle every epoch (a pure function of seed and epoch)"),
          opt_bool("drop_last", false, "drop an epoch's last, smaller micro-batch")};
}

OptionSpecs model_specs() {
  return {opt_path("init", "", "start from these weights, by parameter and buffer name: a .safetensors file, a "
                               "dict of tensors saved by torch.save, or a checkpoint folder (\"\": the model's own "
                               "initialization)"),
          opt_bool("init_partial", false,
                   "let init lack some of the model's tensors, hold others, or hold them in other shapes: those keep "
                   "the model's initialization, and the log lists them"),
          opt_strings("trainable", {}, "train only the parameters whose names match one of these patterns (shell "
                                       "wildcards: \"blocks.11.*\", \"ln_f.*\"); [] trains every parameter"),
          opt_strings("freeze", {}, "parameters whose names match one of these patterns are not trained (applied "
                                    "after trainable)")};
}

/// `[model] trainable` and `freeze`: parameters by name pattern, before any plugin's setup (which
/// may freeze more). A pattern that matches nothing is refused: a misspelt name would otherwise
/// train what it meant to freeze.
void choose_trainable(Run& r) {
  const auto& keep = r.model_opts.get_strings("trainable");
  const auto& freeze = r.model_opts.get_strings("freeze");
  if (keep.empty() && freeze.empty()) return;
  const auto params = r.model->named_parameters();
  std::vector<std::string> names;
  for (const auto& p : params) names.push_back("'" + p.key() + "'");
  for (const char* key : {"trainable", "freeze"})
    for (const auto& pattern : r.model_opts.get_strings(key)) {
      const bool used = std::any_of(params.begin(), params.end(), [&](const auto& p) { return matches({pattern}, p.key()); });
      if (!used)
        r.model_opts.fail(key, "'" + pattern + "' matches no parameter of model '" + r.model_name + "' (it has " +
                                   first_of(names, 4) + ")");
    }
  // A tensor under two names (tied) trains when either name is kept and neither is frozen.
  std::map<const c10::TensorImpl*, std::pair<bool, bool>> kept_frozen;
  for (const auto& p : params) {
    auto& [kept, frozen_by] = kept_frozen[p.value().unsafeGetTensorImpl()];
    kept = kept || keep.empty() || matches(keep, p.key());
    frozen_by = frozen_by || matches(freeze, p.key());
  }
  int64_t trained = 0, frozen = 0;
  for (const auto& t : distinct_tensors(params.values())) {
    const auto& [kept, frozen_by] = kept_frozen.at(t.unsafeGetTensorImpl());
    const bool train = kept && !frozen_by;
    if (!train) const_cast<at::Tensor&>(t).set_requires_grad(false);
    (train ? trained : frozen) += t.numel();
  }
  spdlog::info("model: {} parameters trained, {} frozen (model.trainable, model.freeze)", trained, frozen);
}

/// `[model] init`: the model's parameters and buffers from a file, by name (before any plugin's
/// setup, so that an adapter wraps the pretrained model).
void load_init(Run& r) {
  const std::string& file = r.model_opts.get_path("init");
  if (file.empty()) return;
  const bool partial = r.model_opts.get_bool("init_partial");
  const std::filesystem::path path(file);
  NamedTensors saved;
  try {
    saved = load_model_weights(path);
  } catch (const std::exception& e) {
    r.model_opts.fail("init", message_of(e));
  }
  std::map<std::string, at::Tensor> by_name(saved.begin(), saved.end());
  std::vector<std::string> missing, misshapen;
  torch::NoGradGuard no_grad;
  auto take = [&](const std::string& name, at::Tensor& dst) {
    auto it = by_name.find(name);
    if (it == by_name.end()) return missing.push_back("'" + name + "'");
    if (it->second.sizes() != dst.sizes()) {
      misshapen.push_back("'" + name + "' (" + c10::str(it->second.sizes()) + " there, " + c10::str(dst.sizes()) + " here)");
    } else {
      // A NaN or an infinity would surface as a non-finite loss, blamed on the learning rate.
      if (const int64_t bad = nonfinite_count(it->second); bad > 0)
        r.model_opts.fail("init", file + ": tensor '" + name + "' holds NaN or infinite values (" + std::to_string(bad) +
                                      " of " + std::to_string(it->second.numel()) + "): a damaged or diverged checkpoint");
      dst.copy_(it->second);
    }
    by_name.erase(it);
  };
  for (auto& p : r.model->named_parameters()) take(p.key(), p.value());
  for (auto& b : r.model->named_buffers()) take(b.key(), b.value());
  std::vector<std::string> extra;
  for (const auto& [name, t] : by_name) extra.push_back("'" + name + "'");
  std::string why;
  if (!missing.empty()) why += "; it lacks " + first_of(missing, 5);
  if (!misshapen.empty()) why += "; other shapes: " + first_of(misshapen, 5);
  if (!extra.empty()) why += "; the model has no " + first_of(extra, 5);
  const size_t loaded = saved.size() - extra.size() - misshapen.size();
  if (!why.empty() && !partial)
    r.model_opts.fail("init", file + " does not fit model '" + r.model_name + "'" + why +
                                  " (init_partial = true loads what fits)");
  if (!why.empty()) r.warn("init: loaded " + std::to_string(loaded) + " tensors of " + file + why);
  else spdlog::info("init: loaded all {} tensors of {}", loaded, file);
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

}  // namespace

void read_run_section(Run& r, const Recipe& recipe) {
  r.run = recipe.options("run", run_specs());
  r.resolved.add_section("run", "", r.run);
  const Options& o = r.run;
  const int64_t epochs = o.get_int("epochs"), steps = o.get_int("steps");
  if (epochs < 0) o.fail("epochs", "must be >= 0");
  if (steps < 0) o.fail("steps", "must be >= 0");
  if (epochs > 0 && steps > 0)
    o.fail("steps", "give either epochs or steps, not both (epochs = 0 counts steps, steps = 0 epochs)");
  for (const char* k : {"epochs", "steps"})
    if (o.get_int(k) > kMaxCount)
      o.fail(k, "is " + std::to_string(o.get_int(k)) + ", beyond what any machine can train (at most " +
                    std::to_string(kMaxCount) + ")");
  r.bound = steps > 0 ? Bound{Bound::Unit::Steps, steps} : Bound{Bound::Unit::Epochs, std::max<int64_t>(1, epochs)};
  for (const char* k : {"log_every", "checkpoint_keep"})
    if (o.get_int(k) < 1) o.fail(k, "must be >= 1");
  for (const char* k : {"validate_every", "checkpoint_every"})
    if (o.get_int(k) < 0) o.fail(k, "must be >= 0");
  r.max_time_s = parse_duration(o, "max_time");
  if (!(o.get_float("peak_gflops") >= 0.0)) o.fail("peak_gflops", "must be >= 0 (GFLOP/s; 0: measured)");
  r.tracing = o.get_bool("trace");
  const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  if (o.get_int("threads") < 0) o.fail("threads", "must be >= 0 (0: LibTorch's default)");
  if (o.get_int("threads") > 4 * cores)
    o.fail("threads", "is " + std::to_string(o.get_int("threads")) + " on a machine with " + std::to_string(cores) +
                          " cores; at most " + std::to_string(4 * cores) + " (4 per core) are accepted");
  if (o.get_int("threads") > 0) compat::set_cpu_threads(static_cast<int>(o.get_int("threads")));
  r.dtype = o.get_string("dtype") == "float64" ? at::kDouble : at::kFloat;
  const std::string& dev = o.get_string("device");
  const bool cuda = torch::cuda::is_available();
  if (dev == "cuda" && !cuda) o.fail("device", "CUDA is not available (this LibTorch has no CUDA, or no GPU is visible)");
  r.device = (dev == "cuda" || (dev == "auto" && cuda)) ? at::Device(at::kCUDA) : at::Device(at::kCPU);
  // One GPU per process of a launch (tk-run's, torchrun's or Slurm's local rank): its own.
  const int local = r.device.is_cuda() ? local_rank_from_environment() : -1;
  if (local >= 0) {
    const long n = static_cast<long>(torch::cuda::device_count());
    if (local >= n)
      o.fail("device", "this process's local rank is " + std::to_string(local) + " but " + std::to_string(n) +
                           " GPUs are visible: start at most one process per GPU");
    r.device = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(local));
  }
  r.seed = static_cast<uint64_t>(o.get_int("seed"));
  r.world_opts = recipe.options("world", world_specs());
  r.resolved.add_section("world", "", r.world_opts);
  r.batch_opts = recipe.options("batch", batch_specs());
  r.resolved.add_section("batch", "", r.batch_opts);
}

namespace {

/// Runs `make` (a component's maker) so that whatever it throws names the recipe section: a
/// LibTorch error in one line, an allocation that failed as such.
template <class Make>
auto made_in(const Options& o, const std::string& what, Make&& make) {
  try {
    return make();
  } catch (const RecipeError&) {
    throw;
  } catch (const std::bad_alloc&) {
    throw RecipeError(o.section_loc(), what + ": out of memory while making it");
  } catch (const std::exception& e) {
    // At the option the message names as a word ("Invalid weight_decay value: -1", LibTorch's), where
    // exactly one set option is named; else at the section.
    const std::string said = message_of(e);
    static const std::regex word("[A-Za-z0-9_]+");
    std::set<std::string> words;
    for (std::sregex_iterator w(said.begin(), said.end(), word), end; w != end; ++w)
      words.insert(w->str());
    std::vector<std::string> named;
    for (const auto& [name, value] : o.values())
      if (o.is_set(name) && words.count(name)) named.push_back(name);
    throw RecipeError(named.size() == 1 ? o.where(named.front()) : o.section_loc(), what + ": " + said);
  }
}

/// The component the section of `kind` selects: the one it names; else the one declaring an
/// option the section sets that selects it (OptionSpec::selects); else `fallback`, or the kind's
/// default (Registry::set_default). Its checked options (`extra` first) go to `opts`, recorded as
/// resolved.
template <class Maker>
const Component<Maker>& section(Run& r, const Recipe& recipe, Kind kind, std::string fallback,
                                const std::vector<Component<Maker>>& list, std::string& chosen, Options& opts,
                                OptionSpecs extra = {}) {
  const char* name = to_string(kind);
  if (fallback.empty()) fallback = r.registry.default_of(kind);
  for (const auto& c : list)
    for (const auto& s : c.specs)
      if (s.selects && recipe.sets(name, s.name)) fallback = c.name;
  const Component<Maker>& c = *find_component(list, recipe.component(name, fallback, component_names(list)));
  extra.insert(extra.end(), c.specs.begin(), c.specs.end());
  chosen = c.name;
  opts = recipe.options(name, extra, true);
  r.resolved.add_section(name, c.name, opts);
  return c;
}

}  // namespace

/// Data, model, loss, optimizer (checked now, made after setup) and schedule.
void build_components(Run& r, const Recipe& recipe) {
  const auto& dc = section(r, recipe, Kind::Data, "", r.registry.data(), r.data_name, r.data_opts, loader_specs());
  r.data = made_in(r.data_opts, "data '" + dc.name + "'", [&] { return dc.make(r.data_opts, r.seed); });
  if (!r.data.train) throw RecipeError(r.data_opts.section_loc(), "data '" + dc.name + "' made no training split");

  const auto& mc = section(r, recipe, Kind::Model, "", r.registry.models(), r.model_name, r.model_opts, model_specs());
  torch::manual_seed(r.seed);
  building_model(r, [&] {
    r.model = made_in(r.model_opts, "model '" + mc.name + "'", [&] { return mc.make(r.model_opts, r.data.info); });
    if (!r.model) throw RecipeError(r.model_opts.section_loc(), "model '" + mc.name + "' made no model");
    if (!r.device.is_cpu()) return;
    double elements = 0;  // as the conversion leaves them: LibTorch's Module::to converts every tensor, integers too
    for (const auto& list : {r.model->parameters(), r.model->buffers()})
      for (const auto& t : distinct_tensors(list)) elements += static_cast<double>(t.numel());
    require_memory(r.run, "dtype", elements * static_cast<double>(c10::elementSize(r.dtype)),
                   "model '" + mc.name + "' as " + r.run.get_string("dtype"));
  });
  r.model->to(r.device, r.dtype);
  load_init(r);
  choose_trainable(r);
  r.model->train();

  const auto& lc = section(r, recipe, Kind::Loss, r.data.info.default_loss, r.registry.losses(), r.loss_name,
                           r.loss_opts);
  r.loss = lc.make(r.loss_opts);
  const auto& info = r.data.info;
  if (info.ignore_index && r.loss_opts.has("ignore_index") && r.loss_opts.get_int("ignore_index") != *info.ignore_index)
    r.loss_opts.fail("ignore_index", "is " + std::to_string(r.loss_opts.get_int("ignore_index")) +
                                         ", but the data marks padding with " + std::to_string(*info.ignore_index) +
                                         " (data.ignore_index): padding would count toward the loss");
  const Targets wants = r.loss->targets();
  if (wants != Targets::Any && (wants == Targets::Classes) != info.classification)
    throw RecipeError(r.loss_opts.section_loc(),
                      "loss '" + r.loss_name + "' takes " + (wants == Targets::Classes ? "class labels" : "real-valued targets") +
                          ", but data '" + r.data_name + "' gives " +
                          (info.classification ? "class labels" : "real-valued targets") +
                          (info.default_loss.empty() ? std::string() : "; use " + info.default_loss));

  const auto& oc = section(r, recipe, Kind::Optimizer, "", r.registry.optimizers(), r.opt_name, r.opt_opts);
  r.optimizer_maker = &oc;
  // Made now to check its options and read its learning rate; the real one is made after setup.
  r.base_lr = get_lr(*made_in(r.opt_opts, "optimizer '" + oc.name + "' refused its options",
                              [&] { return oc.make(r.opt_opts, r.model->parameters()); }));

  const auto& sc = section(r, recipe, Kind::Schedule, "", r.registry.schedules(), r.sched_name, r.sched_opts);
  r.schedule = sc.make(r.sched_opts, r.base_lr);
}

void check_component_sections(Run& r, const Recipe& recipe) {
  std::string name;
  Options opts;
  section(r, recipe, Kind::Data, "", r.registry.data(), name, opts, loader_specs());
  section(r, recipe, Kind::Model, "", r.registry.models(), name, opts, model_specs());
  if (recipe.sets("loss", "name")) section(r, recipe, Kind::Loss, "", r.registry.losses(), name, opts);
  section(r, recipe, Kind::Optimizer, "", r.registry.optimizers(), name, opts);
  section(r, recipe, Kind::Schedule, "", r.registry.schedules(), name, opts);
}

}  // namespace tk::detail
