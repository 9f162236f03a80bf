#pragma once
// The assemble layer: a run built from its recipe. [run] read, the standard libraries and every
// [[plugins]] entry's loaded, the plugins made and given their options, then data, model, loss
// and schedule from their sections; the optimizer made over the trainable parameters. Not
// installed.
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "run/run.h"
#include "tk/trainer.h"

namespace tk::detail {

// ---- libraries.cpp: the recipe's libraries and plugins ---------------------------------------------

/// Reads [run], loads trainkit's standard libraries and every `[[plugins]]` library, makes the
/// plugins with their options, and builds data, model, loss and schedule (components.cpp).
void assemble(Run& run, const Recipe& recipe, const TrainerOptions& opts);
/// Adds a plugin made in code: prepared already, or prepared here with `name` and `options` (TOML).
void add_plugin(Run& run, std::shared_ptr<Plugin> plugin, const std::string& name, const std::string& options,
                uint32_t hooks);
/// What a launcher needs to know of a recipe's plugins without building a run: the capabilities
/// they provide. The recipe's sections and the plugins' options are checked on the way (plugins
/// loaded and given their options; no data, model or memory trial).
std::set<std::string> provided_capabilities(const Recipe& recipe, const TrainerOptions& opts);
/// What the run's plugins provide, each capability beside the plugin's name, in the plugins' order
/// (each contract asked once, as a call of its plugin).
std::vector<std::pair<std::string, Capability>> provided(Run& run);

// ---- components.cpp: [run] and the components of the recipe's sections -----------------------------

/// The recipe's [batch] section: its option specs (planning/geometry.cpp reads it).
OptionSpecs batch_specs();
/// The settings of [run]: bound, dtype, device, time limit; [world] and [batch] read.
void read_run_section(Run& run, const Recipe& recipe);
/// Data, model, loss, optimizer (checked now, made after setup) and schedule.
void build_components(Run& run, const Recipe& recipe);
/// Runs `build` (the model's making and the checks that it fits); a refusal for memory (require_memory)
/// says, where a plugin shards the parameters, that each rank still builds the whole model.
void building_model(Run& run, const std::function<void()>& build);
/// The component sections' names and options checked against what is registered, nothing made
/// (what a launcher checks before it starts workers).
void check_component_sections(Run& run, const Recipe& recipe);
/// Makes the optimizer over the model's trainable parameters (again, after a trial step).
void make_optimizer(Run& run);
/// Ends a window's gradients (after the optimizer step, a back-off, before training): releases
/// them, so that the next backward writes each gradient afresh instead of adding it into zeros;
/// or, where a plugin keeps them (RunPlan::keep_gradients: data parallel's gradients are views of
/// its buckets), zeroes them in place, keeping their storage, on every LibTorch (2.x's zero_grad
/// drops them, 1.x's detaches them in place, which views refuse).
void clear_grads(Run& run);
/// Gives a zero gradient to each of the optimizer's parameters that has none (no micro-batch of
/// the window reached it, or the gradients were released): before the boundary, every trainable
/// parameter holds one, so a step that does not use a parameter steps it with a zero gradient in
/// a fresh run, a resumed one and on every rank alike.
void complete_grads(Run& run);

}  // namespace tk::detail
