#pragma once
/// TOML recipes: parsing, `--set` overrides, validation against option specs, the resolved copy.
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "tk/options.h"
#include "tk/resolved_recipe.h"

// What this header declares is libtrainkit's interface: exported (the library hides the rest).
#pragma GCC visibility push(default)

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

  /// The `name` key of a component section, else `fallback` (when not empty), checked against
  /// `known` (an error lists them).
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

/// Validates `values` (a TOML table, given through the recipe) against specs. Exposed for plugins
/// built in code: options from a map of name -> TOML text.
Options parse_options(const std::string& toml_text, const OptionSpecs& specs,
                      const std::string& context = "options");

}  // namespace tk

#pragma GCC visibility pop
