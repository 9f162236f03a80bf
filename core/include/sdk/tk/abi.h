#pragma once
/// The C entry point every plugin library exports, the macros that define it, and the layout
/// signature that lets the loader refuse a library built against other trainkit headers.
#include <torch/version.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "tk/components.h"
#include "tk/context.h"
#include "tk/plugin.h"
#include "tk/registry.h"
#include "tk/version.h"

// What this header declares is libtrainkit's interface: exported (the library hides the rest).
#pragma GCC visibility push(default)

/// Bumped whenever the entry point, tk::Plugin's hooks or an interface type changes
/// incompatibly. Also the SOVERSION of libtrainkit (libtrainkit.so.7).
#define TK_PLUGIN_ABI_VERSION 7u
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

/// FNV-1a of a text, one character at a time (every one of them, a NUL too).
constexpr uint64_t text_hash(std::string_view s) noexcept {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (char c : s) h = mix(h, static_cast<unsigned char>(c));
  return h;
}

#define TK_VIRTUAL_TEXT(R, N, A, Q) #R " " #N #A " " #Q ";"
/// Plugin's virtual table as the headers declare it: each function's return type, name,
/// parameters and qualifier, in order. Another hook, another order or another signature gives
/// another text.
inline constexpr const char kPluginVirtuals[] = TK_PLUGIN_VIRTUALS(TK_VIRTUAL_TEXT);
#undef TK_VIRTUAL_TEXT
#define TK_EVENT_TEXT(hook, event, context) #hook "=" #event "(" #context ");"
/// Which event each hook is (a plugin computes the bits of the hooks it overrides in its own build).
inline constexpr const char kEventHooks[] = TK_EVENT_HOOKS(TK_EVENT_TEXT);
#undef TK_EVENT_TEXT

/// The layout of every type that crosses the boundary between the core and a plugin library, the
/// virtual table of Plugin and which event each of its hooks is, computed from the headers a
/// library is compiled with (the virtual tables of the component interfaces, Model, Dataset,
/// LossFn and LrSchedule, are covered by their sizes only; TensorDataset is there because a
/// plugin library allocates the ones it makes). A library
/// built with other headers, another standard library ABI or other packing gets another value,
/// and the loader refuses it. The contexts, the plan and the plugin base are views of state the
/// core owns (pointers to it), so the core's bookkeeping is not part of it.
inline constexpr uint64_t kLayoutSignature =
    mix(mix(mix(mix(layout_of<Plugin, Context, SetupContext, OutputFiles, Contract, RunPlan, WindowRequest, Window,
                              Counters, WindowTotals, Batch, DataInfo, DataSplits, Model, Dataset, TensorDataset,
                              LossFn, LrSchedule, Options, OptionSpec, OptionValue, OptionBinder, Registry,
                              Component<ModelMaker>, Component<PluginMaker>, StateDict, NamedTensors, std::string,
                              std::function<void()>, std::shared_ptr<void>, at::Tensor>(),
                    text_hash(kPluginVirtuals)),
                text_hash(kEventHooks)),
            static_cast<uint64_t>(kEventCount)),
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
/// (default-constructible), registered as `plugin_name` with a one-line `description` (what
/// `tk-run --list` and `tk-plugin info` show): TK_PLUGIN(Class, plugin_name, plugin_version,
/// description). Another number of arguments is refused with a message that says where the
/// porting notes are (plugin APIs 1 to 3 took three).
#define TK_PLUGIN(...)                                                                                  \
  TK_PLUGIN_PICK_(__VA_ARGS__, TK_PLUGIN_ARGS_, TK_PLUGIN_ARGS_, TK_PLUGIN_4_, TK_PLUGIN_API3_,          \
                  TK_PLUGIN_ARGS_, TK_PLUGIN_ARGS_, ~)(__VA_ARGS__)
#define TK_PLUGIN_PICK_(a1, a2, a3, a4, a5, a6, which, ...) which
#define TK_PLUGIN_4_(Class, plugin_name, plugin_version, description)                                  \
  TK_LIBRARY(plugin_name, plugin_version, [](tk::Registry& r) {                                        \
    r.add_plugin(plugin_name, description, [] { return std::make_unique<Class>(); });                  \
  })
#define TK_PLUGIN_API3_(Class, plugin_name, plugin_version)                                            \
  static_assert(!::tk::detail::is_api1_plugin_v<Class>, TK_API1_PLUGIN_MESSAGE);                        \
  static_assert(sizeof(Class) == 0, "TK_PLUGIN(" #Class ", name, version) is the form of plugin APIs 1 " \
                                    "to 3: since API 4 it is TK_PLUGIN(" #Class ", name, version, "      \
                                    "description), the description one line that tk-run --list shows. " \
                                    TK_PORTING_NOTES);
#define TK_PLUGIN_ARGS_(...)                                                                            \
  static_assert(false, "TK_PLUGIN takes four arguments: TK_PLUGIN(Class, \"name\", \"version\", "       \
                       "\"one-line description\")");

#pragma GCC visibility pop
