// The plugin base: the state the core keeps for each instance, option binding, dispatch.
#include "tk/plugin.h"

#include <algorithm>

#include "api/api.h"
#include "tk/error.h"
#include "tk/recipe.h"

namespace tk {

Plugin::Plugin() : state_(std::make_unique<detail::PluginState>()) {}
Plugin::~Plugin() = default;

const std::string& Plugin::name() const noexcept { return state_->name; }
const Options& Plugin::options() const noexcept { return state_->options; }

bool Plugin::handles(Event e) const noexcept {
  const uint32_t bit = 1u << static_cast<unsigned>(e);
  return (state_->hooks & bit) != 0 && (state_->declined & bit) == 0;
}

void Plugin::decline(Event e) noexcept { state_->declined |= 1u << static_cast<unsigned>(e); }

void Plugin::fail_bound(const void* member, const std::string& what) const {
  for (const auto& [m, option] : state_->bound)
    if (m == member) state_->options.fail(option, what);
  throw Error("plugin '" + state_->name + "': fail_option was given a member that no option is bound to (" + what + ")");
}

bool Plugin::given_bound(const void* member) const {
  for (const auto& [m, option] : state_->bound)
    if (m == member) return state_->options.is_set(option);
  throw Error("plugin '" + state_->name + "': option_given was given a member that no option is bound to");
}

// ---- OptionBinder -------------------------------------------------------------------------------

OptionBinder::OptionBinder() : state_(std::make_unique<detail::BinderState>()) {}
OptionBinder::~OptionBinder() = default;

const OptionSpecs& OptionBinder::specs() const { return state_->specs; }

namespace {

/// A typed option: the member gets the value of the spec's type.
template <class T>
OptionBinder& declare(OptionBinder& b, OptionSpec spec, T& member) {
  return detail::BinderState::of(b).declare(b, std::move(spec), &member,
                                            [&member](const OptionValue& v) { member = std::get<T>(v); });
}

}  // namespace

namespace detail {

OptionBinder& BinderState::declare(OptionBinder& b, OptionSpec spec, const void* member,
                                   std::function<void(const OptionValue&)> assign_to) {
  if (spec.name.empty()) throw Error("an option has an empty name");
  if (spec.name == "name" || spec.name == "path")
    throw Error("option '" + spec.name + "' is reserved: it selects the library in a [[plugins]] entry");
  for (const auto& other : specs)
    if (other.name == spec.name) throw Error("option '" + spec.name + "' is declared twice");
  if (spec.doc.empty()) throw Error("option '" + spec.name + "' has no doc");
  for (const void* m : members)
    if (m == member) throw Error("option '" + spec.name + "' is bound to a member another option is bound to");
  specs.push_back(std::move(spec));
  members.push_back(member);
  assign.push_back(std::move(assign_to));
  return b;
}

}  // namespace detail

OptionBinder& OptionBinder::add(const std::string& name, bool& m, const std::string& doc) {
  return declare(*this, opt_bool(name, m, doc), m);
}
OptionBinder& OptionBinder::add(const std::string& name, int64_t& m, const std::string& doc) {
  return declare(*this, opt_int(name, m, doc), m);
}
OptionBinder& OptionBinder::add(const std::string& name, double& m, const std::string& doc) {
  return declare(*this, opt_float(name, m, doc), m);
}
OptionBinder& OptionBinder::add(const std::string& name, std::string& m, const std::string& doc) {
  return declare(*this, opt_string(name, m, doc), m);
}
OptionBinder& OptionBinder::add(const std::string& name, std::vector<int64_t>& m, const std::string& doc) {
  return declare(*this, opt_ints(name, m, doc), m);
}
OptionBinder& OptionBinder::add(const std::string& name, std::vector<double>& m, const std::string& doc) {
  return declare(*this, opt_floats(name, m, doc), m);
}
OptionBinder& OptionBinder::add(const std::string& name, std::vector<std::string>& m, const std::string& doc) {
  return declare(*this, opt_strings(name, m, doc), m);
}
OptionBinder& OptionBinder::add(const std::string& name, std::string& m, const std::string& doc,
                                std::vector<std::string> choices) {
  if (std::find(choices.begin(), choices.end(), m) == choices.end())
    throw Error("option '" + name + "': its default \"" + m + "\" is not one of its choices");
  return declare(*this, opt_string(name, m, doc, std::move(choices)), m);
}
OptionBinder& OptionBinder::path(const std::string& name, std::string& m, const std::string& doc) {
  return declare(*this, opt_path(name, m, doc), m);
}

OptionBinder& OptionBinder::add_word(const std::string& name, const void* member, const std::string& doc,
                                     std::vector<std::string> words, const std::string& current,
                                     std::function<void(const std::string&)> assign) {
  if (current.empty()) throw Error("option '" + name + "': the member's value now (its default) is none of its words");
  for (size_t i = 0; i < words.size(); ++i)
    for (size_t j = i + 1; j < words.size(); ++j)
      if (words[i] == words[j]) throw Error("option '" + name + "': the word \"" + words[i] + "\" is given twice");
  // The spec holds the word; the member gets the value it stands for.
  return state_->declare(*this, opt_string(name, current, doc, std::move(words)), member,
                         [assign = std::move(assign)](const OptionValue& v) { assign(std::get<std::string>(v)); });
}

OptionBinder& OptionBinder::retired() {
  if (state_->specs.empty()) throw Error("retired() before any option");
  state_->specs.back().retired = true;
  return *this;
}

OptionBinder& OptionBinder::moved_to(std::string key) {
  retired();
  state_->specs.back().moved_to = std::move(key);
  return *this;
}

OptionBinder& OptionBinder::required() {
  if (state_->specs.empty()) throw Error("required() before any option");
  state_->specs.back().required = true;
  return *this;
}

// ---- the core's side ------------------------------------------------------------------------------

namespace detail {

OptionSpecs declared_options(Plugin& p, OptionBinder* binder) {
  OptionBinder local;
  OptionBinder& b = binder ? *binder : local;
  p.bind(b);
  return b.specs();
}

void name_plugin(Plugin& p, const std::string& name) { PluginAccess::state(p).name = name; }

void configure_options(Plugin& p, const std::string& toml) {
  configure_options(p, [&](const OptionSpecs& specs) { return parse_options(toml, specs, "plugins." + p.name()); });
}

void configure_options(Plugin& p, const std::function<Options(const OptionSpecs&)>& values) {
  PluginState& s = PluginAccess::state(p);
  if (s.prepared) throw Error("plugin '" + s.name + "' is prepared already: a plugin gets its options once");
  OptionBinder binder;
  OptionSpecs specs;
  try {
    specs = declared_options(p, &binder);
  } catch (const Error& e) {
    throw Error("plugin '" + s.name + "': " + e.what());
  }
  const Options options = values(specs);
  const BinderState& b = BinderState::of(binder);
  s.options = options;
  s.bound.clear();
  for (size_t i = 0; i < b.specs.size(); ++i) {
    b.assign[i](options.values().at(b.specs[i].name));
    s.bound.emplace_back(b.members[i], b.specs[i].name);
  }
  p.init();
  s.prepared = true;  // only once init() accepted the values
}

}  // namespace detail

void prepare_plugin(Plugin& plugin, const std::string& name, const std::string& options, uint32_t hooks) {
  if (is_prepared(plugin))
    throw Error("plugin '" + plugin.name() + "' is prepared already: a plugin is named and given its options once");
  if (name.empty()) throw Error("a plugin added in code needs a name");
  if (hooks == kUnknownHooks)
    throw Error("plugin '" + name + "' was given as a std::shared_ptr<tk::Plugin>: give it as a std::shared_ptr of its "
                "own class, from which the core reads the hooks it overrides");
  detail::name_plugin(plugin, name);
  detail::PluginAccess::state(plugin).hooks = hooks;
  detail::configure_options(plugin, options);
}

bool is_prepared(const Plugin& plugin) noexcept { return detail::PluginAccess::state(plugin).prepared; }

}  // namespace tk
