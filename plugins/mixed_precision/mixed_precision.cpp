// Mixed precision: autocast around forward and loss (bf16 or fp16, on CPU or CUDA), and for fp16 a
// dynamic loss scaler with PyTorch GradScaler's semantics.
//
// The loss scaler is on for fp16 (loss_scale = "auto"), and can be forced on or off.
// fp16: the loss is multiplied by the scale before backward. At the boundary, after gradient sync
// and normalization and before clipping (its contract says so), gradients are unscaled once and
// checked; a non-finite gradient vetoes the step, the scale backs off and the skip is counted.
// After `growth_interval` clean steps in a row the scale grows. The scale changes only after
// unscaling. bf16 needs no scaler.
#include <tk/abi.h>
#include <tk/compat.h>
#include <tk/world.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace {

enum class LossScale { Auto, Dynamic, None };

/// Whether this LibTorch has Half matrix kernels on `device` (CPU ones came with LibTorch 2.x).
bool half_matmul_works(at::DeviceType device) {
  try {
    auto a = at::ones({2, 2}, at::TensorOptions().dtype(at::kHalf).device(device));
    at::mm(a, a);
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

/// What /proc/cpuinfo (or the file TK_CPUINFO names, for the tests) says of the CPU's native bf16
/// instructions: `listed` is false when the file cannot be read or has no line of flags.
struct Bf16Support {
  std::string file;
  bool listed = false, arm = false;
  std::string found;  // "AVX512-BF16", "AMX-BF16", both joined by " and ", Arm's "BF16"; "" when none
};

Bf16Support native_bf16() {
  const char* override_file = std::getenv("TK_CPUINFO");
  Bf16Support out;
  out.file = override_file && *override_file ? override_file : "/proc/cpuinfo";
  std::ifstream in(out.file);
  for (std::string line; in && std::getline(in, line);) {
    const bool x86 = line.rfind("flags", 0) == 0, arm = line.rfind("Features", 0) == 0;
    const size_t colon = line.find(':');
    if ((!x86 && !arm) || colon == std::string::npos) continue;
    out.listed = true;
    out.arm = arm;
    std::istringstream words(line.substr(colon + 1));
    for (std::string w; words >> w;) {
      const char* name = w == "avx512_bf16" ? "AVX512-BF16" : w == "amx_bf16" ? "AMX-BF16" : (arm && w == "bf16") ? "BF16" : nullptr;
      if (name) out.found += (out.found.empty() ? "" : " and ") + std::string(name);
    }
    return out;  // the first processor's line speaks for all
  }
  return out;
}

class MixedPrecision final : public tk::Plugin {
 public:
  void bind(tk::OptionBinder& o) override {
    o.choice("dtype", dtype_, "lower precision of autocast", {{"bf16", at::kBFloat16}, {"fp16", at::kHalf}});
    o.choice("loss_scale", loss_scale_, "dynamic loss scaling: auto (on for fp16), dynamic or none",
             {{"auto", LossScale::Auto}, {"dynamic", LossScale::Dynamic}, {"none", LossScale::None}});
    o.add("init_scale", scale_, "fp16: initial loss scale");
    o.add("growth_factor", growth_, "fp16: scale multiplier after growth_interval clean steps");
    o.add("backoff_factor", backoff_, "fp16: scale multiplier after an overflow");
    o.add("growth_interval", interval_, "fp16: clean steps in a row before the scale grows");
    o.add("check_every_micro_batch", check_each_, "fp16: look for overflow after every backward, not only at the boundary");
    o.add("advance_schedule_on_skip", advance_on_skip_, "fp16: whether a skipped step advances the LR schedule");
  }

  void init() override {
    fp16_ = dtype_ == at::kHalf;
    scaling_ = loss_scale_ == LossScale::Dynamic || (loss_scale_ == LossScale::Auto && fp16_);
    if (!(scale_ > 0) || std::isinf(scale_)) fail_option(scale_, "must be a positive finite number");
    if (!(growth_ > 1.0)) fail_option(growth_, "must be > 1");
    if (!(backoff_ > 0.0 && backoff_ < 1.0)) fail_option(backoff_, "must be in (0, 1)");
    if (interval_ < 1) fail_option(interval_, "must be >= 1");
    const auto& o = options();
    if (!fp16_ && loss_scale_ == LossScale::Dynamic)
      notes_.push_back("dtype = \"bf16\" needs no loss scaler; using one because loss_scale = \"dynamic\" (" +
                       o.where("loss_scale").str() + ")");
    if (fp16_ && loss_scale_ == LossScale::None) notes_.push_back("fp16 without a loss scaler: small gradients may underflow to zero");
    if (scaling_) return;
    const std::string why = fp16_ ? "loss_scale = \"none\"" : "dtype = \"bf16\" needs no loss scaler";
    auto ignored = [&](bool given, const char* key) {
      if (given) notes_.push_back(why + "; ignoring " + key + " (" + o.where(key).str() + ")");
    };
    ignored(option_given(scale_), "init_scale");
    ignored(option_given(growth_), "growth_factor");
    ignored(option_given(backoff_), "backoff_factor");
    ignored(option_given(interval_), "growth_interval");
    ignored(option_given(check_each_), "check_every_micro_batch");
    ignored(option_given(advance_on_skip_), "advance_schedule_on_skip");
  }

  void configure(tk::RunPlan& plan) override {
    sharded_ = plan.has(tk::cap::kGradsSharded) && plan.world_size() > 1;
    device_ = plan.device();
    if (device_ != at::kCPU && device_ != at::kCUDA)
      fail_option(dtype_, std::string("autocast works on CPU and CUDA, not ") + c10::DeviceTypeName(device_));
    if (fp16_ && !half_matmul_works(device_))
      fail_option(dtype_, std::string("fp16 needs Half kernels on ") + c10::DeviceTypeName(device_, true) +
                                 ", which LibTorch " TORCH_VERSION " lacks (CPU ones came with LibTorch 2.x); use "
                                 "dtype = \"bf16\" here, or fp16 on CUDA");
  }

  tk::Contract contract() const override {
    tk::Contract c;
    c.provides = {tk::cap::kAutocast};
    if (scaling_) {
      c.provides.push_back(tk::cap::kLossScale);
      c.provides.push_back(tk::cap::kGradsUnscaled);
    }
    c.after = {tk::cap::kGradsSynced, tk::cap::kGradsNormalized};
    return c;
  }

  // Checked and said as the run is planned (so by --dry-run too), once.
  void setup(tk::SetupContext& ctx) override {
    for (const auto& p : ctx.model().parameters())
      if (p.scalar_type() != at::kFloat)
        fail_option(dtype_, "autocast needs float32 parameters, and the model's are " +
                                (p.scalar_type() == at::kDouble ? std::string("float64")
                                                                : std::string(c10::toString(p.scalar_type()))) +
                                ": set run.dtype = \"float32\"");
    for (const auto& n : notes_) ctx.warn(n);
    notes_.clear();
    if (device_ == at::kCPU && !fp16_) say_bf16(ctx);
  }
  void on_micro_batch(tk::MicroBatchContext&) override { enter(); }
  void on_loss(tk::LossContext& ctx) override {
    leave();
    if (scaling_) ctx.set_loss(ctx.loss() * scale_);
  }
  void on_backward(tk::BackwardContext& ctx) override {
    if (!scaling_ || !check_each_) return decline(tk::Event::Backward);  // nothing to check per micro-batch
    // Sharded gradients are a rank's sums only after the window's last backward (before it, they
    // may all be sent away already): the earlier ones are checked there, in the sums.
    if (sharded_ && !ctx.window().is_last()) return;
    if (!overflow_ && !all_finite(ctx)) {
      overflow_ = true;
      ctx.info("gradient overflow at micro-batch " + std::to_string(ctx.window().index + 1) + " of " +
               std::to_string(ctx.window().size) + " (step " + std::to_string(ctx.counters().step + 1) + ")");
    }
  }
  void on_boundary(tk::BoundaryContext& ctx) override {
    if (!scaling_) return decline(tk::Event::Boundary);  // bf16 needs no unscaling
    boundary(ctx);
  }
  void on_step_end(tk::StepEndContext& ctx) override {
    if (!scaling_) return decline(tk::Event::StepEnd);
    step_end(ctx);
  }
  void on_validation_start(tk::ValidationStartContext&) override { enter(); }
  void on_validation_end(tk::ValidationEndContext&) override { leave(); }
  void on_fit_end(tk::FitEndContext&) override { leave(); }

  tk::StateDict state() const override {
    return {{"scale", torch::tensor(scale_, torch::kDouble)},
            {"growth_tracker", torch::tensor(tracker_)},
            {"skipped", torch::tensor(skipped_)}};
  }
  void load_state(const tk::StateDict& s) override {
    scale_ = s.at("scale").item<double>();
    tracker_ = s.at("growth_tracker").item<int64_t>();
    skipped_ = s.at("skipped").item<int64_t>();
  }

 private:
  /// Whether bf16 pays on this CPU: with native bf16 instructions LibTorch's bf16 matrix products
  /// are faster than float32; without them they are emulated, and can be many times slower.
  static void say_bf16(const tk::PluginLog& ctx) {
    const Bf16Support cpu = native_bf16();
    if (!cpu.listed)
      ctx.info("bf16 autocast on the CPU; " + cpu.file + " does not say which bf16 instructions it has: measure with "
               "bench/precision.sh whether bf16 is faster than float32 here");
    else if (cpu.found.empty())
      ctx.warn(std::string("this CPU has no native bf16 instructions (no ") + (cpu.arm ? "BF16" : "AVX512-BF16 or AMX-BF16") +
               " in " + cpu.file + "): LibTorch emulates bf16 matrix products, which can be many times slower than "
               "float32 (25x was measured on an AVX2-only machine, docs/benchmarks.md); train in float32 (without "
               "mixed_precision), or measure with bench/precision.sh");
    else
      ctx.info("bf16 autocast on a CPU with native bf16 instructions (" + cpu.found + ")");
  }

  void enter() {
    if (active_) return;
    prev_enabled_ = tk::compat::autocast_enabled(device_);
    prev_dtype_ = tk::compat::autocast_dtype(device_);
    tk::compat::set_autocast(device_, true, dtype_);
    at::autocast::increment_nesting();
    active_ = true;
  }

  void leave() {
    if (!active_) return;
    // Casts of the weights are cached inside an autocast region; they are stale after a step.
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    tk::compat::set_autocast(device_, prev_enabled_, prev_dtype_);
    active_ = false;
  }

  /// Multiplies the gradients by `inv_scale` (1: leaves them) and returns a flag on the device,
  /// nonzero when any holds an inf or a NaN: on CUDA from the fused kernel GradScaler uses,
  /// elsewhere from foreach ops and one reduction over all gradients. Nothing is read to the host.
  static at::Tensor unscale_and_find_inf(std::vector<at::Tensor> grads, double inv_scale) {
    torch::NoGradGuard no_grad;
    if (grads.empty()) return at::zeros({1});
    const auto opts = grads.front().options().dtype(at::kFloat);
    if (grads.front().is_cuda()) {
      at::Tensor found = at::zeros({1}, opts);
      at::_amp_foreach_non_finite_check_and_unscale_(grads, found, at::full({1}, inv_scale, opts));
      return found;
    }
    if (inv_scale != 1.0) at::_foreach_mul_(grads, inv_scale);
    // A gradient's largest magnitude is inf or NaN exactly when one of its elements is: one
    // reduction per gradient and none of isfinite's gradient-sized masks (an empty gradient, which
    // has no largest magnitude, holds nothing to check).
    std::vector<at::Tensor> nonempty;
    for (const auto& g : grads)
      if (g.numel() > 0) nonempty.push_back(g);
    if (nonempty.empty()) return at::zeros({1}, opts);
    return at::logical_not(at::isfinite(at::stack(at::_foreach_norm(nonempty, INFINITY)))).any().reshape({1});
  }

  /// Whether any rank found an overflow: with sharded gradients each rank checked its share only.
  at::Tensor over_world(tk::Context& ctx, at::Tensor found) const {
    if (!sharded_) return found;
    found = found.to(at::kFloat);  // a flag of any dtype (bool: the CPU's); backends reduce numbers
    ctx.world().all_reduce(found, tk::ReduceOp::Max);
    return found;
  }

  /// With check_every_micro_batch: a host read per micro-batch, as that option asks.
  bool all_finite(tk::BackwardContext& ctx) const {
    return ctx.read(over_world(ctx, unscale_and_find_inf(ctx.gradients(), 1.0))).front() == 0.0;
  }

  void boundary(tk::BoundaryContext& ctx) {
    used_ = scale_;
    ctx.metric("loss_scale", used_);
    vetoed_here_ = overflow_;
    if (overflow_) {
      ctx.veto_step("gradient overflow (inf or NaN) at loss scale " + format(used_), advance_on_skip_);
    } else {
      // Unscaled and checked on the device; the core reads the flag with the step's other values
      // and skips the step when it is set. The scale follows in on_step_end.
      ctx.veto_step_if(over_world(ctx, unscale_and_find_inf(ctx.gradients(), 1.0 / scale_)),
                       "gradient overflow (inf or NaN) at loss scale " + format(used_), advance_on_skip_);
    }
    overflow_ = false;
  }

  /// The loss scale after the step: backed off after an overflow (the step was skipped), grown
  /// after `growth_interval` steps without one.
  void step_end(tk::StepEndContext& ctx) {
    if (vetoed_here_ || ctx.flag_was_set()) {
      scale_ = used_ * backoff_;
      tracker_ = 0;
      ++skipped_;
      ctx.info("step " + std::to_string(ctx.counters().step) + " skipped: gradient overflow; loss scale " +
               format(used_) + " -> " + format(scale_));
    } else if (++tracker_ == interval_) {
      scale_ *= growth_;
      tracker_ = 0;
    }
    ctx.metric("amp_skipped_steps", static_cast<double>(skipped_));
  }

  static std::string format(double v) {
    std::ostringstream s;
    s << v;
    return s.str();
  }

  // Options, with their defaults.
  at::ScalarType dtype_ = at::kBFloat16;
  LossScale loss_scale_ = LossScale::Auto;
  double scale_ = 65536.0, growth_ = 2.0, backoff_ = 0.5;
  int64_t interval_ = 2000;
  bool check_each_ = false, advance_on_skip_ = false;
  // Derived from them, and state.
  bool fp16_ = false, scaling_ = false;
  bool sharded_ = false;  // each rank holds its share of the gradients: overflow is decided over the world
  double used_ = 65536.0;
  int64_t tracker_ = 0, skipped_ = 0;
  bool overflow_ = false, vetoed_here_ = false;
  std::vector<std::string> notes_;
  at::DeviceType device_ = at::kCPU;
  bool active_ = false, prev_enabled_ = false;
  at::ScalarType prev_dtype_ = at::kBFloat16;
};

}  // namespace

TK_PLUGIN(MixedPrecision, "mixed_precision", "0.2.0",
          "bf16 or fp16 autocast around forward and loss, with a dynamic loss scaler for fp16")
