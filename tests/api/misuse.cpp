// What the plugin API refuses at compile time. Built as it is, in the build (the typed forms
// compile), and once per misuse by ctest's api.misuse.* with TK_MISUSE set to its number: each
// passes only when the compiler refuses the marked line with the expected error.
//   1: a capability given as a bare string (a misspelled "grads.synced" cannot slip by);
//   2: a call of another event's context (set_loss in on_boundary);
//   3: the optimizer changed outside the boundary;
//   4: a hook that takes tk::Context&, as before plugin API 7: it would hide the base's hook and
//      never be called.
#include <tk/plugin.h>
#include <tk/registry.h>

#include <memory>

#ifndef TK_MISUSE
#define TK_MISUSE 0
#endif

namespace {

class Ordered final : public tk::Plugin {
 public:
  tk::Contract contract() const override {
    tk::Contract c;
    c.provides = {tk::Capability{"ordered.own"}};
    c.after = {tk::cap::kGradsSynced, tk::cap::kGradsNormalized};
#if TK_MISUSE == 1
    c.after = {"grads.synced"};  // TK_MISUSE 1: a capability given as a bare string
#endif
    return c;
  }

  void on_loss(tk::LossContext& ctx) override { ctx.set_loss(ctx.loss() * 2.0); }
  void on_boundary(tk::BoundaryContext& ctx) override {
    for (auto& g : ctx.gradients()) g.mul_(0.5);
    ctx.optimizer().zero_grad();
#if TK_MISUSE == 2
    ctx.set_loss(ctx.gradients().front());  // TK_MISUSE 2: set_loss belongs to on_loss
#endif
  }
  void on_step_end(tk::StepEndContext& ctx) override {
    ctx.metric("ordered_groups", static_cast<double>(ctx.optimizer().param_groups().size()));
#if TK_MISUSE == 3
    ctx.optimizer().zero_grad();  // TK_MISUSE 3: the optimizer is read-only after the boundary
#endif
  }
};

#if TK_MISUSE == 4
class OldHook final : public tk::Plugin {
 public:
  void on_boundary(tk::Context& ctx) {}  // TK_MISUSE 4: the hook of plugin API 6
};
#endif

}  // namespace

/// Keeps the classes in the object file, registered as a library registers its plugins.
void tk_misuse_register(tk::Registry& r) {
  r.add_plugin("ordered", "what the API lets through", [] { return std::make_unique<Ordered>(); });
#if TK_MISUSE == 4
  r.add_plugin("old_hook", "a hook of plugin API 6", [] { return std::make_unique<OldHook>(); });
#endif
}
