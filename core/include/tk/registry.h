#pragma once
/// The open registry: every model, data set, loss, optimizer, LR schedule and strategy plugin a
/// recipe can name. trainkit's own components register here exactly as a user's library does.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tk/components.h"
#include "tk/options.h"

namespace tk {

class Plugin;
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
  OptionSpecs specs;  ///< empty for plugins: they declare options themselves (Plugin::option_specs)
  Maker make;
  std::string library;  ///< file that registered it ("(in-process)" for code)
};

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
  /// Registers a strategy plugin, selected by `[[plugins]] name = "..."`.
  Registry& add_plugin(std::string name, std::string doc, PluginMaker make);

  const std::vector<Component<ModelMaker>>& models() const noexcept { return models_; }
  const std::vector<Component<DataMaker>>& data() const noexcept { return data_; }
  const std::vector<Component<LossMaker>>& losses() const noexcept { return losses_; }
  const std::vector<Component<OptimizerMaker>>& optimizers() const noexcept { return optimizers_; }
  const std::vector<Component<ScheduleMaker>>& schedules() const noexcept { return schedules_; }
  const std::vector<Component<PluginMaker>>& plugins() const noexcept { return plugins_; }

  /// A new instance of plugin `name` (named, and tied to its library), or null when none is registered.
  std::shared_ptr<Plugin> make_plugin(const std::string& name) const;

  /// Whether the library file was registered already (a library registers once per registry).
  bool has_library(const std::string& file) const;
  /// Names registered by `file`, as "kind name" pairs in registration order.
  std::vector<std::pair<Kind, std::string>> registered_by(const std::string& file) const;

  /// Sets the origin recorded for what is registered next (the loader calls it around a library's
  /// registration function); `keep` keeps that library loaded.
  void set_origin(std::string file, std::shared_ptr<const void> keep);

 private:
  template <class Maker>
  Registry& add(Kind kind, std::vector<Component<Maker>>& list, std::string name, std::string doc, OptionSpecs specs,
                Maker make);

  std::vector<Component<ModelMaker>> models_;
  std::vector<Component<DataMaker>> data_;
  std::vector<Component<LossMaker>> losses_;
  std::vector<Component<OptimizerMaker>> optimizers_;
  std::vector<Component<ScheduleMaker>> schedules_;
  std::vector<Component<PluginMaker>> plugins_;
  std::vector<std::string> libraries_;
  std::vector<std::pair<std::string, std::pair<Kind, std::string>>> origins_;
  std::string origin_ = "(in-process)";
  std::shared_ptr<const void> keep_;
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
