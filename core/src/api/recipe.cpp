#include "tk/recipe.h"

#include <algorithm>
#include <optional>
#include <cmath>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <toml++/toml.h>

namespace tk {
namespace {

/// Where `r` is; a --set named whole (a line and column in it would read as part of its value).
SourceLoc loc_of(const toml::source_region& r, const std::string& fallback_file) {
  const std::string file = r.path ? *r.path : fallback_file;
  if (file.rfind("--set ", 0) == 0) return SourceLoc{file, 0, 0};
  return SourceLoc{file, static_cast<int>(r.begin.line), static_cast<int>(r.begin.column)};
}

const char* type_name(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::table: return "table";
    case toml::node_type::array: return "array";
    case toml::node_type::string: return "string";
    case toml::node_type::integer: return "integer";
    case toml::node_type::floating_point: return "float";
    case toml::node_type::boolean: return "boolean";
    case toml::node_type::date: return "date";
    case toml::node_type::time: return "time";
    case toml::node_type::date_time: return "date-time";
    default: return "nothing";
  }
}

/// The keys a table takes: those it selects by (`name`, `path`), then its options.
std::string names_of(const OptionSpecs& specs, const std::vector<std::string>& selectors) {
  std::vector<std::string> names = selectors;
  for (const auto& s : specs) names.push_back(s.name);
  return join(names.data(), names.data() + names.size());
}

std::string list(const std::vector<std::string>& v) { return join(v.data(), v.data() + v.size()); }

/// The elements of a TOML array as `T`s, each read by `element` (null where it is not one), or
/// the error saying which element type was found.
template <class T, class Element>
std::vector<T> list_of(const toml::node& n, const OptionSpec& spec, const std::string& key, const SourceLoc& where,
                       Element element) {
  constexpr size_t kMaxListLength = 4096;  // no option of any component needs more
  auto arr = n.as_array();
  if (!arr) throw RecipeError(where, key + ": expected " + to_string(spec.type) + ", got " + type_name(n));
  if (arr->size() > kMaxListLength)
    throw RecipeError(where, key + ": a list of " + std::to_string(arr->size()) + " values; at most " +
                                 std::to_string(kMaxListLength) + " are accepted");
  std::vector<T> out;
  for (const auto& e : *arr) {
    std::optional<T> v = element(e);
    if (!v) throw RecipeError(where, key + ": expected " + to_string(spec.type) + ", got an element of type " + type_name(e));
    out.push_back(std::move(*v));
  }
  return out;
}

/// Converts one TOML value to the spec's type, or explains what was expected.
OptionValue convert(const toml::node& n, const OptionSpec& spec, const std::string& key, const SourceLoc& where) {
  auto wrong = [&]() -> RecipeError {  // an integer option may also take words (micro_batch = "auto")
    const bool words = spec.type == OptionType::Int && !spec.choices.empty();
    return RecipeError(where, key + ": expected " + (words ? "an integer or one of " + list(spec.choices)
                                                           : std::string(to_string(spec.type))) + ", got " + type_name(n));
  };
  auto text = [&](const toml::value<std::string>* v) {
    if (!v) throw wrong();
    if (v->get().find('\0') != std::string::npos) throw RecipeError(where, key + ": contains a NUL character");
    return v->get();
  };
  switch (spec.type) {
    case OptionType::Bool:
      if (auto v = n.as_boolean()) return v->get();
      throw wrong();
    case OptionType::Int:
      if (auto v = n.as_integer()) return v->get();
      if (auto v = n.as_string(); v && !spec.choices.empty()) {
        if (std::find(spec.choices.begin(), spec.choices.end(), v->get()) != spec.choices.end()) return v->get();
        throw RecipeError(where, key + ": expected an integer or one of " + list(spec.choices) + ", got \"" + v->get() + "\"");
      }
      throw wrong();
    case OptionType::Float:
      if (auto v = n.as_floating_point()) {
        if (std::isnan(v->get())) throw RecipeError(where, key + ": is nan, which is not a number");
        return v->get();
      }
      if (auto v = n.as_integer()) return static_cast<double>(v->get());
      throw wrong();
    case OptionType::String: {
      std::string s = text(n.as_string());
      if (!spec.choices.empty() &&
          std::find(spec.choices.begin(), spec.choices.end(), s) == spec.choices.end())
        throw RecipeError(where, key + ": expected one of " + list(spec.choices) + ", got \"" + s + "\"");
      return s;
    }
    case OptionType::Path:
      return text(n.as_string());
    case OptionType::IntList:
      return list_of<int64_t>(n, spec, key, where, [](const toml::node& e) -> std::optional<int64_t> {
        if (auto v = e.as_integer()) return v->get();
        return std::nullopt;
      });
    case OptionType::StringList:
      if (n.is_string()) return std::vector<std::string>{text(n.as_string())};  // one string: a list of one
      return list_of<std::string>(n, spec, key, where, [&](const toml::node& e) -> std::optional<std::string> {
        if (!e.is_string()) return std::nullopt;
        return text(e.as_string());
      });
    case OptionType::FloatList:
      return list_of<double>(n, spec, key, where, [&](const toml::node& e) -> std::optional<double> {
        if (auto v = e.as_floating_point()) {
          if (std::isnan(v->get())) throw RecipeError(where, key + ": has a nan element, which is not a number");
          return v->get();
        }
        if (auto i = e.as_integer()) return static_cast<double>(i->get());
        return std::nullopt;
      });
  }
  throw wrong();
}

using OverrideLocs = std::map<std::string, SourceLoc>;

/// Where a value was set: its position in the file, or the `--set` that put it there.
SourceLoc where_set(const toml::node& n, const std::string& dotted, const std::string& file,
                    const OverrideLocs& overrides) {
  const auto it = overrides.find(dotted);
  return it != overrides.end() ? it->second : loc_of(n.source(), file);
}

/// A relative path made absolute against the folder of what set it: the recipe's, or for a `--set`
/// the working directory.
std::string resolve_against(const std::string& p, bool overridden, const std::filesystem::path& recipe_dir) {
  if (p.empty()) return p;
  std::filesystem::path path(p);
  if (path.is_absolute()) return p;
  return ((overridden ? std::filesystem::current_path() : recipe_dir) / path).lexically_normal().string();
}

/// Checks `table` (may be null: all defaults) against `specs`.
Options resolve_table(const toml::table* table, const OptionSpecs& specs, const std::string& context,
                      const SourceLoc& section_loc, const std::vector<std::string>& skip,
                      const std::string& file, const OverrideLocs& overrides = {},
                      const std::filesystem::path& dir = std::filesystem::current_path()) {
  Options out;
  out.set_context(context);
  out.set_section_loc(section_loc);
  for (const auto& spec : specs) out.set(spec.name, spec.default_value);
  out.set_specs(specs);
  if (table) {
    for (const auto& [k, node] : *table) {
      std::string key(k.str());
      if (std::find(skip.begin(), skip.end(), key) != skip.end()) continue;
      SourceLoc where = where_set(node, context + "." + key, file, overrides);
      auto spec = std::find_if(specs.begin(), specs.end(), [&](const OptionSpec& s) { return s.name == key; });
      if (spec == specs.end()) {
        if (!overrides.count(context + "." + key)) where = loc_of(k.source(), file);
        std::string valid = names_of(specs, skip);
        throw RecipeError(where, "unknown key '" + key + "' in [" + context + "]; valid keys: " +
                                     (valid.empty() ? "(none)" : valid));
      }
      OptionValue v = convert(node, *spec, context + "." + key, where);
      if (spec->type == OptionType::Path)
        v = resolve_against(std::get<std::string>(v), overrides.count(context + "." + key) != 0, dir);
      out.set(key, std::move(v), where);
    }
  }
  for (const auto& spec : specs) {
    if (spec.required && !(table && table->contains(spec.name)))
      throw RecipeError(section_loc, "[" + context + "] is missing required key '" + spec.name + "' (" +
                                         to_string(spec.type) + ": " + spec.doc + ")");
  }
  return out;
}

/// The name a `[[plugins]]` entry goes by: its `name`, else the plugin of its file (tk_<name>.so),
/// else its index.
std::string entry_label(const toml::table& t, size_t index) {
  if (auto n = t["name"].value<std::string>()) return *n;
  if (auto p = t["path"].value<std::string>()) {
    const std::string stem = std::filesystem::path(*p).stem().string();
    if (stem.rfind("tk_", 0) == 0 && stem.size() > 3) return stem.substr(3);
  }
  return std::to_string(index);
}

}  // namespace

struct Recipe::Impl {
  std::string text;                    // the recipe as read, and
  std::vector<std::string> applied;    // the overrides applied to it: a copy parses both again
  toml::table root;
  std::string source;
  std::filesystem::path dir;
  OverrideLocs overrides;  // dotted key -> the --set that gave it its value

  const toml::table* section(const std::string& name) const { return root[name].as_table(); }
  SourceLoc section_loc(const std::string& name) const {
    if (auto n = root.get(name)) return loc_of(n->source(), source);
    return SourceLoc{source, 0, 0};
  }
};

Recipe::Recipe(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
static toml::table parse_text(const std::string& text, const std::string& name);

// A copy parses the text again and replays the overrides: copying a toml::table would drop the
// source positions that every error message points at.
Recipe::Recipe(const Recipe& other) : impl_(std::make_unique<Impl>()) {
  impl_->text = other.impl_->text;
  impl_->source = other.impl_->source;
  impl_->dir = other.impl_->dir;
  impl_->root = parse_text(impl_->text, impl_->source);
  for (const auto& o : other.impl_->applied) apply_override(o);
}
Recipe& Recipe::operator=(const Recipe& other) {
  if (this != &other) *this = Recipe(other);
  return *this;
}
Recipe::Recipe(Recipe&&) noexcept = default;
Recipe& Recipe::operator=(Recipe&&) noexcept = default;
Recipe::~Recipe() = default;

static toml::table parse_text(const std::string& text, const std::string& name) {
  try {
    return toml::parse(text, name);
  } catch (const toml::parse_error& e) {
    throw RecipeError(loc_of(e.source(), name), "TOML syntax error: " + std::string(e.description()));
  }
}

Recipe Recipe::from_file(const std::filesystem::path& file) {
  std::error_code ec;
  if (std::filesystem::is_directory(file, ec)) throw Error("recipe '" + file.string() + "' is a folder, not a TOML file");
  if (std::filesystem::exists(file, ec) && !std::filesystem::is_regular_file(file, ec))
    throw Error("recipe '" + file.string() + "' is not a regular file (a device or a pipe?)");
  constexpr uintmax_t kMaxRecipeBytes = 1 << 20;  // far beyond any real recipe; parsing more takes minutes
  const uintmax_t size = std::filesystem::file_size(file, ec);
  if (!ec && size > kMaxRecipeBytes)
    throw Error("recipe '" + file.string() + "' is " + std::to_string(size) +
                " bytes; a recipe may have at most 1 MiB (keep data in data files)");
  std::ifstream in(file, std::ios::binary);
  if (!in) throw Error("cannot read recipe '" + file.string() + "': no such file or not readable");
  std::stringstream ss;
  ss << in.rdbuf();
  auto impl = std::make_unique<Impl>();
  impl->text = ss.str();
  impl->root = parse_text(impl->text, file.string());
  impl->source = file.string();
  impl->dir = std::filesystem::absolute(file).parent_path();
  return Recipe(std::move(impl));
}

Recipe Recipe::from_string(const std::string& text, const std::string& source_name) {
  auto impl = std::make_unique<Impl>();
  impl->text = text;
  impl->root = parse_text(text, source_name);
  impl->source = source_name;
  impl->dir = std::filesystem::current_path();
  return Recipe(std::move(impl));
}

void Recipe::apply_override(const std::string& assignment) {
  const std::string origin = "--set " + assignment;
  auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0)
    throw RecipeError({origin}, "expected key=value, e.g. optimizer.lr=0.01");
  std::string key = assignment.substr(0, eq), text = assignment.substr(eq + 1);
  std::vector<std::string> path;
  if (key.back() == '.') throw RecipeError({origin}, "empty component in key '" + key + "'");
  std::stringstream ks(key);
  for (std::string part; std::getline(ks, part, '.');) {
    if (part.empty()) throw RecipeError({origin}, "empty component in key '" + key + "'");
    path.push_back(part);
  }
  // The value in TOML syntax; anything else is a bare string, but for a number TOML cannot hold (1e400).
  static const std::regex number("[+-]?[0-9][0-9_]*(\\.[0-9_]*)?([eE][+-]?[0-9_]+)?");
  toml::table parsed;
  try {
    parsed = toml::parse("value = " + text, origin);
  } catch (const toml::parse_error& e) {
    if (!std::regex_match(text, number)) parsed.insert("value", text);
    else throw RecipeError({origin}, key + ": " + text + " is not a number TOML can hold (" + std::string(e.description()) + ")");
  }
  toml::node* value = parsed.get("value");
  toml::table* t = &impl_->root;
  size_t i = 0;
  std::string dotted_prefix;
  if (path[0] == "plugins") {
    if (path.size() != 3)
      throw RecipeError({origin}, "plugin options are set as plugins.<name or index>.<key>=value");
    auto arr = impl_->root["plugins"].as_array();
    toml::table* entry = nullptr;
    size_t index = 0;
    if (arr) {
      bool numeric = std::all_of(path[1].begin(), path[1].end(), ::isdigit);
      for (size_t j = 0; j < arr->size() && !entry; ++j) {
        auto pt = (*arr)[j].as_table();
        if (pt && ((numeric && std::stoul(path[1]) == j) || (!numeric && entry_label(*pt, j) == path[1]))) {
          entry = pt;
          index = j;
        }
      }
    }
    if (!entry) throw RecipeError({origin}, "the recipe has no plugin '" + path[1] + "' in [[plugins]]");
    t = entry;
    i = 2;
    dotted_prefix = "plugins." + entry_label(*entry, index) + ".";
  }
  for (; i + 1 < path.size(); ++i) {
    toml::node* n = t->get(path[i]);
    if (!n) {
      t->insert(toml::key(path[i], value->source()), toml::table{});
      n = t->get(path[i]);
    }
    if (!n->is_table())
      throw RecipeError({origin}, "'" + path[i] + "' is a " + type_name(*n) + ", not a section");
    t = n->as_table();
  }
  t->insert_or_assign(toml::key(path.back(), value->source()), *value);
  const size_t first = dotted_prefix.empty() ? 0 : 2;
  std::string dotted = dotted_prefix;
  for (size_t j = first; j < path.size(); ++j) dotted += (j > first ? "." : "") + path[j];
  impl_->overrides[dotted] = SourceLoc{origin, 0, 0};
  if (!dotted_prefix.empty() && path.back() == "path") {  // the entry's label may follow its new file name
    auto arr = impl_->root["plugins"].as_array();
    for (size_t j = 0; j < arr->size(); ++j)
      if ((*arr)[j].as_table() == t) impl_->overrides["plugins." + entry_label(*t, j) + ".path"] = SourceLoc{origin, 0, 0};
  }
  impl_->applied.push_back(assignment);
}

void Recipe::check_sections(const std::vector<std::string>& known) const {
  for (const auto& [k, node] : impl_->root) {
    std::string key(k.str());
    const auto set = impl_->overrides.find(key);  // `--set model=3` put it there
    const SourceLoc where = set != impl_->overrides.end() ? set->second : loc_of(k.source(), impl_->source);
    if (std::find(known.begin(), known.end(), key) == known.end())
      throw RecipeError(where, "unknown section [" + key + "]; known sections: " + list(known));
    if (key == "plugins") {
      if (!node.is_array_of_tables())
        throw RecipeError(where, "plugins: expected [[plugins]] entries (an array of tables), got " +
                                     std::string(type_name(node)));
    } else if (!node.is_table()) {
      throw RecipeError(where, key + ": expected a section [" + key + "], got " + type_name(node));
    }
  }
}

std::string Recipe::component(const std::string& section, const std::string& fallback,
                              const std::vector<std::string>& known) const {
  const toml::table* t = impl_->section(section);
  const toml::node* n = t ? t->get("name") : nullptr;
  if (!n) {
    const bool known_fallback = std::find(known.begin(), known.end(), fallback) != known.end();
    if (known_fallback) return fallback;
    throw RecipeError(impl_->section_loc(section),
                      !fallback.empty() ? "[" + section + "] names no " + section + ", and its default '" + fallback +
                                              "' is registered by no library loaded; name one of: " + list(known)
                      : t ? "[" + section + "] needs a name; one of: " + list(known)
                          : "missing section [" + section + "] (its name is one of: " + list(known) + ")");
  }
  SourceLoc where = where_set(*n, section + ".name", impl_->source, impl_->overrides);
  auto s = n->value<std::string>();
  if (!s) throw RecipeError(where, section + ".name: expected string, got " + type_name(*n));
  if (std::find(known.begin(), known.end(), *s) == known.end())
    throw RecipeError(where, "unknown " + section + " '" + *s + "'; known: " + list(known));
  return *s;
}

bool Recipe::sets(const std::string& section, const std::string& key) const {
  return impl_->section(section) && impl_->section(section)->get(key) != nullptr;
}

Options Recipe::options(const std::string& section, const OptionSpecs& specs, bool named) const {
  std::vector<std::string> skip;
  if (named) skip.push_back("name");
  return resolve_table(impl_->section(section), specs, section, impl_->section_loc(section), skip, impl_->source,
                       impl_->overrides, impl_->dir);
}

std::vector<PluginEntry> Recipe::plugins() const {
  std::vector<PluginEntry> out;
  auto arr = impl_->root["plugins"].as_array();
  if (!arr) return out;
  for (size_t index = 0; index < arr->size(); ++index) {
    const toml::node& n = *arr->get(index);
    SourceLoc where = loc_of(n.source(), impl_->source);
    auto t = n.as_table();
    if (!t) throw RecipeError(where, "plugins: each entry must be a table ([[plugins]])");
    PluginEntry e;
    e.where = where;
    auto name = (*t)["name"];
    auto path = (*t)["path"];
    if (name && !name.is_string())
      throw RecipeError(loc_of(name.node()->source(), impl_->source),
                        std::string("plugins.name: expected string, got ") + type_name(*name.node()));
    if (path && !path.is_string())
      throw RecipeError(loc_of(path.node()->source(), impl_->source),
                        std::string("plugins.path: expected string, got ") + type_name(*path.node()));
    e.name = name.value_or(std::string{});
    if (path)
      e.path = resolve_against(*path.value<std::string>(),
                               impl_->overrides.count("plugins." + entry_label(*t, index) + ".path") != 0, impl_->dir);
    if (e.name.empty() && e.path.empty())
      throw RecipeError(where, "a [[plugins]] entry needs a name (found on the plugin path) or a path");
    out.push_back(std::move(e));
  }
  return out;
}

Options Recipe::plugin_options(size_t i, const OptionSpecs& specs) const {
  auto arr = impl_->root["plugins"].as_array();
  if (!arr || i >= arr->size()) throw Error("plugin entry " + std::to_string(i) + " does not exist");
  const toml::table* t = (*arr)[i].as_table();
  return resolve_table(t, specs, "plugins." + entry_label(*t, i), loc_of((*arr)[i].source(), impl_->source),
                       {"name", "path"}, impl_->source, impl_->overrides, impl_->dir);
}

std::string Recipe::plugin_label(size_t i) const {
  auto arr = impl_->root["plugins"].as_array();
  if (!arr || i >= arr->size() || !(*arr)[i].as_table()) throw Error("plugin entry " + std::to_string(i) + " does not exist");
  return entry_label(*(*arr)[i].as_table(), i);
}

const std::string& Recipe::source() const noexcept { return impl_->source; }
std::filesystem::path Recipe::dir() const { return impl_->dir; }
std::filesystem::path Recipe::resolve_path(const std::string& p) const {
  std::filesystem::path path(p);
  return path.is_absolute() ? path : impl_->dir / path;
}

Options parse_options(const std::string& toml_text, const OptionSpecs& specs, const std::string& context) {
  toml::table t;
  try {
    t = toml::parse(toml_text, context);
  } catch (const toml::parse_error& e) {
    throw RecipeError(loc_of(e.source(), context), "TOML syntax error: " + std::string(e.description()));
  }
  return resolve_table(&t, specs, context, SourceLoc{context, 0, 0}, {}, context);
}

}  // namespace tk
