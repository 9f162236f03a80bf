#pragma once
/// Finds plugin libraries, checks their entry point and makes instances tied to their library.
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "tk/plugin.h"

namespace tk {

/// A plugin instance; it keeps its library loaded for as long as it lives.
struct LoadedPlugin {
  std::shared_ptr<Plugin> plugin;
  std::string name;
  std::string version;
  std::filesystem::path file;
};

class PluginLoader {
 public:
  /// Searches `dirs` in order for plugins given by name.
  explicit PluginLoader(std::vector<std::filesystem::path> dirs);

  /// The default search path: `<recipe_dir>/plugins` (when given), each entry of TK_PLUGIN_PATH,
  /// the build tree, `<exe dir>/../lib/trainkit/plugins`, and the install location.
  static std::vector<std::filesystem::path> default_dirs(const std::filesystem::path& recipe_dir = {});

  /// The file that holds plugin `name` (tk_<name>.so); the error lists the folders searched.
  std::filesystem::path find(const std::string& name) const;
  /// Plugin names found on the search path.
  std::vector<std::string> available() const;
  /// Loads a plugin library and makes one instance. Refuses a missing file or entry point, a
  /// wrong ABI or LibTorch version and a null factory, naming the file and expected vs found.
  LoadedPlugin load(const std::filesystem::path& file) const;
  /// find() then load().
  LoadedPlugin load_by_name(const std::string& name) const { return load(find(name)); }

  const std::vector<std::filesystem::path>& dirs() const noexcept { return dirs_; }

  /// File name a plugin called `name` has: "tk_<name>.so".
  static std::string file_name(const std::string& name);

 private:
  std::vector<std::filesystem::path> dirs_;
};

}  // namespace tk
