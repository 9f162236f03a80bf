// The recipe as a run resolved it (tk/resolved_recipe.h): as TOML, and as flat values.
#include "tk/resolved_recipe.h"

#include <algorithm>
#include <sstream>

namespace tk {

namespace {
bool is_retired(const Options& o, const std::string& key) {
  const OptionSpec* s = o.spec(key);
  return s && s->retired;
}
bool same_on_cpu(const Options& o, const std::string& key) {
  const OptionSpec* s = o.spec(key);
  return s && s->type == OptionType::String &&
         std::find(s->same_on_cpu.begin(), s->same_on_cpu.end(), o.get_string(key)) != s->same_on_cpu.end();
}
}  // namespace

void ResolvedRecipe::add_section(const std::string& section, const std::string& name, const Options& values) {
  for (auto& e : entries_)
    if (!e.array && e.header == section) {
      e = {section, false, "", name, "", values};
      return;
    }
  entries_.push_back({section, false, "", name, "", values});
}

void ResolvedRecipe::add_plugin(const std::string& label, const std::string& name, const std::string& path,
                                const Options& values) {
  entries_.push_back({"plugins", true, label, name, path, values});
}

std::map<std::string, OptionValue> ResolvedRecipe::moved_values() const {
  std::map<std::string, OptionValue> out;
  for (const auto& e : entries_)
    for (const auto& s : e.options.specs())
      if (s.retired && !s.moved_to.empty() && e.options.is_set(s.name)) out[s.moved_to] = e.options.values().at(s.name);
  return out;
}

std::vector<ResolvedRecipe::Value> ResolvedRecipe::entry_values(const Entry& e,
                                                                const std::map<std::string, OptionValue>& moved) const {
  std::vector<Value> out;
  const std::string prefix = e.header + "." + (e.array ? e.label + "." : "");
  for (const auto& [k, v] : e.options.values()) {
    if (is_retired(e.options, k)) continue;
    auto given = moved.find(prefix + k);
    if (given != moved.end() && !e.options.is_set(k))
      out.push_back({k, to_toml(given->second), false, false});
    else
      out.push_back({k, to_toml(v), !e.options.is_set(k), same_on_cpu(e.options, k)});
  }
  return out;
}

std::string ResolvedRecipe::toml(const std::string& source) const {
  std::ostringstream out;
  out << "# resolved from " << source << " (defaults filled in, overrides applied)\n";
  const auto moved = moved_values();
  for (const auto& e : entries_) {
    out << "\n" << (e.array ? "[[" + e.header + "]]" : "[" + e.header + "]") << "\n";
    if (!e.name.empty()) out << "name = " << to_toml(e.name) << "\n";
    if (!e.path.empty()) out << "path = " << to_toml(e.path) << "\n";
    for (const auto& v : entry_values(e, moved)) out << v.key << " = " << v.toml << "\n";
  }
  return out.str();
}

std::vector<ResolvedRecipe::Value> ResolvedRecipe::values() const {
  std::vector<Value> out;
  std::string plugins;
  const auto moved = moved_values();
  for (const auto& e : entries_) {
    std::string prefix = e.header + ".";
    if (e.array) {
      prefix += e.label + ".";
      plugins += (plugins.empty() ? "" : ", ") + e.label;
    } else if (!e.name.empty()) {
      out.push_back({e.header + ".name", to_toml(e.name)});
    }
    if (!e.path.empty()) out.push_back({prefix + "path", to_toml(e.path)});
    for (auto v : entry_values(e, moved)) {
      v.key = prefix + v.key;
      out.push_back(std::move(v));
    }
  }
  out.push_back({"plugins", to_toml(plugins)});
  return out;
}

std::map<std::string, std::string> ResolvedRecipe::retired() const {
  std::map<std::string, std::string> out;
  for (const auto& e : entries_)
    for (const auto& s : e.options.specs())
      if (s.retired) out[e.header + "." + (e.array ? e.label + "." : "") + s.name] = s.moved_to;
  return out;
}

}  // namespace tk
