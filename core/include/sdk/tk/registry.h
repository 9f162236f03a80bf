#pragma once
/// The open registry: every model, data set, loss, optimizer, LR schedule and strategy plugin a
/// recipe can name. trainkit's own components register here exactly as a user's library does.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tk/components.h"
#include "tk/options.h"
#include "tk/plugin.h"

// What this header declares is libtrainkit's interface: exported (the library hides the rest).
#pragma GCC visibility push(default)

namespace tk {

/// Makes a new instance of a strategy plugin.
using PluginMaker = std::function<std::unique_ptr<Plugin>()>;

/// The kinds of things a library can register.
enum class Kind { Model, Data, Loss, Optimizer, Schedule, Plugin };
/// "model", "data", "loss", "optimizer", "schedule", "plugin": the recipe section that selects it.
const char* to_string(Kind k) noexcept;

/// One named, documented constructor, and the library it came from.
template <class Maker>
struct Component {
  /// Keeps the library that registered it loaded; first, so that it is released last.
  std::shared_ptr<const void> keep;
  std::string name;
  std::string doc;
  OptionSpecs specs;  ///< for plugins, what a fresh instance declares in Plugin::bind
  Maker make;
  std::string library;  ///< file that registered it ("(in-process)" for code)
};

#pragma GCC visibility push(hidden)  // the core's own: not exported
namespace detail {
struct RegistryAccess;
}  // namespace detail
#pragma GCC visibility pop

class Registry {
 public:
  Registry();
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  /// Registers a model. A name registered twice (by two libraries) is refused, naming both files.
  Registry& add_model(std::string name, std::string doc, OptionSpecs specs, ModelMaker make);
  Registry& add_data(std::string name, std::string doc, OptionSpecs specs, DataMaker make);
  Registry& add_loss(std::string name, std::string doc, OptionSpecs specs, LossMaker make);
  Registry& add_optimizer(std::string name, std::string doc, OptionSpecs specs, OptimizerMaker make);
  Registry& add_schedule(std::string name, std::string doc, OptionSpecs specs, ScheduleMaker make);
  /// Registers a strategy plugin, selected by `[[plugins]] name = "..."`: `make` returns a
  /// std::unique_ptr of the plugin's own class (from which the core reads the hooks it overrides).
  /// Its options are checked now (Plugin::bind on a fresh instance).
  template <class Make>
  Registry& add_plugin(std::string name, std::string doc, Make make) {
    using T = typename decltype(make())::element_type;
    static_assert(detail::is_plugin_type_v<T>,
                  "add_plugin: return std::unique_ptr<YourPlugin>, not std::unique_ptr<tk::Plugin>: the core reads "
                  "from the class which hooks it overrides");
    return add_plugin_maker(std::move(name), std::move(doc), [make = std::move(make)]() -> std::unique_ptr<Plugin> {
      auto p = make();
      if (p) set_class_hooks(*p, detail::hooks_for<T>(*p));
      return p;
    });
  }

  /// Makes `name` the component a recipe's section of `kind` gets when it names none ([schedule]
  /// left out is trainkit's "constant"). One default per kind: a second library's is refused,
  /// naming both files. The component may be registered before or after.
  Registry& set_default(Kind kind, std::string name);
  /// The default component of `kind` (set_default), or "" when no library set one.
  std::string default_of(Kind kind) const;

  const std::vector<Component<ModelMaker>>& models() const noexcept;
  const std::vector<Component<DataMaker>>& data() const noexcept;
  const std::vector<Component<LossMaker>>& losses() const noexcept;
  const std::vector<Component<OptimizerMaker>>& optimizers() const noexcept;
  const std::vector<Component<ScheduleMaker>>& schedules() const noexcept;
  const std::vector<Component<PluginMaker>>& plugins() const noexcept;

  /// A new instance of plugin `name` (named, and tied to its library), or null when none is registered.
  std::shared_ptr<Plugin> make_plugin(const std::string& name) const;

  /// Whether the library file was registered already (a library registers once per registry).
  bool has_library(const std::string& file) const;
  /// Names registered by `file`, as "kind name" pairs in registration order.
  std::vector<std::pair<Kind, std::string>> registered_by(const std::string& file) const;

 private:
  friend struct detail::RegistryAccess;
  Registry& add_plugin_maker(std::string name, std::string doc, PluginMaker make);
  /// Records the hooks the core calls on an instance (add_plugin's factory does, as it makes it).
  static void set_class_hooks(Plugin& plugin, uint32_t hooks) noexcept;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The component called `name` in `list`, or nullptr.
template <class Maker>
const Component<Maker>* find_component(const std::vector<Component<Maker>>& list, const std::string& name) {
  for (const auto& c : list)
    if (c.name == name) return &c;
  return nullptr;
}
/// The names in `list`, in registration order.
template <class Maker>
std::vector<std::string> component_names(const std::vector<Component<Maker>>& list) {
  std::vector<std::string> out;
  out.reserve(list.size());
  for (const auto& c : list) out.push_back(c.name);
  return out;
}

}  // namespace tk

#pragma GCC visibility pop
