#pragma once
// The run's data: what a run is made of, from its libraries to its windows. A plain struct and
// its small accessors; the functions that fill and change it live with their layer (assemble/,
// planning/, persist/, loop/). Not installed.
#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "api/api.h"
#include "world/world.h"
#include "tk/components.h"
#include "tk/plugin.h"
#include "tk/recipe.h"
#include "tk/registry.h"

namespace tk::detail {

/// Counts of steps, micro-batches or examples beyond this (~10^12) are beyond any machine: they are
/// refused rather than left to overflow.
constexpr int64_t kMaxCount = int64_t{1} << 40;

/// One `[[plugins]]` entry (or a plugin added in code). A library that only registers components
/// has no instance.
struct Slot {
  std::shared_ptr<Plugin> plugin;
  std::string name, version, file;
  /// "plugin 'name' (its file)", as errors name it.
  std::string label() const {
    return "plugin '" + name + "'" + (file.empty() ? "" : file.front() == '(' ? " " + file : " (" + file + ")");
  }
};

/// Everything a run is made of. assemble() fills the components from a recipe; plan_run() settles
/// the plan, runs the plugins' setup and makes the optimizer.
struct Run {
  Registry registry;  // first: the libraries outlive everything made from them
  // Second: a plugin added in code may hold the only handle on its library, and its setup may
  // have put that library's code into the model; the model, data and optimizer go first.
  std::vector<Slot> slots;
  Dispatch dispatch;    // who the core calls now (setup, configure, write_files)
  // Before the model and the optimizer, which may hold on to it (a sharded optimizer does).
  std::unique_ptr<ProcessWorld> world;  ///< from the environment at assembly; joined when first needed
  bool may_join_world = true;           ///< false for a dry run, which plans rank 0 alone
  std::function<bool()> stop_requested;  ///< TrainerOptions' (a signal): also ends a wait for the other ranks

  Options run, world_opts, batch_opts, data_opts, model_opts, loss_opts, opt_opts, sched_opts;
  std::string model_name, data_name, loss_name, opt_name, sched_name;
  ResolvedRecipe resolved;  // what the run was made of, section by section
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  uint64_t seed = 0;
  Bound bound;
  double max_time_s = 0;
  bool tracing = false;  // run.trace, read once: dispatch is on the per-micro-batch path

  DataSplits data;
  ModelPtr model;
  std::unique_ptr<LossFn> loss;
  const Component<OptimizerMaker>* optimizer_maker = nullptr;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  /// The plugins' optimizer wraps (SetupContext::wrap_optimizer), in dispatch order.
  std::vector<std::pair<std::string, OptimizerWrap>> optimizer_wraps;
  std::pair<std::string, MemoryLever> memory_lever;  ///< offered in setup (empty name: none)
  std::unique_ptr<LrSchedule> schedule;
  double base_lr = 0.0;

  bool planned = false;
  std::string planning_error;  // why planning failed: setup may have changed the model, no retry
  PlanState plan;
  std::vector<size_t> order;  // dispatch order of slots that hold a plugin
  int64_t batches_per_epoch = 0, total_steps = 0;
  std::unique_ptr<WindowSchedule> windows;
  std::vector<std::string> warnings;

  Run();
  void warn(const std::string& msg);
  /// warn, unless said already this run: what planning again (a trial step, a back-off) finds again.
  void warn_once(const std::string& msg);
  /// Examples this rank sees per epoch: all of them alone; with several ranks, an equal share
  /// (the remainder of the division, under world_size examples, is left out of that epoch).
  int64_t shard_size() const { return data.train->size() / plan.world_size; }
  /// This rank's examples of `epoch`, in order: the same seeded shuffle on every rank, strided by rank.
  at::Tensor shard_order(int64_t epoch) const;
  /// The examples at `indices` of `ds`, on the run's device; floating tensors in the run's dtype.
  Batch fetch(const Dataset& ds, const at::Tensor& indices) const;
  /// A batch tensor moved to `to`: floating ones in the run's dtype, others as they are.
  at::Tensor place(const at::Tensor& t, at::Device to, bool non_blocking = false) const;
  /// Runs `fn` as plugin `slot`'s hook `hook` (configure, setup, write_files, load_state), its
  /// failure reported with the plugin's name and file.
  void call_plugin(const Slot& slot, const char* hook, const std::function<void()>& fn);
};

}  // namespace tk::detail
