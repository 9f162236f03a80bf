// The plugin contract (tk/testing.h): the checks every plugin library must pass, run on a small
// recipe with the library's plugin among the core's own.
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include "tk/capabilities.h"
#include "tk/registry.h"
#include "tk/loader.h"
#include "tk/testing.h"

namespace fs = std::filesystem;

namespace tk::testing {

namespace {

/// Two epochs of a small MLP with validation: every event occurs.
const char* const kContractRecipe = R"(
[run]
seed = 5
epochs = 2
dtype = "float32"

[model]
name = "mlp"
hidden = [8]

[data]
name = "synthetic-classification"
samples = 60
validation_samples = 16
features = 6
classes = 3

[batch]
micro_batch = 8

[optimizer]
name = "sgd"
lr = 0.05
momentum = 0.9

[world]
timeout_s = 120
rendezvous_timeout_s = 120
)";

/// The world the contract runs in, as the launcher's environment says: tk-plugin check --nproc N
/// and torchrun run one checker per rank (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE); a world of one
/// otherwise.
struct ContractWorld {
  int rank = 0, size = 1, local_size = 1;
  std::string tag;  ///< what names this launch's scratch folders, the same on every rank

  static ContractWorld from_environment() {
    auto number = [](const char* name, int otherwise) {
      const char* v = std::getenv(name);
      return v && *v ? std::atoi(v) : otherwise;
    };
    ContractWorld w;
    w.size = std::max(1, number("WORLD_SIZE", 1));
    w.rank = std::max(0, number("RANK", 0));
    w.local_size = std::max(1, number("LOCAL_WORLD_SIZE", w.size));
    const char* port = std::getenv("MASTER_PORT");
    // The ranks of one launch share their launcher (tk-plugin, torchrun's agent) and its port.
    w.tag = w.size > 1 ? "world-" + std::string(port ? port : "") + "-" + std::to_string(getppid())
                       : std::to_string(getpid());
    return w;
  }
  /// A folder for a check's run, the same on every rank (rank 0 writes a world's outputs, the others
  /// read its checkpoints), emptied by rank 0 before the check.
  fs::path scratch(const std::string& name) const {
    const fs::path d = fs::temp_directory_path() / ("tk-contract-" + tag + "-" + name);
    if (rank == 0) fs::remove_all(d);
    return d;
  }
  /// Removes a check's folder once its runs are over: rank 0's, the last to use it.
  void done_with(const fs::path& d) const {
    if (rank == 0) fs::remove_all(d);
  }
};

/// In a world, compares every rank's parameters with rank 0's after each optimizer step (a
/// collective: every rank runs it at every step), and keeps the first difference.
class RankAgreement final : public Plugin {
 public:
  void on_step_end(StepEndContext& ctx) override {
    std::vector<at::Tensor> flat;
    for (const auto& p : ctx.model().parameters()) flat.push_back(p.detach().flatten().to(at::kDouble));
    if (flat.empty()) return;
    const at::Tensor all = ctx.world().all_gather(at::cat(flat)).view({ctx.world().size(), -1});
    for (int r = 1; r < ctx.world().size() && difference.empty(); ++r) {
      if (all[r].equal(all[0])) continue;
      difference = "after step " + std::to_string(ctx.counters().step) + ", rank " + std::to_string(r) +
                   "'s parameters differ from rank 0's by up to " +
                   std::to_string((all[r] - all[0]).abs().max().item<double>());
    }
  }
  std::string difference;  ///< "" while every rank agrees
};

/// The contract's checks of one library, each returning "" when it holds, else why not.
class ContractChecks {
 public:
  ContractChecks(const fs::path& file, const ContractOptions& c) : file_(file), c_(c), world_(ContractWorld::from_environment()) {}

  const ContractWorld& world() const noexcept { return world_; }

  /// In a world of more than one, a run needs a plugin that sums the gradients across it (the core
  /// refuses it otherwise): the contract checks such a plugin there, and "" says this is one.
  std::string fits_the_world() const {
    if (world_.size == 1) return "";
    if (world_.local_size != world_.size)
      return "its runs share scratch folders on one machine (rank 0 writes the checkpoints the others resume "
             "from), but this world of " + std::to_string(world_.size) + " spans machines (LOCAL_WORLD_SIZE " +
             std::to_string(world_.local_size) + "): run it on one, with tk-plugin check --nproc";
    for (const Capability& c : instance(c_.options)->contract().provides)
      if (c == cap::kGradsSynced) return "";
    return "in a world of " + std::to_string(world_.size) + " every run needs a plugin that sums the gradients "
           "across it (provides " + cap::kGradsSynced.name() + "), and this one does not: check it in a world of one";
  }

  std::string ranks_agree() const {
    auto agreement = std::make_shared<RankAgreement>();
    auto r = run_with({instance(c_.options), {agreement, "rank_agreement"}});
    if (r.fit.steps < 1) return "the run took no step";
    return agreement->difference;
  }

  std::string loads_and_names_itself() const {
    auto lp = PluginLoader({}).load_plugin(file_);
    if (lp.name.empty()) return "its name is empty";
    if (lp.version.empty()) return "its version is empty";
    if (lp.plugin->name() != lp.name) return "the instance is named '" + lp.plugin->name() + "', not '" + lp.name + "'";
    Registry registry;
    PluginLoader({}).load(file_, registry);
    if (registry.plugins().front().doc.empty()) return "it registers no description (TK_PLUGIN's fourth argument)";
    instance("");  // its defaults are accepted
    return "";
  }

  std::string refuses_bad_options() const {
    const auto specs = fresh_specs();
    try {
      RunOptions o;
      o.libraries = {{file_, "definitely_not_an_option = 1"}};
      run(kTinyRecipe, o);
      return "an unknown option was accepted";
    } catch (const RecipeError& e) {
      const std::string m = e.what();
      if (m.find("unknown key 'definitely_not_an_option'") == std::string::npos) return "unclear error: " + m;
      for (const auto& s : specs)
        if (m.find(s.name) == std::string::npos) return "the error does not list option '" + s.name + "': " + m;
    }
    for (const auto& s : specs) {
      // A list of strings also takes one string (a list of one): a number is mistyped for it.
      const bool stringy = s.type == OptionType::String || s.type == OptionType::Path || s.type == OptionType::StringList;
      const std::string wrong = stringy ? "1" : "\"not a " + std::string(to_string(s.type)) + "\"";
      try {
        instance(s.name + " = " + wrong);
        return "option '" + s.name + "' accepted " + wrong;
      } catch (const RecipeError& e) {
        if (std::string(e.what()).find("expected") == std::string::npos) return "unclear error: " + std::string(e.what());
      }
    }
    return "";
  }

  std::string runs_every_hook() const {
    auto p = instance(c_.options);
    auto r = run_with({p});
    for (int i = 0; i < kEventCount; ++i) {
      const auto e = static_cast<Event>(i);
      if (!p->handles(e)) continue;
      const bool seen = std::any_of(r.trace.begin(), r.trace.end(),
                                    [&](const TraceEntry& t) { return t.event == e && t.plugin == p->name(); });
      if (!seen) return std::string("its ") + hook_name(e) + " hook never ran";
    }
    if (r.fit.steps < 1) return "the run took no step";
    return finite(r);
  }

  std::string round_trips_state() const {
    auto p = instance(c_.options);
    run_with({p});
    auto fresh = instance(c_.options);
    fresh->load_state(p->state());
    return same_state(p->state(), fresh->state(), "after loading it into a fresh instance");
  }

  std::string neutral_is_bit_identical() const {
    auto without = run_with({});
    auto with = run_with({instance(c_.neutral)});
    if (without.fit.steps != with.fit.steps)
      return std::to_string(with.fit.steps) + " steps instead of " + std::to_string(without.fit.steps);
    const double d = max_difference(without.parameters, with.parameters);
    return d == 0.0 ? "" : "the parameters differ by up to " + std::to_string(d);
  }

  std::string resume_equals_uninterrupted() const {
    const fs::path a = world_.scratch("whole"), b = world_.scratch("resumed");
    auto whole_plugin = instance(c_.options);
    RunOptions whole;
    whole.plugins = {whole_plugin};
    whole.output = a;
    auto full = run(kContractRecipe, whole);
    RunOptions first = whole;
    first.plugins = {instance(c_.options)};
    first.output = b;
    int boundaries = 0;
    first.stop_requested = [&boundaries] { return ++boundaries == 3; };
    auto stopped = run(kContractRecipe, first);
    auto resumed_plugin = instance(c_.options);
    RunOptions second = first;
    second.plugins = {resumed_plugin};
    second.stop_requested = nullptr;
    second.resume = "latest";
    auto resumed = run(kContractRecipe, second);
    world_.done_with(a);
    world_.done_with(b);
    if (stopped.fit.status != FitStatus::StoppedBySignal) return "the first half did not stop at its third boundary";
    const double d = max_difference(full.parameters, resumed.parameters);
    if (d != 0.0) return "the resumed run's parameters differ by up to " + std::to_string(d);
    return same_state(whole_plugin->state(), resumed_plugin->state(), "at the end of the resumed run");
  }

  std::string survives_a_veto() const {
    auto r = run_with({instance(c_.options), {std::make_shared<VetoAt>(std::set<int64_t>{1}), "veto_at"}});
    if (r.fit.skipped_steps < 1) return "the vetoed step was not skipped";
    return finite(r);
  }

  std::string fit_end_after_failure() const {
    try {
      run_with({instance(c_.options), {std::make_shared<ThrowAt>(2), "throw_at"}});
      return "the run did not fail";
    } catch (const PluginRuntimeError& e) {
      const std::string m = e.what();
      if (m.rfind("plugin 'throw_at'", 0) != 0 || m.find(" failed in event backward in step 3,") == std::string::npos)
        return "another error stood: " + m;
    }
    return "";
  }

 private:
  /// A new instance with the options given as TOML.
  std::shared_ptr<Plugin> instance(const std::string& toml) const { return load_plugin(file_, toml); }
  OptionSpecs fresh_specs() const {
    Registry registry;  // the specs a fresh instance declares, as its library registered them
    PluginLoader({}).load(file_, registry);
    return registry.plugins().front().specs;
  }
  RunResult run_with(std::vector<InProcess> plugins) const {
    RunOptions o;
    o.plugins = std::move(plugins);
    return run(kContractRecipe, o);
  }
  static std::string finite(const RunResult& r) {
    for (const auto& [name, t] : r.parameters)
      if (!at::isfinite(t).all().item<bool>()) return "parameter " + name + " is not finite";
    for (double l : r.fit.window_losses)
      if (!std::isfinite(l)) return "a window loss is not finite";
    return "";
  }
  /// "" when two states hold the same entries with the same values.
  static std::string same_state(const StateDict& want, const StateDict& got, const std::string& when) {
    if (got.size() != want.size())
      return "its state has " + std::to_string(got.size()) + " entries " + when + ", expected " + std::to_string(want.size());
    for (const auto& [k, v] : want) {
      auto it = got.find(k);
      if (it == got.end()) return "state entry '" + k + "' is missing " + when;
      const at::Tensor a = v.detach().cpu(), b = it->second.detach().cpu();
      if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes() || !a.equal(b))
        return "state entry '" + k + "' differs " + when;
    }
    return "";
  }

  fs::path file_;
  ContractOptions c_;
  ContractWorld world_;
};

}  // namespace

std::vector<CheckResult> check_contract(const fs::path& file, const ContractOptions& c) {
  const ContractChecks contract(file, c);
  std::vector<CheckResult> out;
  // In a world, every rank must run the same runs in the same order (each joins the world): after
  // a failure, which one rank may see alone, the rest is not run. Nor is it after a failure the
  // rest depends on. Either way each check not run is listed, saying why.
  std::string stopped;
  auto check = [&](const std::string& name, std::string (ContractChecks::*fn)() const) {
    CheckResult r{name, false, false, ""};
    if (!stopped.empty()) {
      out.push_back({name, false, true, "not run after the failed check '" + stopped + "'"});
      return;
    }
    try {
      r.detail = (contract.*fn)();
    } catch (const std::exception& e) {
      r.detail = std::string("threw: ") + e.what();
    }
    r.passed = r.detail.empty();
    if (!r.passed && contract.world().size > 1) stopped = name;
    out.push_back(std::move(r));
  };
  const int world = contract.world().size;
  check("loads, names and describes itself, and accepts its default options", &ContractChecks::loads_and_names_itself);
  if (!out.back().passed) stopped = out.back().name;  // nothing else can run
  if (world > 1) {
    check("sums the gradients across its world of " + std::to_string(world), &ContractChecks::fits_the_world);
    if (!out.back().passed && stopped.empty()) stopped = out.back().name;
  }
  check("refuses unknown and mistyped options, listing the valid ones", &ContractChecks::refuses_bad_options);
  check("runs every hook it keeps in a run with two epochs and validation", &ContractChecks::runs_every_hook);
  check("round-trips its state into a fresh instance", &ContractChecks::round_trips_state);
  if (world > 1) {
    check("every rank holds the same parameters after each step, to the bit", &ContractChecks::ranks_agree);
    out.push_back({"leaves a run bit-identical with neutral options", false, true,
                   "in a world of " + std::to_string(world) + " a run without it is refused: nothing to compare with"});
  } else if (c.check_neutral) {
    check("leaves a run bit-identical with neutral options", &ContractChecks::neutral_is_bit_identical);
  } else {
    out.push_back({"leaves a run bit-identical with neutral options", false, true,
                   "--neutral none: the plugin always changes the numerics"});
  }
  check("a run stopped at a checkpoint and resumed equals an uninterrupted one, its state included",
        &ContractChecks::resume_equals_uninterrupted);
  check("survives a vetoed step", &ContractChecks::survives_a_veto);
  check("gets on_fit_end after another plugin fails, and the first error stands", &ContractChecks::fit_end_after_failure);
  return out;
}

}  // namespace tk::testing
