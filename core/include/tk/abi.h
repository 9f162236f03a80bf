#pragma once
/// The C entry point every plugin library exports, and the macro that defines it.
#include <torch/version.h>

#include <cstdint>

#include "tk/plugin.h"

/// Bumped whenever tk::Plugin, tk::Context or this struct change incompatibly.
#define TK_PLUGIN_ABI_VERSION 1u
/// The symbol the loader looks up in a plugin library.
#define TK_PLUGIN_ENTRY_SYMBOL "tk_plugin_entry"

extern "C" {
/// What a plugin library tells the loader. ABI version first, so any future layout can be refused.
struct tk_plugin_info {
  uint32_t abi_version;       ///< TK_PLUGIN_ABI_VERSION of the headers the plugin was built with
  const char* name;           ///< plugin name, as recipes refer to it
  const char* version;        ///< the plugin's own version
  const char* torch_version;  ///< TORCH_VERSION of the LibTorch the plugin was built against
  tk::Plugin* (*create)();    ///< makes a new instance (owned by the loader)
  void (*destroy)(tk::Plugin*);  ///< deletes an instance made by `create`
};
typedef const tk_plugin_info* (*tk_plugin_entry_fn)();
}

#if defined(_WIN32)
#define TK_PLUGIN_EXPORT __declspec(dllexport)
#else
#define TK_PLUGIN_EXPORT __attribute__((visibility("default")))
#endif

/// Defines the entry point of a plugin library for class `Class` (default-constructible).
#define TK_PLUGIN(Class, plugin_name, plugin_version)                                   \
  extern "C" TK_PLUGIN_EXPORT const tk_plugin_info* tk_plugin_entry() {                 \
    static const tk_plugin_info info{                                                   \
        TK_PLUGIN_ABI_VERSION, plugin_name, plugin_version, TORCH_VERSION,              \
        []() -> tk::Plugin* { return new Class(); },                                    \
        [](tk::Plugin* p) { delete p; }};                                               \
    return &info;                                                                       \
  }
