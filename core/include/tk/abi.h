#pragma once
/// The C entry point every plugin library exports, the macros that define it, and the layout
/// signature that lets the loader refuse a library built against other trainkit headers.
#include <torch/version.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "tk/components.h"
#include "tk/context.h"
#include "tk/plugin.h"
#include "tk/registry.h"
#include "tk/version.h"

/// Bumped whenever the entry point, tk::Plugin's hooks or tk::Context change incompatibly.
#define TK_PLUGIN_ABI_VERSION 3u
/// The symbol the loader looks up in a plugin library.
#define TK_PLUGIN_ENTRY_SYMBOL "tk_plugin_entry"

namespace tk::abi {

constexpr uint64_t mix(uint64_t h, uint64_t v) noexcept { return (h ^ v) * 0x100000001b3ULL; }  // FNV-1a step

/// A hash of the size and alignment of each type, in order.
template <class... Ts>
constexpr uint64_t layout_of() noexcept {
  uint64_t h = 0xcbf29ce484222325ULL;
  ((h = mix(mix(h, sizeof(Ts)), alignof(Ts))), ...);
  return h;
}

/// The layout of every type that crosses the boundary between the core and a plugin library,
/// computed from the headers a library is compiled with. A library built with other headers,
/// another standard library ABI or other packing gets another value, and the loader refuses it.
inline constexpr uint64_t kLayoutSignature =
    mix(layout_of<Plugin, Context, SetupContext, Contract, RunPlan, Window, Counters, WindowTotals, Batch, DataInfo,
                  DataSplits, Options, OptionSpec, OptionValue, Registry, Component<ModelMaker>, Component<PluginMaker>,
                  StateDict, std::string, std::function<void()>, std::shared_ptr<void>, at::Tensor>(),
        TK_PLUGIN_ABI_VERSION);

}  // namespace tk::abi

extern "C" {
/// What a plugin library tells the loader. ABI version first, so any future layout can be refused.
struct tk_plugin_info {
  uint32_t abi_version;          ///< TK_PLUGIN_ABI_VERSION of the headers the library was built with
  uint64_t layout;               ///< tk::abi::kLayoutSignature of those headers
  const char* trainkit_version;  ///< TK_VERSION of those headers
  const char* torch_version;     ///< TORCH_VERSION of the LibTorch the library was built against
  const char* name;              ///< the library's name (tk_<name>.so)
  const char* version;           ///< the library's own version
  /// Registers the library's plugins and components; called once per run that loads it.
  void (*register_components)(tk::Registry* registry);
};
typedef const tk_plugin_info* (*tk_plugin_entry_fn)();
}

#if defined(_WIN32)
#define TK_PLUGIN_EXPORT __declspec(dllexport)
#else
#define TK_PLUGIN_EXPORT __attribute__((visibility("default")))
#endif

/// Defines the entry point of a library whose `register_fn(tk::Registry&)` registers any number
/// of plugins, models, data sets, losses, optimizers and schedules.
#define TK_LIBRARY(lib_name, lib_version, register_fn)                                             \
  extern "C" TK_PLUGIN_EXPORT const tk_plugin_info* tk_plugin_entry() {                            \
    static const tk_plugin_info info{TK_PLUGIN_ABI_VERSION, ::tk::abi::kLayoutSignature, TK_VERSION, \
                                     TORCH_VERSION,         lib_name,                    lib_version, \
                                     [](tk::Registry* r) { register_fn(*r); }};                    \
    return &info;                                                                                  \
  }

/// Defines the entry point of a library that holds one strategy plugin, class `Class`
/// (default-constructible), registered as `plugin_name`.
#define TK_PLUGIN(Class, plugin_name, plugin_version)                                                \
  TK_LIBRARY(plugin_name, plugin_version, [](tk::Registry& r) {                                      \
    r.add_plugin(plugin_name, "", []() -> std::unique_ptr<tk::Plugin> { return std::make_unique<Class>(); }); \
  })
