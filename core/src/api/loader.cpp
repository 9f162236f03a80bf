#include "tk/loader.h"

#include <torch/version.h>

#include <dlfcn.h>
#include <elf.h>

#include <boost/dll/runtime_symbol_info.hpp>
#include <boost/dll/shared_library.hpp>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <tuple>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <vector>

#include "api/api.h"
#include "tk/abi.h"

namespace fs = std::filesystem;

namespace tk {
namespace {

std::string hex(uint64_t v) {
  std::ostringstream s;
  s << "0x" << std::hex << v;
  return s.str();
}

/// The file offset of virtual address `addr` in a loaded segment's file bytes, or nullopt.
std::optional<uint64_t> file_offset(const std::vector<Elf64_Phdr>& segments, uint64_t addr, uint64_t bytes) {
  for (const auto& ph : segments)
    if (ph.p_type == PT_LOAD && addr >= ph.p_vaddr && addr - ph.p_vaddr <= ph.p_filesz &&
        bytes <= ph.p_filesz - (addr - ph.p_vaddr))
      return ph.p_offset + (addr - ph.p_vaddr);
  return std::nullopt;
}

/// The dynamic section, and the tables the dynamic loader reads through it, lie inside the file
/// and hold what a linker writes: a library whose bytes were lost (an interrupted copy, zeros
/// where its tables were) crashes dlopen rather than failing it.
void check_dynamic(const fs::path& file, std::ifstream& in, const std::vector<Elf64_Phdr>& segments) {
  const std::string where = file.string();
  auto damaged = [&](const std::string& what) {
    return PluginLoadError(where + ": damaged (" + what + "); build or copy it again");
  };
  const auto dyn = std::find_if(segments.begin(), segments.end(), [](const Elf64_Phdr& p) { return p.p_type == PT_DYNAMIC; });
  if (dyn == segments.end() || dyn->p_filesz < sizeof(Elf64_Dyn)) throw damaged("no dynamic section");
  std::vector<Elf64_Dyn> entries(dyn->p_filesz / sizeof(Elf64_Dyn));
  in.clear();
  in.seekg(static_cast<std::streamoff>(dyn->p_offset));
  if (!in.read(reinterpret_cast<char*>(entries.data()), static_cast<std::streamsize>(entries.size() * sizeof(Elf64_Dyn))))
    throw damaged("its dynamic section cannot be read");
  std::map<int64_t, uint64_t> tags;
  bool ended = false;
  for (const auto& e : entries) {
    if (e.d_tag == DT_NULL) {
      ended = true;
      break;
    }
    tags.emplace(e.d_tag, e.d_un.d_val);
  }
  if (!ended || tags.empty()) throw damaged(tags.empty() ? "its dynamic section is all zeros" : "its dynamic section has no end");
  for (int64_t tag : {DT_STRTAB, DT_SYMTAB, DT_STRSZ})
    if (!tags.count(tag)) throw damaged("its dynamic section names no symbol or string table");
  if (!tags.count(DT_GNU_HASH) && !tags.count(DT_HASH)) throw damaged("its dynamic section names no hash table");
  const uint64_t strsz = tags[DT_STRSZ];
  const auto strtab = file_offset(segments, tags[DT_STRTAB], strsz);
  if (!strtab || strsz == 0) throw damaged("its string table lies outside the file");
  // A string table starts and ends with a NUL, and holds the names: not all zeros.
  std::string strings(strsz, '\0');
  in.clear();
  in.seekg(static_cast<std::streamoff>(*strtab));
  if (!in.read(strings.data(), static_cast<std::streamsize>(strsz)) || strings.front() != '\0' || strings.back() != '\0' ||
      strings.find_first_not_of('\0') == std::string::npos)
    throw damaged("its string table is not one");
  const uint64_t hash_addr = tags.count(DT_GNU_HASH) ? tags[DT_GNU_HASH] : tags[DT_HASH];
  const auto hash = file_offset(segments, hash_addr, 8);
  uint32_t buckets = 0;
  in.clear();
  if (hash) in.seekg(static_cast<std::streamoff>(*hash));
  if (!hash || !in.read(reinterpret_cast<char*>(&buckets), sizeof buckets) || buckets == 0)
    throw damaged("its symbol hash table is empty or outside the file");
}

/// Refuses what the dynamic loader must not be handed: anything but a complete ELF shared library
/// for this machine. A truncated library would be mapped beyond its end and crash the process
/// (SIGBUS) inside dlopen.
void check_elf(const fs::path& file) {
  const std::string where = file.string();
  std::error_code ec;
  if (fs::is_directory(file, ec)) throw PluginLoadError(where + ": is a folder, not a plugin library");
  if (!fs::exists(file, ec)) throw PluginLoadError(where + ": plugin file does not exist");
  if (!fs::is_regular_file(file, ec)) throw PluginLoadError(where + ": is not a regular file (a device or a pipe?)");
  const uint64_t size = fs::file_size(file, ec);
  std::ifstream in(file, std::ios::binary);
  Elf64_Ehdr h{};
  if (!in.read(reinterpret_cast<char*>(&h), sizeof h) || std::memcmp(h.e_ident, ELFMAG, SELFMAG) != 0)
    throw PluginLoadError(where + ": not a shared library (" +
                          (size < sizeof h ? std::to_string(size) + " bytes, too short for an ELF header"
                                           : std::string("invalid ELF header")) + ")");
  if (h.e_ident[EI_CLASS] != ELFCLASS64) throw PluginLoadError(where + ": a 32-bit library; this trainkit is 64-bit");
#if defined(__x86_64__)
  constexpr uint16_t kMachine = EM_X86_64;
#elif defined(__aarch64__)
  constexpr uint16_t kMachine = EM_AARCH64;
#else
  const uint16_t kMachine = h.e_machine;
#endif
  if (h.e_machine != kMachine)
    throw PluginLoadError(where + ": built for another processor (ELF machine " + std::to_string(h.e_machine) +
                          ", this one is " + std::to_string(kMachine) + ")");
  if (h.e_type != ET_DYN) throw PluginLoadError(where + ": an ELF file, but not a shared library (build it with -shared)");
  auto truncated = [&](const std::string& what) {
    return PluginLoadError(where + ": truncated or damaged (" + what + " beyond the file's " + std::to_string(size) +
                           " bytes); build or copy it again");
  };
  if (h.e_phentsize != sizeof(Elf64_Phdr) || h.e_phoff + uint64_t{h.e_phnum} * sizeof(Elf64_Phdr) > size)
    throw truncated("program headers");
  if (h.e_shoff != 0 && h.e_shoff + uint64_t{h.e_shnum} * h.e_shentsize > size) throw truncated("section headers");
  in.seekg(static_cast<std::streamoff>(h.e_phoff));
  std::vector<Elf64_Phdr> segments(h.e_phnum);
  for (int i = 0; i < h.e_phnum; ++i) {
    Elf64_Phdr& ph = segments[static_cast<size_t>(i)];
    if (!in.read(reinterpret_cast<char*>(&ph), sizeof ph)) throw truncated("program headers");
    if (ph.p_offset > size || ph.p_filesz > size - ph.p_offset) throw truncated("segment " + std::to_string(i));
  }
  check_dynamic(file, in, segments);
}

/// Opens the library and reads its entry point; the handle stays with `lib`.
const tk_plugin_info* open(const fs::path& file, boost::dll::shared_library& lib) {
  const std::string where = file.string();
  check_elf(file);
  boost::dll::fs::error_code ec;
  dlerror();  // Boost.DLL keeps only an error code: the loader's own reason is read here
  lib.load(boost::dll::fs::path(file), boost::dll::load_mode::rtld_lazy | boost::dll::load_mode::rtld_local, ec);
  if (ec) {
    const char* why = dlerror();
    throw PluginLoadError(where + ": cannot load shared library: " + (why ? std::string(why) : ec.message()));
  }
  if (!lib.has(TK_PLUGIN_ENTRY_SYMBOL))
    throw PluginLoadError(where + ": not a trainkit plugin: it does not export the entry point '" +
                          std::string(TK_PLUGIN_ENTRY_SYMBOL) + "' (define it with TK_PLUGIN or TK_LIBRARY)");
  auto entry = lib.get<const tk_plugin_info*()>(TK_PLUGIN_ENTRY_SYMBOL);
  const tk_plugin_info* info = entry();
  if (!info) throw PluginLoadError(where + ": entry point '" TK_PLUGIN_ENTRY_SYMBOL "' returned null");
  // The ABI version is read before anything else: its position is the one thing every version shares.
  if (info->abi_version != TK_PLUGIN_ABI_VERSION)
    throw PluginLoadError(
        where + ": plugin ABI version mismatch: expected " + std::to_string(TK_PLUGIN_ABI_VERSION) + ", got " +
        std::to_string(info->abi_version) + ". Rebuild the plugin against this trainkit (" TK_VERSION
        "): `cmake -S . -B build -DCMAKE_PREFIX_PATH=<trainkit's prefix> && cmake --build build`" +
        (info->abi_version < TK_PLUGIN_ABI_VERSION
             ? "; a plugin written for API " + std::to_string(info->abi_version) +
                   " needs the source changes listed under \"Porting a plugin to API " +
                   std::to_string(TK_PLUGIN_ABI_VERSION) + "\" in docs/plugins.md"
             : std::string("; it was built for a newer trainkit than this one")));
  const std::string tk_version = info->trainkit_version ? info->trainkit_version : "(none)";
  // Within an ABI version a later trainkit only adds functions: a library built against a later
  // one than this may call what this one lacks.
  int major = 0, minor = 0, patch = 0;
  if (std::sscanf(tk_version.c_str(), "%d.%d.%d", &major, &minor, &patch) >= 2 &&
      std::make_tuple(major, minor, patch) > std::make_tuple(TK_VERSION_MAJOR, TK_VERSION_MINOR, TK_VERSION_PATCH))
    throw PluginLoadError(where + ": plugin was built against trainkit " + tk_version + ", newer than this one (" TK_VERSION
                          "): it may use functions this one does not have; rebuild it against this trainkit, or "
                          "run it with trainkit " + tk_version + " or later");
  if (info->layout != abi::kLayoutSignature)
    throw PluginLoadError(where + ": plugin was built with headers whose types have another layout: expected layout " +
                          hex(abi::kLayoutSignature) + " (trainkit " TK_VERSION "), got " + hex(info->layout) +
                          " (trainkit " + tk_version + "); rebuild it against this trainkit with the same compiler settings");
  const std::string name = info->name ? info->name : "";
  if (name.empty()) throw PluginLoadError(where + ": plugin has an empty name");
  const std::string torch = info->torch_version ? info->torch_version : "(none)";
  if (torch != TORCH_VERSION)
    throw PluginLoadError(where + ": plugin '" + name + "' was built against LibTorch " + torch + ", expected " +
                          TORCH_VERSION + " (the LibTorch this trainkit uses)");
  if (!info->register_components)
    throw PluginLoadError(where + ": plugin '" + name + "' has a null registration function");
  return info;
}

LibraryInfo describe(const tk_plugin_info& info, const fs::path& file) {
  return {info.name, info.version ? info.version : "", info.trainkit_version ? info.trainkit_version : "",
          info.torch_version ? info.torch_version : "", file};
}

}  // namespace

PluginLoader::PluginLoader(std::vector<fs::path> dirs) : dirs_(std::move(dirs)) {}

std::string PluginLoader::file_name(const std::string& name) { return "tk_" + name + ".so"; }

std::vector<std::string> PluginLoader::standard_libraries() {
  std::vector<std::string> out;
  std::stringstream ss(TK_STANDARD_LIBRARIES);
  for (std::string n; std::getline(ss, n, ';');)
    if (!n.empty()) out.push_back(n);
  return out;
}

fs::path PluginLoader::own_dir() {
  // Relative to libtrainkit itself, so an installed tree can move and never looks at a build tree.
  boost::dll::fs::error_code ec;
  const fs::path self = fs::path(boost::dll::this_line_location(ec).string()).parent_path();
  std::error_code fec;
  const fs::path installed = self / "trainkit" / "plugins", build = self.parent_path() / "plugins";
  return fs::is_directory(installed, fec) || !fs::is_directory(build, fec) ? installed : build;
}

std::vector<fs::path> PluginLoader::default_dirs(const fs::path& recipe_dir) {
  std::vector<fs::path> dirs;
  if (!recipe_dir.empty()) dirs.push_back(recipe_dir / "plugins");
  if (const char* env = std::getenv("TK_PLUGIN_PATH")) {
    std::stringstream ss(env);
    for (std::string d; std::getline(ss, d, ':');)
      if (!d.empty()) dirs.emplace_back(d);
  }
  dirs.push_back(own_dir());
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

LibraryInfo PluginLoader::inspect(const fs::path& file) const {
  boost::dll::shared_library lib;
  return describe(*open(file, lib), file);
}

LibraryInfo PluginLoader::load(const fs::path& file, Registry& registry) const {
  auto lib = std::make_shared<boost::dll::shared_library>();
  const tk_plugin_info* info = open(file, *lib);
  LibraryInfo out = describe(*info, file);
  const std::string key = fs::weakly_canonical(file).string();
  if (registry.has_library(key)) return out;
  detail::RegistryAccess::set_origin(registry, key, lib);
  try {
    info->register_components(&registry);
  } catch (const PluginLoadError&) {
    detail::RegistryAccess::set_origin(registry, "(in-process)", nullptr);
    throw;
  } catch (const std::exception& e) {
    detail::RegistryAccess::set_origin(registry, "(in-process)", nullptr);
    throw PluginLoadError(file.string() + ": plugin '" + out.name + "' failed to register: " + message_of(e));
  }
  detail::RegistryAccess::set_origin(registry, "(in-process)", nullptr);
  return out;
}

LoadedPlugin PluginLoader::load_plugin(const fs::path& file) const {
  // A registry of its own: the plugin's deleter keeps the library, not the registry.
  Registry registry;
  LibraryInfo info = load(file, registry);
  const auto& plugins = registry.plugins();
  if (plugins.size() != 1)
    throw PluginLoadError(file.string() + ": expected a library with one plugin, it registers " +
                          std::to_string(plugins.size()));
  auto plugin = registry.make_plugin(plugins.front().name);
  return LoadedPlugin{std::move(plugin), plugins.front().name, info.version, file};
}

Contract plugin_contract(const Registry& registry, const std::string& name, const std::string& options) {
  auto plugin = registry.make_plugin(name);  // a constructor's failure: a PluginLoadError naming its library
  if (!plugin) throw PluginLoadError("no plugin '" + name + "' is registered");
  try {
    detail::configure_options(*plugin, options);
    return plugin->contract();
  } catch (const RecipeError&) {
    throw;
  } catch (const std::exception& e) {  // as a run says it
    throw PluginLoadError("plugin '" + name + "' rejected its options or could not say its contract: " + message_of(e));
  }
}

}  // namespace tk
