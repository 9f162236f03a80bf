// Recomputation (activation checkpointing): chosen blocks of the model keep only their input in
// forward, and are computed again, with gradients on, when backward reaches them. A block's
// activations then live only while backward goes through it: the memory of a step falls from
// that of every block's activations to about one block's, at the cost of one more forward pass
// of the chosen blocks.
//
// The recomputation is a reentrant autograd function, with one difference from
// torch.utils.checkpoint's: the block's parameters are inputs of the function, and the gradients
// the recomputation finds for them are returned to the outer backward rather than accumulated
// inside it. Each parameter then gets its gradient once, through its own accumulator, in the
// outer graph: data parallel's reducer sees it once, and its search for unused parameters finds
// it, with no static graph. The recomputation sees what the first forward saw: the random
// generators' states (CPU, and the GPU the input lives on), autocast on or off and its dtype, and
// the block's buffers (BatchNorm's running statistics are updated once, not twice). Every step is
// the same, bit for bit, as without recomputation.
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <fnmatch.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <mutex>
#include <set>
#include <unordered_set>

#include <tk/abi.h>
#include <tk/blocks.h>
#include <tk/compat.h>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

/// The state one call of a block ran in, to run it again in the same state.
struct Replay final : torch::CustomClassHolder {
  tk::BlockFn fn;
  std::string name;                       // the block's, for errors
  std::vector<at::Tensor> params;         // the block's parameters: the function's inputs after the block's input
  std::vector<at::Tensor> buffers;        // the block's buffers ...
  std::vector<at::Tensor> buffers_before; // ... and their values before the first forward
  std::vector<std::pair<at::Generator, at::Tensor>> rng;  // generator, its state before the first forward
  bool autocast_cpu = false, autocast_cuda = false;
  at::ScalarType cpu_dtype = at::kBFloat16, cuda_dtype = at::kHalf;
};

/// Puts the block's buffers back as they were before its first forward, and their values now back
/// when it ends: after the backward through the recomputation, whose graph may hold them
/// (BatchNorm's running statistics), so that their versions do not change under it.
class BufferSwap {
 public:
  explicit BufferSwap(const Replay& r) {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < r.buffers.size(); ++i) {
      buffers_.emplace_back(r.buffers[i], r.buffers[i].clone());
      r.buffers[i].copy_(r.buffers_before[i]);
    }
  }
  ~BufferSwap() {
    torch::NoGradGuard no_grad;
    for (auto& [buffer, now] : buffers_) buffer.copy_(now);
  }
  BufferSwap(const BufferSwap&) = delete;
  BufferSwap& operator=(const BufferSwap&) = delete;

 private:
  std::vector<std::pair<at::Tensor, at::Tensor>> buffers_;
};

/// Puts back the random generators and autocast of a Replay's first forward for the time of the
/// recomputation, and then what was there before it.
class ReplayState {
 public:
  explicit ReplayState(const Replay& r) {
    for (auto [gen, state] : r.rng) {
      std::lock_guard<std::mutex> lock(gen.mutex());
      rng_.emplace_back(gen, gen.get_state());
      gen.set_state(state);
    }
    cpu_ = {tk::compat::autocast_enabled(at::kCPU), tk::compat::autocast_dtype(at::kCPU)};
    cuda_ = {tk::compat::autocast_enabled(at::kCUDA), tk::compat::autocast_dtype(at::kCUDA)};
    tk::compat::set_autocast(at::kCPU, r.autocast_cpu, r.cpu_dtype);
    tk::compat::set_autocast(at::kCUDA, r.autocast_cuda, r.cuda_dtype);
    nested_ = r.autocast_cpu || r.autocast_cuda;
    if (nested_) at::autocast::increment_nesting();
  }
  ~ReplayState() {
    // Casts of the weights made in the recomputation hold its graph: not for anyone after it.
    if (nested_ && at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    tk::compat::set_autocast(at::kCPU, cpu_.first, cpu_.second);
    tk::compat::set_autocast(at::kCUDA, cuda_.first, cuda_.second);
    for (auto& [gen, state] : rng_) {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    }
  }
  ReplayState(const ReplayState&) = delete;
  ReplayState& operator=(const ReplayState&) = delete;

 private:
  std::vector<std::pair<at::Generator, at::Tensor>> rng_;
  std::pair<bool, at::ScalarType> cpu_, cuda_;
  bool nested_ = false;
};

/// Refuses a recomputed graph that reaches a trainable tensor other than the block's input and
/// parameters: its gradient would be lost (the block's function uses a parameter of a module
/// that Blocks::add did not list).
void check_leaves(const at::Tensor& out, const at::Tensor& input, const Replay& r) {
  std::unordered_set<const c10::TensorImpl*> known{input.unsafeGetTensorImpl()};
  for (const auto& p : r.params) known.insert(p.unsafeGetTensorImpl());
  std::vector<torch::autograd::Node*> todo{out.grad_fn().get()};
  std::unordered_set<torch::autograd::Node*> seen;
  while (!todo.empty()) {
    torch::autograd::Node* node = todo.back();
    todo.pop_back();
    if (!node || !seen.insert(node).second) continue;
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      if (!known.count(acc->variable.unsafeGetTensorImpl()))
        throw std::runtime_error("recompute: block '" + r.name + "' uses a trainable tensor of shape " +
                                 c10::str(acc->variable.sizes()) +
                                 " that is not a parameter of the modules the model lists for it (tk::Blocks::add): "
                                 "its gradient would be lost; list that module with the block");
      continue;
    }
    for (const auto& edge : node->next_edges()) todo.push_back(edge.function.get());
  }
}

/// forward: the block without keeping its activations; backward: the block again, with
/// gradients, and backward through it.
class Recompute final : public torch::autograd::Function<Recompute> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, at::TensorList /*params*/,
                            const c10::intrusive_ptr<Replay>& replay) {
    ctx->save_for_backward({input});
    ctx->saved_data["replay"] = c10::IValue::make_capsule(replay);
    // Autocast would cache casts of the weights made here, whose graph is dropped below, for later
    // uses in the same region; the recomputation makes its own.
    const bool cache = at::autocast::is_autocast_cache_enabled();
    at::autocast::set_autocast_cache_enabled(false);
    struct Restore {
      bool on;
      ~Restore() { at::autocast::set_autocast_cache_enabled(on); }
    } restore{cache};
    // With gradients on, as without recomputation and as in the recomputation: some kernels
    // (attention's, on LibTorch 2.x) are chosen by whether their inputs need gradients. The graph
    // is dropped when the output is detached: only the input is kept.
    at::AutoGradMode grad(true);
    at::Tensor x = input.detach();
    x.requires_grad_(input.requires_grad());
    const int64_t version = input._version();
    at::Tensor y = replay->fn(x);
    if (input._version() != version)
      throw std::runtime_error("recompute: block '" + replay->name +
                               "' changes its input in place; the recomputation would start from the changed values: "
                               "make the block compute out of place, or do not recompute it");
    return y.detach();
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto holder = ctx->saved_data["replay"].toCapsule();
    const Replay& r = *static_cast<const Replay*>(holder.get());
    if (at::GradMode::is_enabled())  // backward with create_graph: the gradients below would have no graph
      throw std::runtime_error("recompute: block '" + r.name +
                               "' is recomputed in a backward that builds a graph (create_graph, higher-order "
                               "gradients), which recomputation does not support: do not recompute it");
    const at::Tensor input = ctx->get_saved_variables().at(0);
    variable_list out(r.params.size() + 2);  // the input's, each parameter's, none for the replay
    if (!grads.at(0).defined()) return out;
    at::Tensor x = input.detach();
    x.requires_grad_(input.requires_grad());
    at::Tensor y;
    BufferSwap buffers(r);
    {
      // Backward then runs as the outer one does: autocast off, the generators where they are.
      ReplayState state(r);
      at::AutoGradMode grad(true);
      y = r.fn(x);
    }
    if (!y.requires_grad()) return out;
    check_leaves(y, x, r);
    std::vector<at::Tensor> wrt;
    std::vector<size_t> slot;
    if (x.requires_grad()) {
      wrt.push_back(x);
      slot.push_back(0);
    }
    for (size_t i = 0; i < r.params.size(); ++i)
      if (r.params[i].requires_grad()) {
        wrt.push_back(r.params[i]);
        slot.push_back(i + 1);
      }
    const variable_list g = torch::autograd::grad({y}, wrt, {grads[0]}, /*retain_graph=*/false, /*create_graph=*/false,
                                                  /*allow_unused=*/true);
    for (size_t k = 0; k < g.size(); ++k) out[slot[k]] = g[k];
    return out;
  }
};

/// What the runner knows of the model's blocks.
struct BlockInfo {
  std::string name;
  std::vector<at::Tensor> params, buffers;
};
using BlockInfos = std::vector<BlockInfo>;

/// Runs block `b` (computed by `fn`) on `x` under recomputation.
at::Tensor run_recomputed(const BlockInfo& b, const at::Tensor& x, const tk::BlockFn& fn) {
  const bool trainable = x.requires_grad() || std::any_of(b.params.begin(), b.params.end(),
                                                          [](const at::Tensor& p) { return p.requires_grad(); });
  if (!at::GradMode::is_enabled() || !trainable) return fn(x);  // validation, or nothing to keep
  auto replay = c10::make_intrusive<Replay>();
  replay->fn = fn;
  replay->name = b.name;
  replay->params = b.params;
  replay->buffers = b.buffers;
  for (const auto& buf : b.buffers) replay->buffers_before.push_back(buf.detach().clone());
  std::vector<at::Generator> gens{at::detail::getDefaultCPUGenerator()};
  if (x.is_cuda()) gens.push_back(at::globalContext().defaultGenerator(x.device()));
  for (auto& gen : gens) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    replay->rng.emplace_back(gen, gen.get_state());
  }
  replay->autocast_cpu = tk::compat::autocast_enabled(at::kCPU);
  replay->cpu_dtype = tk::compat::autocast_dtype(at::kCPU);
  replay->autocast_cuda = tk::compat::autocast_enabled(at::kCUDA);
  replay->cuda_dtype = tk::compat::autocast_dtype(at::kCUDA);
  return Recompute::apply(x, at::TensorList(b.params), replay);
}

class RecomputePlugin final : public tk::Plugin {
 public:
  void bind(tk::OptionBinder& o) override {
    o.add("modules", modules_,
          "patterns (* and ? as in a shell) over the model's block names (\"blocks.*\"), or \"auto\": the memory "
          "planner picks how many blocks, with micro_batch = \"auto\"");
    o.add("every", every_, "recompute every n-th of the blocks the patterns select (2: every other one)");
  }

  void init() override {
    if (modules_.empty()) fail_option(modules_, "give at least one pattern, or \"auto\"");
    for (const auto& m : modules_)
      if (m.empty()) fail_option(modules_, "a pattern is empty");
    auto_ = std::find(modules_.begin(), modules_.end(), "auto") != modules_.end();
    if (auto_ && modules_.size() > 1) fail_option(modules_, "\"auto\" stands alone: the planner picks among every block");
    if (every_ < 1) fail_option(every_, "must be >= 1, got " + std::to_string(every_));
    if (auto_ && option_given(every_)) fail_option(every_, "the planner picks the blocks with modules = \"auto\"; remove every");
  }

  tk::Contract contract() const override {
    tk::Contract c;
    c.provides = {tk::Capability{"model.blocks.runner"}};  // one plugin decides how the blocks run
    return c;
  }

  void setup(tk::SetupContext& s) override {
    tk::Blocks* blocks = tk::blocks_of(s.model());
    if (!blocks)
      fail_option(modules_, "the model lists no blocks to recompute: " + no_blocks_reason(s.model()) + "; its modules: " +
                                module_names(s.model()));
    if (blocks->empty()) fail_option(modules_, "the model has no block (an MLP without hidden layers?)");
    blocks_ = blocks;
    check_block_names(s.model());
    info_ = std::make_shared<BlockInfos>();
    refresh();
    if (auto_) {
      if (!s.plan().micro_batch_auto())
        fail_option(modules_, "\"auto\" leaves the number of recomputed blocks to the memory planner, which runs with "
                              "[batch] micro_batch = \"auto\" (with effective_batch and memory_budget); set "
                              "micro_batch = \"auto\", or name the blocks");
      tk::MemoryLever lever;
      lever.what = "recomputed blocks";
      lever.levels = static_cast<int64_t>(blocks->size());
      lever.set = [this](int64_t n) {
        std::vector<bool> on(blocks_->size(), false);
        for (int64_t i = 0; i < n; ++i) on[static_cast<size_t>(i)] = true;
        select(on);
      };
      s.offer_memory_lever(std::move(lever));
      select(std::vector<bool>(blocks->size(), false));  // until the planner sets it
      s.info("the memory planner picks how many of the " + std::to_string(blocks->size()) +
             " blocks to recompute (the first ones)");
      return;
    }
    select(selection(s.model()));
    s.info("recomputing " + describe() + " in backward");
  }

  void on_fit_start(tk::FitStartContext& ctx) override {
    if (tk::blocks_of(ctx.model()) != blocks_)
      throw std::runtime_error("the model was replaced after recompute's setup: list recompute after the plugin "
                               "that replaces it (a wrapper's blocks are its own)");
    refresh();  // what later plugins' setup changed in the blocks' modules
    if (auto_) ctx.info("recomputing " + describe() + " in backward (picked by the memory planner)");
  }

  void on_step_end(tk::StepEndContext& ctx) override { ctx.metric("recompute_blocks", static_cast<double>(count())); }

 private:
  /// The blocks' parameters and buffers, as they are now.
  void refresh() {
    info_->clear();
    for (size_t i = 0; i < blocks_->size(); ++i)
      info_->push_back({blocks_->name(i), blocks_->parameters(i), blocks_->buffers(i)});
  }

  /// Runs the blocks of `on` recomputed.
  void select(const std::vector<bool>& on) {
    selected_ = on;
    // The runner holds what it needs: it may outlive this plugin, as the model may.
    blocks_->set_runner([info = info_](size_t i, const at::Tensor& x, const tk::BlockFn& fn) {
      return run_recomputed(info->at(i), x, fn);
    }, on);
  }

  /// The blocks the patterns and `every` select; a pattern that selects none is refused.
  std::vector<bool> selection(tk::Model& model) const {
    std::vector<size_t> matched;
    for (const auto& pattern : modules_) {
      bool any = false;
      for (size_t i = 0; i < blocks_->size(); ++i)
        if (fnmatch(pattern.c_str(), blocks_->name(i).c_str(), 0) == 0) {
          any = true;
          if (std::find(matched.begin(), matched.end(), i) == matched.end()) matched.push_back(i);
        }
      if (!any) {
        std::string modules;
        for (const auto& m : model.named_modules("", /*include_self=*/false))
          if (fnmatch(pattern.c_str(), m.key().c_str(), 0) == 0) modules += (modules.empty() ? "" : ", ") + m.key();
        fail_option(modules_, "\"" + pattern + "\" selects no block of the model" +
                                  (modules.empty() ? std::string() : " (it names modules inside or outside blocks: " + modules + ")") +
                                  "; its blocks are " + block_names() + "; its modules: " + module_names(model));
      }
    }
    std::sort(matched.begin(), matched.end());
    std::vector<bool> on(blocks_->size(), false);
    for (size_t j = 0; j < matched.size(); j += static_cast<size_t>(every_)) on[matched[j]] = true;
    return on;
  }

  /// A block named after no module of the model is the model's mistake: said before training.
  void check_block_names(tk::Model& model) const {
    std::set<std::string> names;
    for (const auto& m : model.named_modules("", /*include_self=*/false)) names.insert(m.key());
    for (size_t i = 0; i < blocks_->size(); ++i)
      if (!names.count(blocks_->name(i)))
        throw std::runtime_error("the model lists a block '" + blocks_->name(i) +
                                 "' that is no module path of it (tk::Blocks::add takes the module's name); its modules: " +
                                 module_names(model));
  }

  static std::string no_blocks_reason(tk::Model& model) {
    if (const tk::CompiledModel* compiled = tk::compiled_of(model))
      return "it runs as one compiled graph (" + compiled->compiled_as() +
             "), whose submodules cannot run one at a time (recompute it whole and nothing is saved); write the model "
             "in C++ with tk::Blocks (tk/blocks.h)";
    return "it does not implement tk::ModelWithBlocks (tk/blocks.h), as the built-in gpt, mlp and cnn do";
  }

  static std::string module_names(tk::Model& model) {
    std::string out;
    size_t n = 0;
    for (const auto& m : model.named_modules("", /*include_self=*/false)) {
      if (n++ == 40) return out + ", ...";
      out += (out.empty() ? "" : ", ") + m.key();
    }
    return out.empty() ? "(none)" : out;
  }

  std::string block_names() const {
    std::string out;
    for (size_t i = 0; i < blocks_->size(); ++i) out += (i ? ", " : "") + blocks_->name(i);
    return out;
  }

  int64_t count() const { return std::count(selected_.begin(), selected_.end(), true); }

  std::string describe() const {
    std::string names;
    for (size_t i = 0; i < selected_.size(); ++i)
      if (selected_[i]) names += (names.empty() ? "" : ", ") + blocks_->name(i);
    return std::to_string(count()) + " of " + std::to_string(selected_.size()) + " blocks" +
           (names.empty() ? std::string() : " (" + names + ")");
  }

  std::vector<std::string> modules_{"*"};
  int64_t every_ = 1;
  bool auto_ = false;
  // The model's, which outlives this plugin's calls (a plugin that replaces the model holds the
  // old one: on_fit_start checks that the model's blocks are still these). Not a ModelPtr: the
  // model's code lives in its library, which may be gone when this plugin is.
  tk::Blocks* blocks_ = nullptr;
  std::shared_ptr<BlockInfos> info_;
  std::vector<bool> selected_;
};

}  // namespace

TK_PLUGIN(RecomputePlugin, "recompute", "0.1.0",
          "recomputation (activation checkpointing): chosen blocks keep only their input in forward and run again "
          "in backward; steps are bit-identical")
