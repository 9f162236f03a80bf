#include "tk/loader.h"

#include <torch/version.h>

#include <boost/dll/runtime_symbol_info.hpp>
#include <boost/dll/shared_library.hpp>
#include <cstdlib>
#include <set>
#include <sstream>

#include "tk/abi.h"

namespace fs = std::filesystem;

namespace tk {

PluginLoader::PluginLoader(std::vector<fs::path> dirs) : dirs_(std::move(dirs)) {}

std::string PluginLoader::file_name(const std::string& name) { return "tk_" + name + ".so"; }

std::vector<fs::path> PluginLoader::default_dirs(const fs::path& recipe_dir) {
  std::vector<fs::path> dirs;
  if (!recipe_dir.empty()) dirs.push_back(recipe_dir / "plugins");
  if (const char* env = std::getenv("TK_PLUGIN_PATH")) {
    std::stringstream ss(env);
    for (std::string d; std::getline(ss, d, ':');)
      if (!d.empty()) dirs.emplace_back(d);
  }
  dirs.emplace_back(TK_PLUGIN_BUILD_DIR);
  boost::dll::fs::error_code ec;
  auto exe = boost::dll::program_location(ec);
  if (!ec) dirs.push_back(fs::path(exe.string()).parent_path().parent_path() / "lib/trainkit/plugins");
  dirs.emplace_back(TK_PLUGIN_INSTALL_DIR);
  return dirs;
}

fs::path PluginLoader::find(const std::string& name) const {
  for (const auto& d : dirs_) {
    fs::path f = d / file_name(name);
    std::error_code ec;
    if (fs::is_regular_file(f, ec)) return f;
  }
  std::string msg = "plugin '" + name + "' not found: no " + file_name(name) + " in";
  for (const auto& d : dirs_) msg += "\n  " + d.string();
  auto avail = available();
  msg += "\navailable plugins: " + (avail.empty() ? std::string("(none)") : join(avail.data(), avail.data() + avail.size()));
  msg += "\n(set TK_PLUGIN_PATH, or give `path = \"...\"` in the [[plugins]] entry)";
  throw PluginLoadError(msg);
}

std::vector<std::string> PluginLoader::available() const {
  std::set<std::string> names;
  for (const auto& d : dirs_) {
    std::error_code ec;
    if (!fs::is_directory(d, ec)) continue;
    for (const auto& e : fs::directory_iterator(d, ec)) {
      std::string f = e.path().filename().string();
      if (f.size() > 6 && f.rfind("tk_", 0) == 0 && f.substr(f.size() - 3) == ".so")
        names.insert(f.substr(3, f.size() - 6));
    }
  }
  return {names.begin(), names.end()};
}

LoadedPlugin PluginLoader::load(const fs::path& file) const {
  const std::string where = file.string();
  std::error_code fec;
  if (!fs::is_regular_file(file, fec))
    throw PluginLoadError(where + ": plugin file does not exist");

  auto lib = std::make_shared<boost::dll::shared_library>();
  boost::dll::fs::error_code ec;
  lib->load(boost::dll::fs::path(file), boost::dll::load_mode::rtld_lazy | boost::dll::load_mode::rtld_local, ec);
  if (ec) throw PluginLoadError(where + ": cannot load shared library: " + ec.message());
  if (!lib->has(TK_PLUGIN_ENTRY_SYMBOL))
    throw PluginLoadError(where + ": not a trainkit plugin: it does not export the entry point '" +
                          std::string(TK_PLUGIN_ENTRY_SYMBOL) + "' (define it with TK_PLUGIN(...))");
  auto entry = lib->get<const tk_plugin_info*()>(TK_PLUGIN_ENTRY_SYMBOL);
  const tk_plugin_info* info = entry();
  if (!info) throw PluginLoadError(where + ": entry point '" TK_PLUGIN_ENTRY_SYMBOL "' returned null");
  if (info->abi_version != TK_PLUGIN_ABI_VERSION)
    throw PluginLoadError(where + ": plugin ABI version mismatch: expected " +
                          std::to_string(TK_PLUGIN_ABI_VERSION) + ", got " +
                          std::to_string(info->abi_version) + " (rebuild the plugin against this trainkit)");
  std::string name = info->name ? info->name : "";
  if (name.empty()) throw PluginLoadError(where + ": plugin has an empty name");
  std::string torch = info->torch_version ? info->torch_version : "(none)";
  if (torch != TORCH_VERSION)
    throw PluginLoadError(where + ": plugin '" + name + "' was built against LibTorch " + torch +
                          ", expected " + TORCH_VERSION + " (the LibTorch this trainkit uses)");
  if (!info->create || !info->destroy)
    throw PluginLoadError(where + ": plugin '" + name + "' has a null " +
                          (info->create ? "destroy" : "create") + " function");
  Plugin* raw = nullptr;
  try {
    raw = info->create();
  } catch (const std::exception& e) {
    throw PluginLoadError(where + ": plugin '" + name + "' failed to construct: " + e.what());
  }
  if (!raw) throw PluginLoadError(where + ": plugin '" + name + "' factory returned null");
  raw->set_name(name);
  auto destroy = info->destroy;
  // The deleter owns the library handle: the code stays mapped until the instance is gone.
  std::shared_ptr<Plugin> plugin(raw, [lib, destroy](Plugin* p) mutable {
    destroy(p);
    lib.reset();
  });
  return LoadedPlugin{std::move(plugin), name, info->version ? info->version : "", file};
}

}  // namespace tk
