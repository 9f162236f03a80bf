// What the plugin API refuses at compile time. Built twice: as it is, in the build (the typed
// forms compile), and with TK_MISUSE by ctest's api.misuse, which passes when the compiler refuses
// the marked line: a bare string is no capability, so a misspelled "grads.synced" cannot slip by.
#include <tk/plugin.h>

namespace {

class Ordered final : public tk::Plugin {
 public:
  tk::Contract contract() const override {
    tk::Contract c;
    c.provides = {tk::Capability{"ordered.own"}};
    c.after = {tk::cap::kGradsSynced, tk::cap::kGradsNormalized};
#if TK_MISUSE
    c.after = {"grads.synced"};  // TK_MISUSE: a capability given as a bare string
#endif
    return c;
  }
};

}  // namespace

/// Keeps the class in the object file.
tk::Contract tk_misuse_contract() { return Ordered().contract(); }
