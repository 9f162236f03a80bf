#pragma once
/// What a run was made of: its recipe resolved, section by section (recipe.toml, the run's identity).
#include <map>
#include <string>
#include <vector>

#include "tk/options.h"

// What this header declares is libtrainkit's interface: exported (the library hides the rest).
#pragma GCC visibility push(default)

namespace tk {

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

  /// As TOML: what the output folder's recipe.toml holds; it runs as it is. An option that moved
  /// (OptionSpec::moved_to: [data] micro_batch is [batch] micro_batch) is written where it is now.
  std::string toml(const std::string& source) const;
  /// One value of values(): its flat key, its TOML text, whether it is its option's default
  /// (given neither by the recipe nor by an override), and whether it is one of the values its
  /// option declares the same on the CPU (OptionSpec::same_on_cpu).
  struct Value {
    std::string key, toml;
    bool is_default = false;
    bool same_on_cpu = false;
  };
  /// Every value as a flat "section.key", in order; a plugin's keys are "plugins.<label>.<key>"
  /// (its file "plugins.<label>.path"), and "plugins" lists the labels.
  std::vector<Value> values() const;
  /// The retired options of every section, as flat keys, each with where it moved (its
  /// OptionSpec::moved_to, "" when it went). Neither recipe.toml nor values() holds them.
  std::map<std::string, std::string> retired() const;

 private:
  struct Entry {
    std::string header;
    bool array = false;
    std::string label, name, path;
    Options options;
  };
  std::vector<Entry> entries_;

  /// What the recipe gave in options that moved (OptionSpec::moved_to), by the key they moved to.
  std::map<std::string, OptionValue> moved_values() const;
  /// The values of `e` by their keys in it, retired ones left out; a value given in an option
  /// that moved here stands for one left at its default.
  std::vector<Value> entry_values(const Entry& e, const std::map<std::string, OptionValue>& moved) const;
};

}  // namespace tk

#pragma GCC visibility pop
