// The libraries a run loads (trainkit's standard ones, then every [[plugins]] entry's) and the
// plugins they make, each named, given its options and checked before anything else is built.
#include <spdlog/spdlog.h>

#include <algorithm>

#include "assemble/assemble.h"
#include "tk/capabilities.h"
#include "tk/loader.h"

namespace fs = std::filesystem;

namespace tk::detail {
namespace {

const std::vector<std::string> kSections = {"run", "world", "batch", "model", "data", "loss", "optimizer", "schedule", "plugins"};

/// What a `[[plugins]]` entry resolves to: the library it loaded and the plugin it names ("" for
/// a library that only registers components).
struct Resolved {
  std::string plugin, version, file, library;
};

std::string listed(const std::vector<std::string>& names) { return join(names.data(), names.data() + names.size()); }

/// The strategies `file` registered into `registry`.
std::vector<std::string> strategies_of(const Registry& registry, const fs::path& file) {
  std::vector<std::string> out;
  for (const auto& [kind, name] : registry.registered_by(fs::weakly_canonical(file).string()))
    if (kind == Kind::Plugin) out.push_back(name);
  return out;
}

/// An entry given by name: a plugin registered already, else the library tk_<name>.so on the path.
Resolved resolve_by_name(Registry& registry, const PluginLoader& loader, const PluginEntry& e) {
  if (const auto* c = find_component(registry.plugins(), e.name)) return {e.name, "", c->library, e.name};
  const fs::path file = loader.find(e.name);
  const LibraryInfo info = loader.load(file, registry);
  const auto names = strategies_of(registry, file);
  if (find_component(registry.plugins(), e.name)) return {e.name, info.version, file.string(), info.name};
  // `name` named the library: its one strategy (if any) is the entry's.
  if (names.size() <= 1) return {names.empty() ? "" : names.front(), info.version, file.string(), info.name};
  throw PluginLoadError(file.string() + " registers plugins " + listed(names) + ", none called '" + e.name +
                        "': give `path = \"" + file.string() + "\"` and `name = ` one of them");
}

Resolved resolve_entry(Registry& registry, const PluginLoader& loader, const PluginEntry& e) {
  if (e.path.empty()) return resolve_by_name(registry, loader, e);
  const LibraryInfo info = loader.load(e.path, registry);
  const auto names = strategies_of(registry, e.path);
  if (e.name.empty()) {
    if (names.size() > 1)
      throw PluginLoadError(e.path.string() + " registers plugins " + listed(names) + ": say which one with `name = \"...\"`");
    return {names.empty() ? "" : names.front(), info.version, e.path.string(), info.name};
  }
  if (std::find(names.begin(), names.end(), e.name) == names.end())
    throw PluginLoadError(e.path.string() + " is plugin '" + (names.empty() ? info.name : listed(names)) +
                          "', but the recipe asks for '" + e.name + "'");
  return {e.name, info.version, e.path.string(), info.name};
}

/// Loads trainkit's own component libraries, always from its own plugins folder: a recipe's
/// tk_data.so cannot shadow them.
void load_standard_libraries(Registry& registry) {
  const PluginLoader own({PluginLoader::own_dir()});
  for (const auto& lib : PluginLoader::standard_libraries()) {
    fs::path file;
    try {
      file = own.find(lib);
    } catch (const PluginLoadError& e) {
      throw PluginLoadError("trainkit's standard library '" + lib + "' is missing (the installation is incomplete): " +
                            e.what());
    }
    own.load(file, registry);
  }
}

/// Entry `i`'s plugin, named and given the entry's options; its slot.
Slot make_entry_plugin(Run& r, const Recipe& recipe, size_t i, const PluginEntry& e, const PluginLoader& loader) {
  Resolved res;
  std::shared_ptr<Plugin> plugin;
  try {
    res = resolve_entry(r.registry, loader, e);
    if (!res.plugin.empty()) plugin = r.registry.make_plugin(res.plugin);
  } catch (const PluginLoadError& err) {
    throw PluginLoadError(e.where.str() + ": " + err.what());
  }
  for (const auto& slot : r.slots)
    if (plugin && slot.plugin && slot.name == res.plugin)
      throw PluginLoadError(e.where.str() + ": plugin '" + res.plugin +
                            "' is already in this run: one instance per plugin (its checkpoint state and "
                            "--set plugins." + res.plugin + ".* would be ambiguous)");
  Options options;
  auto values = [&](const OptionSpecs& specs) { return options = recipe.plugin_options(i, specs); };
  if (!plugin) {  // a library of components: nothing to dispatch to
    values({});
  } else {
    try {
      configure_options(*plugin, values);
    } catch (const RecipeError&) {
      throw;
    } catch (const std::exception& err) {
      throw PluginLoadError(e.where.str() + ": plugin '" + res.plugin + "' (" + res.file +
                            ") rejected its options: " + message_of(err));
    }
  }
  // Retired options are neither the run's recipe nor its identity (ResolvedRecipe leaves them out).
  r.resolved.add_plugin(recipe.plugin_label(i), e.name, e.path.string(), options);
  return {plugin, plugin ? res.plugin : res.library, res.version, res.file};
}

/// Loads every `[[plugins]]` library (their components become selectable) and makes the plugins.
void load_plugins(Run& r, const Recipe& recipe, const PluginLoader& loader) {
  const auto entries = recipe.plugins();
  for (size_t i = 0; i < entries.size(); ++i) r.slots.push_back(make_entry_plugin(r, recipe, i, entries[i], loader));
}

PluginLoader loader_for(const Recipe& recipe, const TrainerOptions& opts) {
  return PluginLoader(opts.plugin_dirs ? *opts.plugin_dirs : PluginLoader::default_dirs(recipe.dir()));
}

}  // namespace

void assemble(Run& r, const Recipe& recipe, const TrainerOptions& opts) {
  recipe.check_sections(kSections);
  r.may_join_world = opts.join_world;
  r.stop_requested = opts.stop_requested;
  machine_memory_bytes();  // a bad TK_MACHINE_MEMORY refused here, not by the first component to check its memory
  read_run_section(r, recipe);
  load_standard_libraries(r.registry);
  load_plugins(r, recipe, loader_for(recipe, opts));
  build_components(r, recipe);
}

std::vector<std::pair<std::string, Capability>> provided(Run& r) {
  std::vector<std::pair<std::string, Capability>> out;
  for (const auto& s : r.slots)
    if (s.plugin) r.call_plugin(s, "contract", [&] {
        for (const auto& cap : s.plugin->contract().provides) out.emplace_back(s.name, cap);
      });
  return out;
}

std::set<std::string> provided_capabilities(const Recipe& recipe, const TrainerOptions& opts) {
  recipe.check_sections(kSections);
  Run r;
  std::set<std::string> out;
  // Errors leave as objects made here, while the libraries whose code threw are still loaded.
  try {
    read_run_section(r, recipe);
    load_standard_libraries(r.registry);
    load_plugins(r, recipe, loader_for(recipe, opts));
    check_component_sections(r, recipe);
    for (const auto& [plugin, cap] : provided(r)) out.insert(cap.name());
  } catch (const RecipeError& e) {
    throw RecipeError(e);
  } catch (const PluginLoadError& e) {
    throw PluginLoadError(e.what());
  } catch (const std::exception& e) {
    throw Error(message_of(e));
  }
  return out;
}

void building_model(Run& r, const std::function<void()>& build) {
  try {
    build();
  } catch (const MemoryRefusal& e) {
    // Where the run shards its parameters the user counts on a share of the weights: say why not here.
    for (const auto& [plugin, cap] : provided(r)) {
      if (!(cap == cap::kParamsSharded)) continue;
      throw MemoryRefusal(e.where(), e.bare() + "; with " + cap::kParamsSharded.name() + " (plugin '" + plugin +
                                         "') each rank still builds the whole model, and shards it after");
    }
    throw;
  }
}

void add_plugin(Run& r, std::shared_ptr<Plugin> plugin, const std::string& name, const std::string& options,
                uint32_t hooks) {
  if (r.planned) throw Error("add_plugin() must come before the run is planned (fit, describe, plan, optimizer)");
  if (!plugin) throw Error("add_plugin() was given a null plugin");
  if (is_prepared(*plugin)) {
    if ((!name.empty() && name != plugin->name()) || !options.empty())
      throw Error("plugin '" + plugin->name() + "' is prepared already (named, with its options): add it without a "
                  "name or options");
  } else if (!plugin->name().empty()) {  // made by a registry: named, options still to come
    configure_options(*plugin, options);
  } else {
    prepare_plugin(*plugin, name, options, hooks);
  }
  for (const auto& slot : r.slots)
    if (slot.plugin && slot.name == plugin->name())
      throw Error("plugin '" + plugin->name() + "' is already in this run: one instance per plugin");
  r.slots.push_back({plugin, plugin->name(), "(in-process)", "(in-process)"});
}

}  // namespace tk::detail
