#pragma once
/// TOML recipes: parsing, `--set` overrides, validation against option specs, the resolved copy.
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "tk/options.h"

namespace tk {

/// One `[[plugins]]` entry: a plugin given by name or by explicit path.
struct PluginEntry {
  std::string name;
  std::filesystem::path path;  ///< empty when found by name
  SourceLoc where;
};

class Recipe {
 public:
  /// Parses a recipe file; syntax errors carry file:line:column.
  static Recipe from_file(const std::filesystem::path& file);
  /// Parses recipe text; `source_name` stands for the file in messages.
  static Recipe from_string(const std::string& text, const std::string& source_name = "<recipe>");

  Recipe(const Recipe& other);
  Recipe& operator=(const Recipe& other);
  Recipe(Recipe&&) noexcept;
  Recipe& operator=(Recipe&&) noexcept;
  ~Recipe();

  /// Applies "dotted.key=value" (value in TOML syntax, or a bare string). `plugins.<name>.<key>`
  /// and `plugins.<index>.<key>` address a plugin's options.
  void apply_override(const std::string& assignment);

  /// Refuses top-level sections other than `known`, listing the known ones.
  void check_sections(const std::vector<std::string>& known) const;

  /// The `name` key of a component section, checked against `known` (error lists them).
  std::string component(const std::string& section, const std::string& fallback,
                        const std::vector<std::string>& known) const;

  /// Whether `section` sets `key` (in the file or by an override).
  bool sets(const std::string& section, const std::string& key) const;

  /// The values of `section` checked against `specs` (plus `name` when `named`); unknown keys and
  /// wrong types are refused with the list of valid keys.
  Options options(const std::string& section, const OptionSpecs& specs, bool named = false) const;

  /// The `[[plugins]]` entries, in recipe order.
  std::vector<PluginEntry> plugins() const;
  /// The options of plugin entry `i` checked against `specs`; an unknown key is refused with the
  /// list of valid ones (`name` and `path` among them).
  Options plugin_options(size_t i, const OptionSpecs& specs) const;
  /// The name plugin entry `i` goes by in `--set plugins.<label>.key` and in the resolved recipe:
  /// its `name`, else the plugin of its file (tk_<label>.so), else its index.
  std::string plugin_label(size_t i) const;

  /// The file this recipe came from (or its source name).
  const std::string& source() const noexcept;
  /// The folder relative paths in the recipe are resolved against.
  std::filesystem::path dir() const;
  /// `p` made absolute against dir() when it is relative.
  std::filesystem::path resolve_path(const std::string& p) const;

 private:
  struct Impl;
  explicit Recipe(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// The recipe as a run resolved it: each section it read, with every value (defaults included),
/// in the order the run adds them. Built by the run from what it read, never as a side effect of
/// reading: what recipe.toml and the run's identity hold is what the run was made of.
class ResolvedRecipe {
 public:
  /// A section such as [optimizer]: the component's `name` (empty for [run]) and its values.
  void add_section(const std::string& section, const std::string& name, const Options& values);
  /// A [[plugins]] entry: its label (Recipe::plugin_label), its `name` and `path` as the recipe
  /// gave them (either may be empty) and its values.
  void add_plugin(const std::string& label, const std::string& name, const std::string& path, const Options& values);

  /// As TOML: what the output folder's recipe.toml holds; it runs as it is.
  std::string toml(const std::string& source) const;
  /// One value of values(): its flat key, its TOML text, and whether it is its option's default
  /// (given neither by the recipe nor by an override).
  struct Value {
    std::string key, toml;
    bool is_default = false;
  };
  /// Every value as a flat "section.key", in order; a plugin's keys are "plugins.<label>.<key>"
  /// (its file "plugins.<label>.path"), and "plugins" lists the labels.
  std::vector<Value> values() const;

 private:
  struct Entry {
    std::string header;
    bool array = false;
    std::string label, name, path;
    Options options;
  };
  std::vector<Entry> entries_;
};

/// Validates `values` (a TOML table, given through the recipe) against specs. Exposed for plugins
/// built in code: options from a map of name -> TOML text.
Options parse_options(const std::string& toml_text, const OptionSpecs& specs,
                      const std::string& context = "options");

}  // namespace tk
