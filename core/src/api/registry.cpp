#include "tk/registry.h"

#include <algorithm>
#include <map>

#include "api/api.h"
#include "tk/error.h"

namespace tk {

const char* to_string(Kind k) noexcept {
  switch (k) {
    case Kind::Model: return "model";
    case Kind::Data: return "data";
    case Kind::Loss: return "loss";
    case Kind::Optimizer: return "optimizer";
    case Kind::Schedule: return "schedule";
    case Kind::Plugin: return "plugin";
  }
  return "?";
}

struct Registry::Impl {
  std::vector<Component<ModelMaker>> models;
  std::vector<Component<DataMaker>> data;
  std::vector<Component<LossMaker>> losses;
  std::vector<Component<OptimizerMaker>> optimizers;
  std::vector<Component<ScheduleMaker>> schedules;
  std::vector<Component<PluginMaker>> plugins;
  std::vector<std::string> libraries;
  std::map<Kind, std::pair<std::string, std::string>> defaults;  ///< kind -> (component, library)
  std::vector<std::pair<std::string, std::pair<Kind, std::string>>> origins;
  std::string origin = "(in-process)";
  std::shared_ptr<const void> keep;

  template <class Maker>
  Component<Maker>& add(Kind kind, std::vector<Component<Maker>>& list, std::string name, std::string doc,
                        OptionSpecs specs, Maker make) {
    const std::string what = std::string(to_string(kind)) + " '" + name + "'";
    if (name.empty()) throw PluginLoadError(origin + ": registers a " + to_string(kind) + " with an empty name");
    if (!make) throw PluginLoadError(origin + ": registers " + what + " without a constructor");
    if (const auto* old = find_component(list, name))
      throw PluginLoadError(what + " is registered twice: by " + old->library + " and by " + origin +
                            "; remove one of the libraries from the run, or rename one");
    list.push_back({keep, std::move(name), std::move(doc), std::move(specs), std::move(make), origin});
    origins.push_back({origin, {kind, list.back().name}});
    return list.back();
  }
};

Registry::Registry() : impl_(std::make_unique<Impl>()) {}
Registry::~Registry() = default;

Registry& Registry::add_model(std::string name, std::string doc, OptionSpecs specs, ModelMaker make) {
  impl_->add(Kind::Model, impl_->models, std::move(name), std::move(doc), std::move(specs), std::move(make));
  return *this;
}
Registry& Registry::add_data(std::string name, std::string doc, OptionSpecs specs, DataMaker make) {
  impl_->add(Kind::Data, impl_->data, std::move(name), std::move(doc), std::move(specs), std::move(make));
  return *this;
}
Registry& Registry::add_loss(std::string name, std::string doc, OptionSpecs specs, LossMaker make) {
  impl_->add(Kind::Loss, impl_->losses, std::move(name), std::move(doc), std::move(specs), std::move(make));
  return *this;
}
Registry& Registry::add_optimizer(std::string name, std::string doc, OptionSpecs specs, OptimizerMaker make) {
  impl_->add(Kind::Optimizer, impl_->optimizers, std::move(name), std::move(doc), std::move(specs), std::move(make));
  return *this;
}
Registry& Registry::add_schedule(std::string name, std::string doc, OptionSpecs specs, ScheduleMaker make) {
  impl_->add(Kind::Schedule, impl_->schedules, std::move(name), std::move(doc), std::move(specs), std::move(make));
  return *this;
}

void Registry::set_class_hooks(Plugin& plugin, uint32_t hooks) noexcept { detail::PluginAccess::state(plugin).hooks = hooks; }

Registry& Registry::add_plugin_maker(std::string name, std::string doc, PluginMaker make) {
  auto& c = impl_->add(Kind::Plugin, impl_->plugins, std::move(name), std::move(doc), {}, std::move(make));
  // Its options, checked now: a fresh instance declares them.
  try {
    std::unique_ptr<Plugin> probe = c.make();
    if (!probe) throw Error("its factory returned null");
    c.specs = detail::declared_options(*probe);
  } catch (const std::exception& e) {
    const std::string what = "plugin '" + c.name + "'";
    const std::string origin = impl_->origin;
    impl_->plugins.pop_back();
    impl_->origins.pop_back();
    throw PluginLoadError(origin + ": " + what + ": " + message_of(e));
  }
  return *this;
}

Registry& Registry::set_default(Kind kind, std::string name) {
  const std::string what = std::string("the default ") + to_string(kind);
  if (name.empty()) throw PluginLoadError(impl_->origin + ": sets " + what + " to an empty name");
  auto it = impl_->defaults.find(kind);
  if (it != impl_->defaults.end() && it->second.first != name)
    throw PluginLoadError(what + " is set twice: to '" + it->second.first + "' by " + it->second.second + " and to '" +
                          name + "' by " + impl_->origin + "; remove one of the libraries from the run");
  impl_->defaults[kind] = {std::move(name), impl_->origin};
  return *this;
}

std::string Registry::default_of(Kind kind) const {
  auto it = impl_->defaults.find(kind);
  return it == impl_->defaults.end() ? std::string() : it->second.first;
}

const std::vector<Component<ModelMaker>>& Registry::models() const noexcept { return impl_->models; }
const std::vector<Component<DataMaker>>& Registry::data() const noexcept { return impl_->data; }
const std::vector<Component<LossMaker>>& Registry::losses() const noexcept { return impl_->losses; }
const std::vector<Component<OptimizerMaker>>& Registry::optimizers() const noexcept { return impl_->optimizers; }
const std::vector<Component<ScheduleMaker>>& Registry::schedules() const noexcept { return impl_->schedules; }
const std::vector<Component<PluginMaker>>& Registry::plugins() const noexcept { return impl_->plugins; }

std::shared_ptr<Plugin> Registry::make_plugin(const std::string& name) const {
  const auto* c = find_component(impl_->plugins, name);
  if (!c) return nullptr;
  std::unique_ptr<Plugin> p;
  try {
    p = c->make();
  } catch (const std::exception& e) {
    throw PluginLoadError(c->library + ": plugin '" + name + "' failed to construct: " + message_of(e));
  }
  if (!p) throw PluginLoadError(c->library + ": plugin '" + name + "' factory returned null");
  detail::name_plugin(*p, name);
  // The deleter holds the library: its code stays mapped until the instance is gone.
  return std::shared_ptr<Plugin>(p.release(), [keep = c->keep](Plugin* raw) mutable {
    delete raw;
    keep.reset();
  });
}

bool Registry::has_library(const std::string& file) const {
  return std::find(impl_->libraries.begin(), impl_->libraries.end(), file) != impl_->libraries.end();
}

std::vector<std::pair<Kind, std::string>> Registry::registered_by(const std::string& file) const {
  std::vector<std::pair<Kind, std::string>> out;
  for (const auto& [f, entry] : impl_->origins)
    if (f == file) out.push_back(entry);
  return out;
}

void detail::RegistryAccess::set_origin(Registry& r, std::string file, std::shared_ptr<const void> keep) {
  if (keep && !r.has_library(file)) r.impl_->libraries.push_back(file);
  r.impl_->origin = std::move(file);
  r.impl_->keep = std::move(keep);
}

}  // namespace tk
