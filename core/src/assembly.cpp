// Run assembly: the recipe's libraries, data, model, loss, schedule and plugins (assemble), then
// the plan, the plugins' setup and the optimizer (plan_run).
#include <ATen/Parallel.h>
#include <spdlog/spdlog.h>
#include <torch/cuda.h>

#include <algorithm>
#include <limits>
#include <thread>
#include <map>
#include <set>

#include "run.h"
#include "tk/loader.h"

namespace fs = std::filesystem;

namespace tk::detail {
namespace {

const std::vector<std::string> kSections = {"run", "model", "data", "loss", "optimizer", "schedule", "plugins"};

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
          opt_int("threads", 0, "intra-op CPU threads (0: LibTorch's default)"),
          opt_bool("trace", false, "record every plugin dispatch in trace.jsonl"),
          opt_string("prefetch", "auto",
                     "prepare the next micro-batch while the current one trains (auto: on CUDA, and on the CPU "
                     "when preparing data takes a noticeable share of a micro-batch); the results are the same",
                     {"auto", "on", "off"}),
          opt_int("checkpoint_every", 0, "optimizer steps between checkpoints (0: only at the end)"),
          opt_int("checkpoint_keep", 3, "newest checkpoints to keep"),
          opt_string("max_time", "", "stop at the first boundary after this long, e.g. \"90s\", \"10m\", \"2h\" (\"\": no limit)")};
}

OptionSpecs loader_specs() {
  OptionSpec micro_batch = opt_int("micro_batch", 32, "examples per micro-batch (\"auto\": picked by memory, see grad_accum)");
  micro_batch.choices = {"auto"};
  return {micro_batch,
          opt_bool("shuffle", true, "shuffle every epoch (a pure function of seed and epoch)"),
          opt_bool("drop_last", false, "drop an epoch's last, smaller micro-batch")};
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

/// The component a section names (or `fallback`), among those registered.
template <class Maker>
const Component<Maker>& pick(const Recipe& r, const char* section, const char* fallback,
                             const std::vector<Component<Maker>>& list) {
  return *find_component(list, r.component(section, fallback, component_names(list)));
}

/// The settings of [run]: bound, dtype, device, time limit.
void read_run_section(Run& r, const Recipe& recipe) {
  recipe.check_sections(kSections);
  r.run = recipe.options("run", run_specs());
  const Options& o = r.run;
  const int64_t epochs = o.get_int("epochs"), steps = o.get_int("steps");
  if (epochs < 0) o.fail("epochs", "must be >= 0");
  if (steps < 0) o.fail("steps", "must be >= 0");
  if (epochs > 0 && steps > 0) o.fail("steps", "give either epochs or steps, not both");
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
  r.tracing = o.get_bool("trace");
  const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  if (o.get_int("threads") < 0) o.fail("threads", "must be >= 0 (0: LibTorch's default)");
  if (o.get_int("threads") > 4 * cores)
    o.fail("threads", "is " + std::to_string(o.get_int("threads")) + " on a machine with " + std::to_string(cores) +
                          " cores; at most " + std::to_string(4 * cores) + " (4 per core) are accepted");
  if (o.get_int("threads") > 0) at::set_num_threads(static_cast<int>(o.get_int("threads")));
  r.dtype = o.get_string("dtype") == "float64" ? at::kDouble : at::kFloat;
  const std::string& dev = o.get_string("device");
  const bool cuda = torch::cuda::is_available();
  if (dev == "cuda" && !cuda) o.fail("device", "CUDA is not available (this LibTorch has no CUDA, or no GPU is visible)");
  r.device = (dev == "cuda" || (dev == "auto" && cuda)) ? at::Device(at::kCUDA) : at::Device(at::kCPU);
  r.seed = static_cast<uint64_t>(o.get_int("seed"));
}

/// What a `[[plugins]]` entry resolves to: the library it loaded and the plugin it names ("" for
/// a library that only registers components).
struct Resolved {
  std::string plugin, version, file, library;
};

Resolved resolve_entry(Run& r, const PluginLoader& loader, const PluginEntry& e) {
  auto strategies_of = [&](const fs::path& file) {
    std::vector<std::string> out;
    for (const auto& [kind, name] : r.registry.registered_by(fs::weakly_canonical(file).string()))
      if (kind == Kind::Plugin) out.push_back(name);
    return out;
  };
  if (e.path.empty()) {
    if (const auto* c = find_component(r.registry.plugins(), e.name)) return {e.name, "", c->library, e.name};
    const fs::path file = loader.find(e.name);
    const LibraryInfo info = loader.load(file, r.registry);
    const auto names = strategies_of(file);
    if (find_component(r.registry.plugins(), e.name)) return {e.name, info.version, file.string(), info.name};
    // `name` named the library: its one strategy (if any) is the entry's.
    if (names.size() <= 1) return {names.empty() ? "" : names.front(), info.version, file.string(), info.name};
    throw PluginLoadError(file.string() + " registers plugins " + join(names.data(), names.data() + names.size()) +
                          ", none called '" + e.name + "': give `path = \"" + file.string() +
                          "\"` and `name = ` one of them");
  }
  const LibraryInfo info = loader.load(e.path, r.registry);
  const auto names = strategies_of(e.path);
  if (e.name.empty()) {
    if (names.size() > 1)
      throw PluginLoadError(e.path.string() + " registers plugins " + join(names.data(), names.data() + names.size()) +
                            ": say which one with `name = \"...\"`");
    return {names.empty() ? "" : names.front(), info.version, e.path.string(), info.name};
  }
  if (std::find(names.begin(), names.end(), e.name) == names.end())
    throw PluginLoadError(e.path.string() + " is plugin '" +
                          (names.empty() ? info.name : join(names.data(), names.data() + names.size())) +
                          "', but the recipe asks for '" + e.name + "'");
  return {e.name, info.version, e.path.string(), info.name};
}

/// Loads every `[[plugins]]` library (their components become selectable) and makes the plugins.
void load_plugins(Run& r, const Recipe& recipe, const PluginLoader& loader) {
  const auto entries = recipe.plugins();
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto& e = entries[i];
    Resolved res;
    std::shared_ptr<Plugin> plugin;
    try {
      res = resolve_entry(r, loader, e);
      if (!res.plugin.empty()) plugin = r.registry.make_plugin(res.plugin);
    } catch (const PluginLoadError& err) {
      throw PluginLoadError(e.where.str() + ": " + err.what());
    }
    for (const auto& slot : r.slots)
      if (plugin && slot.plugin && slot.name == res.plugin)
        throw PluginLoadError(e.where.str() + ": plugin '" + res.plugin +
                              "' is already in this run: one instance per plugin (its checkpoint state and "
                              "--set plugins." + res.plugin + ".* would be ambiguous)");
    const Options o = recipe.plugin_options(i, plugin ? plugin->option_specs() : OptionSpecs{});
    if (!plugin) {  // a library of components: nothing to dispatch to
      r.slots.push_back({nullptr, res.library, res.version, res.file});
      continue;
    }
    try {
      plugin->set_options(o);
      plugin->init(o);
    } catch (const RecipeError&) {
      throw;
    } catch (const std::exception& err) {
      throw PluginLoadError(e.where.str() + ": plugin '" + res.plugin + "' (" + res.file +
                            ") rejected its options: " + message_of(err));
    }
    r.slots.push_back({plugin, res.plugin, res.version, res.file});
  }
}

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
    throw RecipeError(o.section_loc(), what + ": " + message_of(e));
  }
}

/// Data, model, loss, optimizer (checked now, made after setup) and schedule.
void build_components(Run& r, const Recipe& recipe) {
  const auto& dc = pick(recipe, "data", "", r.registry.data());
  OptionSpecs dspecs = loader_specs();
  dspecs.insert(dspecs.end(), dc.specs.begin(), dc.specs.end());
  r.data_name = dc.name;
  r.data_opts = recipe.options("data", dspecs, true);
  if (r.data_opts.get_word("micro_batch").empty() && r.data_opts.get_int("micro_batch") < 1)
    r.data_opts.fail("micro_batch", "must be >= 1");
  r.data = made_in(r.data_opts, "data '" + dc.name + "'", [&] { return dc.make(r.data_opts, r.seed); });
  if (!r.data.train) throw RecipeError(r.data_opts.section_loc(), "data '" + dc.name + "' made no training split");

  // `[model] torchscript = "file.pt"` needs no name.
  const auto& mc = pick(recipe, "model", recipe.sets("model", "torchscript") ? "torchscript" : "", r.registry.models());
  r.model_name = mc.name;
  r.model_opts = recipe.options("model", mc.specs, true);
  torch::manual_seed(r.seed);
  r.model = made_in(r.model_opts, "model '" + mc.name + "'", [&] { return mc.make(r.model_opts, r.data.info); });
  if (!r.model) throw RecipeError(r.model_opts.section_loc(), "model '" + mc.name + "' made no model");
  r.model->to(r.device, r.dtype);
  r.model->train();

  const auto& lc = pick(recipe, "loss", r.data.info.default_loss.c_str(), r.registry.losses());
  r.loss_name = lc.name;
  r.loss_opts = recipe.options("loss", lc.specs, true);
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

  const auto& oc = pick(recipe, "optimizer", "", r.registry.optimizers());
  r.opt_name = oc.name;
  r.optimizer_maker = &oc;
  r.opt_opts = recipe.options("optimizer", oc.specs, true);
  // Made now to check its options and read its learning rate; the real one is made after setup.
  r.base_lr = get_lr(*oc.make(r.opt_opts, r.model->parameters()));

  const auto& sc = pick(recipe, "schedule", "constant", r.registry.schedules());
  r.sched_name = sc.name;
  r.sched_opts = recipe.options("schedule", sc.specs, true);
  r.schedule = sc.make(r.sched_opts, r.base_lr);
}

/// Runs `fn` for the plugin of `slot`, reporting its failure with its name and file.
template <class Fn>
void as_plugin(const Slot& slot, const char* what, Fn&& fn) {
  try {
    fn();
  } catch (const RecipeError&) {
    throw;
  } catch (const std::exception& err) {
    throw Error("plugin '" + slot.name + "' (" + slot.file + ") failed in " + what + ": " + message_of(err));
  }
}

/// The setup hook's context: the core fills it in.
class Setup final : public SetupContext {
 public:
  Setup(Run& r) {
    model_ = &r.model;
    plan_ = &r.plan;
    data_ = &r.data.info;
    log_ = [&r](int level, const std::string& msg) {
      if (level > 0) r.warn(msg);
      else spdlog::info("{}", msg);
    };
  }
  void enter(const std::string& plugin) { current_plugin_ = plugin; }
};

}  // namespace

void Run::warn(const std::string& msg) {
  warnings.push_back(msg);
  spdlog::warn("{}", msg);
}

at::Tensor Run::shard_order(int64_t epoch) const {
  const at::Tensor all = epoch_order(data.train->size(), seed, epoch, data_opts.get_bool("shuffle"));
  if (plan.world_size == 1) return all;
  return all.slice(0, plan.rank, shard_size() * plan.world_size, plan.world_size);
}

Batch Run::fetch(const Dataset& ds, const at::Tensor& indices) const {
  Batch b = ds.get(indices);
  b.input = place(b.input, device);
  b.target = place(b.target, device);
  return b;
}

at::Tensor Run::place(const at::Tensor& t, at::Device to, bool non_blocking) const {
  return at::isFloatingType(t.scalar_type()) ? t.to(to, dtype, non_blocking) : t.to(to, non_blocking);
}

void assemble(Run& r, const Recipe& recipe, const TrainerOptions& opts) {
  read_run_section(r, recipe);
  const PluginLoader loader(opts.plugin_dirs ? *opts.plugin_dirs : PluginLoader::default_dirs(recipe.dir()));
  // trainkit's own components come from its own plugins folder: a recipe's tk_data.so cannot shadow them.
  const PluginLoader own({PluginLoader::own_dir()});
  for (const auto& lib : PluginLoader::standard_libraries()) {
    fs::path file;
    try {
      file = own.find(lib);
    } catch (const PluginLoadError& e) {
      throw PluginLoadError("trainkit's standard library '" + lib + "' is missing (the installation is incomplete): " +
                            e.what());
    }
    loader.load(file, r.registry);
  }
  load_plugins(r, recipe, loader);
  build_components(r, recipe);
}

void add_plugin(Run& r, std::shared_ptr<Plugin> plugin, const Options& opts) {
  if (r.planned) throw Error("add_plugin() must come before the run is planned (fit, describe, plan, optimizer)");
  if (plugin->name().empty()) throw Error("a plugin added in code needs a name (Plugin::set_name)");
  for (const auto& slot : r.slots)
    if (slot.plugin && slot.name == plugin->name())
      throw Error("plugin '" + plugin->name() + "' is already in this run: one instance per plugin");
  plugin->set_options(opts);
  plugin->init(opts);
  r.slots.push_back({plugin, plugin->name(), "(in-process)", "(in-process)"});
}

void plan_once(Run& r);

/// Checks a split's every example (up to a million) before training: inputs finite, targets of
/// the kind the loss takes and, for classes, in range. Says which split and example is wrong.
void check_split(Run& r, const Dataset& ds, const std::string& split) {
  const DataInfo& info = r.data.info;
  const std::string where = "data '" + r.data_name + "', " + split + " split";
  const int64_t n = std::min<int64_t>(ds.size(), 1000000), chunk = 4096;
  int64_t counted = 0;
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t end = std::min(n, start + chunk);
    const Batch b = ds.get(at::arange(start, end, at::kLong));
    counted += b.tokens;
    auto first_bad = [&](const at::Tensor& bad) {
      const auto rows = bad.reshape({bad.size(0), -1}).any(1);
      return start + rows.nonzero().min().item<int64_t>();
    };
    if (at::isFloatingType(b.input.scalar_type())) {
      const auto bad = b.input.isfinite().logical_not();
      if (bad.any().item<bool>())
        throw RecipeError(r.data_opts.section_loc(), where + ": example " + std::to_string(first_bad(bad)) +
                                                         " has NaN or infinite inputs");
    }
    const at::Tensor& y = b.target;
    if (info.classification) {
      if (at::isFloatingType(y.scalar_type()))
        throw RecipeError(r.data_opts.section_loc(), where + ": the targets are floating point (" +
                                                         std::string(c10::toString(y.scalar_type())) +
                                                         "), but class targets must be integer class indices");
      auto counts = info.ignore_index ? y != *info.ignore_index : at::ones_like(y, at::kBool);
      const auto bad = counts.logical_and(y.lt(0).logical_or(y.ge(info.output_dim)));
      if (bad.any().item<bool>()) {
        const int64_t i = first_bad(bad);
        const int64_t v = y.reshape({y.size(0), -1})[i - start].masked_select(bad.reshape({y.size(0), -1})[i - start])[0].item<int64_t>();
        throw RecipeError(r.data_opts.section_loc(), where + ": example " + std::to_string(i) + " has target " +
                                                         std::to_string(v) + ", outside the " +
                                                         std::to_string(info.output_dim) + " classes [0, " +
                                                         std::to_string(info.output_dim - 1) + "]");
      }
    } else if (at::isFloatingType(y.scalar_type())) {
      const auto bad = y.isfinite().logical_not();
      if (bad.any().item<bool>())
        throw RecipeError(r.data_opts.section_loc(), where + ": example " + std::to_string(first_bad(bad)) +
                                                         " has a NaN or infinite target");
    }
  }
  if (counted == 0 && n > 0) r.warn(where + ": no target counts (every one is masked out): it trains on nothing");
}

/// Before training (and in a dry run): the data checked, then one micro-batch through the model
/// and the loss, in eval mode without gradients (no random draws, no statistics updated), so that
/// a model that does not fit the data is refused naming both.
void check_data_and_model(Run& r) {
  check_split(r, *r.data.train, "training");
  if (r.data.validation) check_split(r, *r.data.validation, "validation");
  const int64_t m = std::min<int64_t>(r.plan.micro_batch, r.data.train->size());
  const Batch b = r.fetch(*r.data.train, at::arange(m, at::kLong));
  const std::string what = "model '" + r.model_name + "' on data '" + r.data_name + "' (" + r.data.info.describe() + ")";
  torch::NoGradGuard no_grad;
  const bool training = r.model->is_training();
  r.model->eval();
  try {
    const at::Tensor out = r.model->forward(b.input);
    if (!at::isFloatingType(out.scalar_type()))
      throw Error("its output is " + std::string(c10::toString(out.scalar_type())) + ", not floating point");
    const DataInfo& info = r.data.info;
    if (info.classification && out.dim() < 2)
      throw Error("its output " + c10::str(out.sizes()) + " has no class dimension (expected [N, " +
                  std::to_string(info.output_dim) + "] or [N, T, " + std::to_string(info.output_dim) + "])");
    if (info.classification && out.dim() >= 2 && out.size(-1) != info.output_dim)
      throw Error("it gives " + std::to_string(out.size(-1)) + " scores per prediction (output " + c10::str(out.sizes()) +
                  "), the data has " + std::to_string(info.output_dim) + " classes");
    const at::Tensor loss = (*r.loss)(out, b);
    if (loss.numel() != 1) throw Error("loss '" + r.loss_name + "' gave " + c10::str(loss.sizes()) + ", not one value");
  } catch (const std::exception& e) {
    r.model->train(training);
    throw RecipeError(r.model_opts.section_loc(), what + ": one micro-batch of input " + c10::str(b.input.sizes()) +
                                                      " does not go through the model and loss '" + r.loss_name +
                                                      "': " + message_of(e));
  }
  r.model->train(training);
}

void plan_run(Run& r) {
  if (r.planned) return;
  if (!r.planning_error.empty()) throw Error("the run could not be planned: " + r.planning_error);
  try {
    plan_once(r);
  } catch (const std::exception& e) {
    r.planning_error = e.what();
    throw;
  }
}

void make_optimizer(Run& r) {
  std::vector<at::Tensor> trainable;
  for (const auto& p : r.model->parameters())
    if (p.requires_grad()) trainable.push_back(p);
  if (trainable.empty())
    throw RecipeError(r.model_opts.section_loc(), "model '" + r.model_name + "' has no trainable parameter" +
                (r.model->parameters().empty() ? std::string() : " (every parameter has requires_grad = false)"));
  r.optimizer = r.optimizer_maker->make(r.opt_opts, trainable);
}

void plan_once(Run& r) {
  r.plan = RunPlan{};
  r.plan.micro_batch_auto = r.data_opts.get_word("micro_batch") == "auto";
  r.plan.micro_batch = r.plan.micro_batch_auto ? 0 : r.data_opts.get_int("micro_batch");
  r.plan.loss_reduction = to_string(r.loss->reduction());
  r.plan.device = r.device.type();
  std::vector<size_t> with_plugin;
  for (size_t i = 0; i < r.slots.size(); ++i)
    if (r.slots[i].plugin) with_plugin.push_back(i);
  for (size_t i : with_plugin)
    for (const auto& cap : r.slots[i].plugin->contract().provides) r.plan.capabilities.insert(cap);
  std::vector<PluginDecl> decls;
  for (size_t i : with_plugin) {
    const Slot& s = r.slots[i];
    as_plugin(s, "configure", [&] { s.plugin->configure(r.plan); });
    decls.push_back({s.name, s.plugin->contract()});
  }
  settle_window(r);
  int64_t effective = 0;
  if (!r.plan.micro_batch_auto &&
      (r.plan.accumulation < 1 || r.plan.accumulation > kMaxCount ||
       __builtin_mul_overflow(r.plan.micro_batch, r.plan.accumulation, &effective) ||
       __builtin_mul_overflow(effective, r.plan.world_size, &effective) || effective > kMaxCount))
    throw Error("the plan's effective batch (micro-batch " + std::to_string(r.plan.micro_batch) + " x accumulation " +
                std::to_string(r.plan.accumulation) + " x world " + std::to_string(r.plan.world_size) +
                ") is beyond any machine (at most " + std::to_string(kMaxCount) + " examples per optimizer step)");
  std::vector<std::string> notes;
  r.order.clear();
  for (size_t k : order_plugins(decls, &notes)) r.order.push_back(with_plugin[k]);
  for (const auto& n : notes) r.warn(n);

  // The plugins' setup may freeze, replace or add parameters: the optimizer is made after it.
  Setup setup(r);
  for (size_t i : r.order) {
    setup.enter(r.slots[i].name);
    as_plugin(r.slots[i], "setup", [&] { r.slots[i].plugin->setup(setup); });
  }
  r.model->to(r.device, r.dtype);
  make_optimizer(r);
  pick_micro_batch(r);
  shape_windows(r);
  check_data_and_model(r);
  if (r.plan.accumulation > 1 && has_batchnorm(*r.model))
    r.warn("the model has BatchNorm and accumulates " + std::to_string(r.plan.accumulation) +
           " micro-batches per step: its statistics are computed per micro-batch of " +
           std::to_string(r.plan.micro_batch) + " examples, not per window of " +
           std::to_string(r.plan.micro_batch * r.plan.accumulation) +
           " (tk-run --verify-accumulation measures the difference)");
  r.planned = true;
}

RunIdentity run_identity(const Run& r, const Recipe& recipe) {
  // What may change between a run and its resume without changing what it trains.
  static const std::set<std::string> kMayChange = {"run.name",           "run.output",         "run.max_time",
                                                   "run.log_every",      "run.validate_every", "run.trace",
                                                   "run.checkpoint_every", "run.checkpoint_keep",
                                                   "run.prefetch"};
  RunIdentity id;
  id.world_size = r.plan.world_size;
  for (auto& [k, v] : recipe.resolved_values())
    if (!kMayChange.count(k)) id.recipe.emplace_back(k, v);
  return id;
}

namespace {

/// Each difference between the checkpoint's run and this one that `allowed` does not cover.
std::vector<std::string> differences(const RunIdentity& saved, const RunIdentity& now,
                                     const std::vector<std::string>& allowed) {
  auto is_allowed = [&](const std::string& key) {
    for (const auto& a : allowed)
      if (a == "all" || a == key || key.rfind(a + ".", 0) == 0) return true;
    return false;
  };
  std::map<std::string, std::string> before(saved.recipe.begin(), saved.recipe.end());
  std::vector<std::string> out;
  auto show = [](const std::string* v) { return v ? *v : std::string("(not set)"); };
  for (const auto& [k, v] : now.recipe) {
    auto it = before.find(k);
    const std::string* old = it == before.end() ? nullptr : &it->second;
    if ((!old || *old != v) && !is_allowed(k)) out.push_back(k + ": " + show(old) + " -> " + v);
    if (it != before.end()) before.erase(it);
  }
  for (const auto& [k, v] : before)
    if (!is_allowed(k)) out.push_back(k + ": " + v + " -> (not set)");
  if (saved.world_size != now.world_size && !is_allowed("world_size"))
    out.push_back("world_size: " + std::to_string(saved.world_size) + " -> " + std::to_string(now.world_size));
  return out;
}

}  // namespace

Checkpoint resume_from(Run& r, const std::string& which, const fs::path& output_dir, const RunIdentity& identity,
                       const std::vector<std::string>& allowed) {
  std::string note;
  const fs::path dir = resolve_checkpoint(which, output_dir, &note);
  if (!note.empty()) r.warn(note);
  // Checked before anything is loaded: another optimizer's state would not even load.
  if (auto saved = read_run_identity(dir)) {
    const auto diff = differences(*saved, identity, allowed);
    if (!diff.empty()) {
      std::string list;
      for (const auto& d : diff) list += "\n  " + d;
      throw RunRefused("cannot resume from " + dir.string() + ": this run differs from the one that wrote it (checkpoint -> now):" +
                  list + "\nresume with the recipe and options it was started with (its output folder's recipe.toml), "
                  "or allow a change on purpose with --allow-change KEY");
    }
  } else {
    r.warn(dir.string() + " does not record the recipe it was made with (written by an older trainkit): "
           "make sure this recipe is the one it was started with");
  }
  Checkpoint resumed = load_checkpoint(dir, *r.model, *r.optimizer);
  restore_plugin_states(r, resumed);
  if (resumed.position.counters.total_steps != r.total_steps)
    throw RunRefused(resumed.dir.string() + ": the checkpoint is of a run of " +
                std::to_string(resumed.position.counters.total_steps) + " steps, this one has " +
                std::to_string(r.total_steps) + ": resume with the recipe it was made with");
  return resumed;
}

void restore_plugin_states(Run& r, Checkpoint& resumed) {
  for (const auto& slot : r.slots) {
    if (!slot.plugin) continue;
    auto it = resumed.plugin_states.find(slot.name);
    if (it == resumed.plugin_states.end()) {
      r.warn("plugin '" + slot.name + "' has no state in " + resumed.dir.string() + "; it starts fresh");
      continue;
    }
    as_plugin(slot, "load_state", [&] { slot.plugin->load_state(it->second); });
    resumed.plugin_states.erase(it);
  }
  for (const auto& [name, st] : resumed.plugin_states)
    r.warn("the checkpoint holds state of plugin '" + name + "', which this run does not load; ignored");
}

}  // namespace tk::detail
