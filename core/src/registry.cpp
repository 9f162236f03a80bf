#include "tk/registry.h"

#include <algorithm>

#include "tk/error.h"
#include "tk/plugin.h"

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

Registry::Registry() = default;
Registry::~Registry() = default;

template <class Maker>
Registry& Registry::add(Kind kind, std::vector<Component<Maker>>& list, std::string name, std::string doc,
                        OptionSpecs specs, Maker make) {
  const std::string what = std::string(to_string(kind)) + " '" + name + "'";
  if (name.empty()) throw PluginLoadError(origin_ + ": registers a " + to_string(kind) + " with an empty name");
  if (!make) throw PluginLoadError(origin_ + ": registers " + what + " without a constructor");
  if (const auto* old = find_component(list, name))
    throw PluginLoadError(what + " is registered twice: by " + old->library + " and by " + origin_ +
                          "; remove one of the libraries from the run, or rename one");
  list.push_back({keep_, std::move(name), std::move(doc), std::move(specs), std::move(make), origin_});
  origins_.push_back({origin_, {kind, list.back().name}});
  return *this;
}

Registry& Registry::add_model(std::string name, std::string doc, OptionSpecs specs, ModelMaker make) {
  return add(Kind::Model, models_, std::move(name), std::move(doc), std::move(specs), std::move(make));
}
Registry& Registry::add_data(std::string name, std::string doc, OptionSpecs specs, DataMaker make) {
  return add(Kind::Data, data_, std::move(name), std::move(doc), std::move(specs), std::move(make));
}
Registry& Registry::add_loss(std::string name, std::string doc, OptionSpecs specs, LossMaker make) {
  return add(Kind::Loss, losses_, std::move(name), std::move(doc), std::move(specs), std::move(make));
}
Registry& Registry::add_optimizer(std::string name, std::string doc, OptionSpecs specs, OptimizerMaker make) {
  return add(Kind::Optimizer, optimizers_, std::move(name), std::move(doc), std::move(specs), std::move(make));
}
Registry& Registry::add_schedule(std::string name, std::string doc, OptionSpecs specs, ScheduleMaker make) {
  return add(Kind::Schedule, schedules_, std::move(name), std::move(doc), std::move(specs), std::move(make));
}
Registry& Registry::add_plugin(std::string name, std::string doc, PluginMaker make) {
  return add(Kind::Plugin, plugins_, std::move(name), std::move(doc), {}, std::move(make));
}

std::shared_ptr<Plugin> Registry::make_plugin(const std::string& name) const {
  const auto* c = find_component(plugins_, name);
  if (!c) return nullptr;
  std::unique_ptr<Plugin> p;
  try {
    p = c->make();
  } catch (const std::exception& e) {
    throw PluginLoadError(c->library + ": plugin '" + name + "' failed to construct: " + message_of(e));
  }
  if (!p) throw PluginLoadError(c->library + ": plugin '" + name + "' factory returned null");
  p->set_name(name);
  // The deleter holds the library: its code stays mapped until the instance is gone.
  return std::shared_ptr<Plugin>(p.release(), [keep = c->keep](Plugin* raw) mutable {
    delete raw;
    keep.reset();
  });
}

bool Registry::has_library(const std::string& file) const {
  return std::find(libraries_.begin(), libraries_.end(), file) != libraries_.end();
}

std::vector<std::pair<Kind, std::string>> Registry::registered_by(const std::string& file) const {
  std::vector<std::pair<Kind, std::string>> out;
  for (const auto& [f, entry] : origins_)
    if (f == file) out.push_back(entry);
  return out;
}

void Registry::set_origin(std::string file, std::shared_ptr<const void> keep) {
  if (keep && !has_library(file)) libraries_.push_back(file);
  origin_ = std::move(file);
  keep_ = std::move(keep);
}

}  // namespace tk
