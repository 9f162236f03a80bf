#pragma once
/// Finds plugin libraries, checks their entry point and lets them register into a Registry.
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "tk/plugin.h"
#include "tk/registry.h"

// What this header declares is libtrainkit's interface: exported (the library hides the rest).
#pragma GCC visibility push(default)

namespace tk {

/// What a library told the loader about itself.
struct LibraryInfo {
  std::string name;
  std::string version;
  std::string trainkit_version;
  std::string torch_version;
  std::filesystem::path file;
};

/// A plugin instance; it keeps its library loaded for as long as it lives.
struct LoadedPlugin {
  std::shared_ptr<Plugin> plugin;
  std::string name;
  std::string version;
  std::filesystem::path file;
};

class PluginLoader {
 public:
  /// Searches `dirs` in order for libraries given by name.
  explicit PluginLoader(std::vector<std::filesystem::path> dirs);

  /// The default search path: `<recipe_dir>/plugins` (when given), each entry of TK_PLUGIN_PATH,
  /// then the plugins folder of this trainkit: `<libtrainkit's folder>/trainkit/plugins` when
  /// installed, the build tree's plugins/ when run from there.
  static std::vector<std::filesystem::path> default_dirs(const std::filesystem::path& recipe_dir = {});
  /// trainkit's own plugins folder, next to libtrainkit: `<libdir>/trainkit/plugins` installed,
  /// the build tree's plugins/ in a build tree.
  static std::filesystem::path own_dir();
  /// The libraries every run loads first, from own_dir(): trainkit's models, data sets, optimizers.
  static std::vector<std::string> standard_libraries();

  /// The file that holds library `name` (tk_<name>.so); the error lists the folders searched.
  std::filesystem::path find(const std::string& name) const;
  /// Library names found on the search path.
  std::vector<std::string> available() const;
  /// Loads a library and lets it register what it holds into `registry` (once per file and
  /// registry). Refuses a missing or broken file, a missing entry point, a wrong ABI version,
  /// layout or LibTorch version, naming the file and expected vs found.
  LibraryInfo load(const std::filesystem::path& file, Registry& registry) const;
  /// Reads a library's entry point without registering anything (for tools that describe it).
  LibraryInfo inspect(const std::filesystem::path& file) const;
  /// Loads a library that holds exactly one strategy plugin and makes an instance of it.
  LoadedPlugin load_plugin(const std::filesystem::path& file) const;

  const std::vector<std::filesystem::path>& dirs() const noexcept { return dirs_; }

  /// File name of the library called `name`: "tk_<name>.so".
  static std::string file_name(const std::string& name);

 private:
  std::vector<std::filesystem::path> dirs_;
};

/// The contract of plugin `name` of `registry` with `options` (TOML text, as its [[plugins]]
/// entry's; empty: its defaults), asked as a run would ask it: what it provides, what it runs
/// after, needs and refuses beside it. Options it does not take are refused as a recipe's would
/// be (RecipeError); a name not registered, a plugin that cannot be made, whose init() refuses
/// its options or whose contract() throws: PluginLoadError.
Contract plugin_contract(const Registry& registry, const std::string& name, const std::string& options = "");

}  // namespace tk

#pragma GCC visibility pop
