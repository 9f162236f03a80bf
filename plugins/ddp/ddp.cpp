// Distributed data parallel on c10d's Reducer, the bucketed gradient all-reduce that PyTorch's
// DistributedDataParallel runs on, over the run's world (tk/world.h: the core joins it, Gloo on
// the CPU, NCCL on CUDA).
//
// Every rank starts from rank 0's parameters and buffers (after checking that every rank built
// the same model), reads its own shard of each epoch (the core strides the shared shuffle by
// rank) and accumulates gradients locally over a window's micro-batches. The window's last
// backward is the one the reducer is armed for: as each bucket of gradients becomes ready, its
// sum over ranks is launched while backward goes on computing the rest, so communication
// overlaps computation. Parameters a rank did not use get zeros from it (the unused-parameter
// search, on by default), so ranks may take different branches of a model. At the boundary the
// window's totals (micro-batches, samples, tokens, loss) are summed too, so that normalization
// divides by the global counts and the step equals the single-process step on the global window.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <tk/abi.h>
#include <tk/compat.h>
#include <tk/sharded_state.h>
#include <tk/world.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <sstream>

namespace {

using Clock = std::chrono::steady_clock;

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

/// When the reducer launched the all-reduces of the current window's last backward. The reducer
/// calls its communication hook from autograd's thread (the caller's on the CPU, a device thread
/// on CUDA); the plugin reads these after backward has returned.
struct Launches {
  std::mutex m;
  Clock::time_point first, last;
  int64_t count = 0;

  void reset() {
    std::lock_guard<std::mutex> lock(m);
    count = 0;
  }
  void launched() {
    std::lock_guard<std::mutex> lock(m);
    last = Clock::now();
    if (count++ == 0) first = last;
  }
};

/// The reducer's communication hook: each bucket summed over ranks, in place. (Without a hook the
/// reducer divides by the world size; trainkit's normalization divides by the window's global
/// counts instead.)
class SumHook final : public c10d::CommHookInterface {
 public:
  SumHook(c10::intrusive_ptr<c10d::ProcessGroup> group, std::shared_ptr<Launches> launches)
      : group_(std::move(group)), launches_(std::move(launches)) {}
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    launches_->launched();
    std::vector<at::Tensor> tensors{bucket.getBufferRef()};
    return group_->allreduce(tensors)->getFuture();
  }
  /// The all-reduce's future holds the list of tensors it reduced: one, the bucket.
  at::Tensor parseHookResult(const c10::IValue& result) override {
    return result.isTensor() ? result.toTensor() : result.toTensorVector().at(0);
  }

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::shared_ptr<Launches> launches_;
};

/// c10d's Reducer, told which parameters a window's earlier micro-batches used. LibTorch 1.x's
/// reducer records use only in the backward it is armed for (a window's last; 2.x records it in
/// the window's other backwards too, and marking again changes nothing), so a parameter used in an
/// earlier micro-batch and not in the last would count as unused everywhere: its gradient left
/// unsummed on the ranks that have one, absent on the others. Marking every parameter that holds
/// a gradient as used gives it the sum over ranks, zeros for the ranks without one.
class WindowReducer final : public c10d::Reducer {
 public:
  using c10d::Reducer::Reducer;
  /// After prepare_for_backward, before backward (its used-map is cleared when a backward ends).
  void mark_used(const std::vector<int64_t>& indices) {
    if (indices.empty() || !local_used_map_.defined()) return;
    local_used_map_.index_fill_(0, torch::tensor(indices, torch::kLong), 1);
  }
};

/// A name hashed, to compare names across ranks as numbers.
int64_t name_hash(const std::string& s) { return static_cast<int64_t>(tk::abi::text_hash(s) >> 1); }

/// One parameter's or buffer's description, the same width for every tensor: its name's hash,
/// dtype, dimensions (up to kDims; more are folded into the last) and trainability.
constexpr int kDims = 8;
constexpr int kWidth = kDims + 4;

void describe(const std::string& name, const at::Tensor& t, std::vector<int64_t>& out) {
  out.push_back(name_hash(name));
  out.push_back(static_cast<int64_t>(t.scalar_type()));
  out.push_back(t.dim());
  for (int d = 0; d < kDims; ++d) {
    int64_t v = d < t.dim() ? t.size(d) : -1;
    for (int64_t e = kDims; d == kDims - 1 && e < t.dim(); ++e) v = v * 1000003 + t.size(e);
    out.push_back(v);
  }
  out.push_back(t.requires_grad() ? 1 : 0);
}

std::string shape_of(const int64_t* row) {
  std::ostringstream s;
  s << "[";
  for (int64_t d = 0; d < std::min<int64_t>(row[2], kDims); ++d) s << (d ? ", " : "") << row[3 + d];
  if (row[2] > kDims) s << ", ...";
  s << "] " << c10::toString(static_cast<at::ScalarType>(row[1])) << (row[3 + kDims] ? "" : ", frozen");
  return s.str();
}

class Ddp final : public tk::Plugin {
 public:
  void bind(tk::OptionBinder& o) override {
    o.add("bucket_mb", bucket_mb_, "size of the gradient buckets all-reduced together (PyTorch DDP's bucket_cap_mb)");
    o.add("first_bucket_mb", first_bucket_mb_,
          "size of the first bucket, the one launched earliest in backward (PyTorch DDP uses 1 MiB)");
    o.add("find_unused_parameters", find_unused_,
          "search each window's last backward for parameters that get no gradient and count them as zero on that "
          "rank; false skips the search for models that use every parameter, and a parameter that turns out unused "
          "is then an error");
    o.add("check_every", check_every_, "every N steps, verify that all ranks hold the same parameters (0: never)");
    // Settings that moved: the world is the core's ([world]), the sharded optimizer the shard plugin's.
    o.add("backend", moved_backend_, "moved to [world] backend", {"", "auto", "gloo", "nccl"}).retired();
    o.add("timeout_s", moved_timeout_s_, "moved to [world] timeout_s").retired();
    o.add("rendezvous_timeout_s", moved_rendezvous_timeout_s_, "moved to [world] rendezvous_timeout_s").retired();
    o.add("zero_stage", moved_zero_stage_, "moved to the shard plugin's stage").retired();
  }

  void init() override {
    if (!(bucket_mb_ > 0)) fail_option(bucket_mb_, "must be > 0");
    if (!(first_bucket_mb_ > 0)) fail_option(first_bucket_mb_, "must be > 0");
    if (check_every_ < 0) fail_option(check_every_, "must be >= 0");
    const char* world = "the world (its backend and timeouts) is the run's, set in the recipe's [world] section: ";
    if (option_given(moved_backend_)) fail_option(moved_backend_, world + std::string("write backend there"));
    if (option_given(moved_timeout_s_)) fail_option(moved_timeout_s_, world + std::string("write timeout_s there"));
    if (option_given(moved_rendezvous_timeout_s_))
      fail_option(moved_rendezvous_timeout_s_, world + std::string("write rendezvous_timeout_s there"));
    if (option_given(moved_zero_stage_))
      fail_option(moved_zero_stage_, "the sharded optimizer is its own plugin now: write [[plugins]] name = \"shard\" "
                                     "with stage = " + std::to_string(moved_zero_stage_) + " instead");
    bucket_bytes_ = static_cast<int64_t>(std::min(bucket_mb_ * 1024 * 1024, 1e15));
    first_bucket_bytes_ = static_cast<int64_t>(std::min(first_bucket_mb_ * 1024 * 1024, 1e15));
  }

  tk::Contract contract() const override {
    tk::Contract c;
    c.provides = {tk::cap::kGradsSynced};
    // Gradients sharded by another plugin are summed onto their owners before the window's totals.
    c.after = {tk::cap::kGradsSharded};
    return c;
  }

  void configure(tk::RunPlan& plan) override {
    // Without a normalizer, a mean loss is averaged over ranks here, as single-process training
    // would average it over the global batch; a sum loss stays a sum.
    average_ = !plan.has(tk::cap::kGradsNormalized) && plan.reduction() == tk::Reduction::Mean;
    // Sharded gradients are summed by the plugin that shards them: no reducer here.
    sharded_grads_ = plan.has(tk::cap::kGradsSharded);
    // The reducer makes the gradients views of its buckets, which must outlive each step.
    if (plan.world_size() > 1 && !sharded_grads_) plan.keep_gradients();
  }

  void on_fit_start(tk::FitStartContext& ctx) override {
    world_ = &ctx.world();
    // A world of one has nothing to sum; a dry run's world is not joined (no process group).
    if (world_->size() == 1 || !world_->process_group()) return;
    check_same_model(ctx.model());
    broadcast_from_rank0(ctx.model());
    for (auto& [name, p] : tk::distinct_parameters(ctx.model()))  // a tied parameter is summed once
      if (p.requires_grad()) {
        param_names_.push_back(std::move(name));
        params_.push_back(std::move(p));
      }
    if (params_.empty()) throw std::runtime_error("the model has no trainable parameter: nothing for data parallel to sum");
    if (sharded_grads_) {
      std::string ignored;
      int count = 0;
      for (const auto& [given, key] : {std::pair<bool, const char*>{option_given(bucket_mb_), "bucket_mb"},
                                       {option_given(first_bucket_mb_), "first_bucket_mb"},
                                       {option_given(find_unused_), "find_unused_parameters"}})
        if (given) ignored += (count++ ? ", " : "; ") + std::string(key);
      ctx.info("the gradients are sharded: each is summed onto the rank that updates it by the plugin that shards them, "
               "and data parallel sums the windows' counts" +
               (ignored.empty() ? std::string() : ignored + " (the reducer's) " + (count > 1 ? "do" : "does") + " not apply"));
    }
    else
      build_reducer(ctx);
  }

  void on_loss(tk::LossContext& ctx) override {
    if (!reducer_) return decline(tk::Event::Loss);
    if (!ctx.window().is_last()) return;  // the window's other micro-batches accumulate locally
    // The buckets are never rebuilt in the order gradients became ready (PyTorch does so once,
    // after the first iteration, without the unused-parameter search): a resumed run then sums in
    // the same buckets, so the same order, as the run it continues.
    std::vector<int64_t> used;
    for (size_t i = 0; i < params_.size(); ++i)
      if (params_[i].grad().defined()) used.push_back(static_cast<int64_t>(i));
    launches_->reset();
    std::fill(got_grad_->begin(), got_grad_->end(), 0);
    const auto t0 = Clock::now();
    {
      // LibTorch notes on every rank when its search found every parameter used; the first
      // boundary says it once for the world, in this plugin's words (search_note).
      tk::compat::WarningFilter quiet("did not find any unused parameters");
      reducer_->prepare_for_backward({ctx.loss()});
    }
    reducer_->mark_used(used);
    backward_start_ = Clock::now();
    prepare_ms_ = ms_between(t0, backward_start_);
  }

  void on_backward(tk::BackwardContext& ctx) override {
    if (!reducer_) return decline(tk::Event::Backward);
    if (!ctx.window().is_last()) return;
    const auto end = Clock::now();
    std::lock_guard<std::mutex> lock(launches_->m);
    if (launches_->count != buckets_) throw std::runtime_error(unused_message(ctx));
    unused_ = std::count(got_grad_->begin(), got_grad_->end(), 0);
    backward_ms_ = ms_between(backward_start_, end);
    overlap_ms_ = ms_between(launches_->first, launches_->last);
    wait_ms_ = ms_between(launches_->last, end);
  }

  void on_boundary(tk::BoundaryContext& ctx) override {
    if (params_.empty()) return decline(tk::Event::Boundary);
    const auto t0 = Clock::now();
    torch::NoGradGuard no_grad;
    if (average_)
      for (auto& p : params_)
        if (p.grad().defined()) p.mutable_grad().div_(world_->size());
    // The window's counts, the parameters each rank left without a gradient and the loss (still on
    // the device) in one all-reduce; the counts come back to the host (normalization needs them
    // there), the loss stays for the core's read.
    tk::WindowTotals& t = ctx.mutable_totals();
    auto totals = torch::tensor({static_cast<double>(t.micro_batches), static_cast<double>(t.samples),
                                 static_cast<double>(t.tokens), static_cast<double>(unused_), 0.0},
                                torch::kDouble)
                      .to(params_.front().device());
    if (t.loss.defined()) totals.select(0, 4).copy_(t.loss);
    world_->all_reduce(totals);
    const std::vector<double> counts = ctx.read(totals.slice(0, 0, 4));
    t.micro_batches = std::llround(counts[0]);
    t.samples = std::llround(counts[1]);
    t.tokens = std::llround(counts[2]);
    t.loss = totals.select(0, 4);
    ++syncs_;
    if (!reducer_) {  // the gradients were summed by the plugin that shards them: the totals alone
      allreduces_ += 1;
      ctx.metric("ddp_boundary_ms", ms_between(t0, Clock::now()));
      ctx.metric("ddp_syncs", static_cast<double>(syncs_));
      ctx.metric("ddp_allreduces", static_cast<double>(allreduces_));
      return;
    }
    search_note(ctx, std::llround(counts[3]));
    // The buckets, the used-map the unused-parameter search sums, and the totals.
    allreduces_ += buckets_ + (find_unused_ ? 1 : 0) + 1;
    ctx.metric("ddp_boundary_ms", ms_between(t0, Clock::now()));
    ctx.metric("ddp_backward_ms", backward_ms_);
    ctx.metric("ddp_overlap_ms", overlap_ms_);
    ctx.metric("ddp_wait_ms", wait_ms_);
    ctx.metric("ddp_prepare_ms", prepare_ms_);
    ctx.metric("ddp_buckets", static_cast<double>(buckets_));
    ctx.metric("ddp_unused", static_cast<double>(unused_));
    ctx.metric("ddp_syncs", static_cast<double>(syncs_));
    ctx.metric("ddp_allreduces", static_cast<double>(allreduces_));
  }

  void on_step_end(tk::StepEndContext& ctx) override {
    if (params_.empty() || check_every_ == 0) return decline(tk::Event::StepEnd);
    if (ctx.counters().step % check_every_ == 0) check_same(ctx);
  }
  void on_fit_end(tk::FitEndContext&) override { leave(); }
  ~Ddp() override { leave(); }

  tk::StateDict state() const override {
    return {{"syncs", torch::tensor(syncs_)}, {"allreduces", torch::tensor(allreduces_)}};
  }
  void load_state(const tk::StateDict& s) override {
    syncs_ = s.at("syncs").item<int64_t>();
    allreduces_ = s.at("allreduces").item<int64_t>();
  }

 private:
  /// Refuses ranks whose models differ from rank 0's (the count of parameters and buffers, each
  /// one's name, dtype, shape and trainability): the rank that differs names the first difference;
  /// the others say which rank it is.
  void check_same_model(tk::Model& model) {
    std::vector<std::string> names;
    std::vector<int64_t> rows;
    for (const auto& p : model.named_parameters()) names.push_back("parameter '" + p.key() + "'"), describe(p.key(), p.value(), rows);
    for (const auto& b : model.named_buffers()) names.push_back("buffer '" + b.key() + "'"), describe(b.key(), b.value(), rows);
    const int64_t n_params = static_cast<int64_t>(model.parameters().size());
    auto counts = torch::tensor({n_params, static_cast<int64_t>(names.size()) - n_params}, torch::kLong);
    const auto mine = counts.clone();
    world_->broadcast(counts);
    // Where any rank's counts differ, no rank compares descriptors (they would not line up).
    auto counts_differ = torch::tensor({counts.equal(mine) ? int64_t{0} : int64_t{1}}, torch::kLong);
    world_->all_reduce(counts_differ, tk::ReduceOp::Max);
    std::string why;
    if (!counts.equal(mine)) {
      why = std::to_string(mine[0].item<int64_t>()) + " parameters and " + std::to_string(mine[1].item<int64_t>()) +
            " buffers here, " + std::to_string(counts[0].item<int64_t>()) + " and " +
            std::to_string(counts[1].item<int64_t>()) + " on rank 0";
    } else if (counts_differ.item<int64_t>() == 0) {
      auto theirs = torch::tensor(rows, torch::kLong);
      world_->broadcast(theirs);
      const int64_t* r0 = theirs.data_ptr<int64_t>();
      for (size_t i = 0; i < names.size() && why.empty(); ++i) {
        const int64_t* a = rows.data() + i * kWidth;
        const int64_t* b = r0 + i * kWidth;
        if (std::equal(a, a + kWidth, b)) continue;
        why = a[0] != b[0] ? names[i] + " (number " + std::to_string(i) + ") has another name on rank 0"
                           : names[i] + " is " + shape_of(a) + " here and " + shape_of(b) + " on rank 0";
      }
    }
    // Every rank learns the lowest rank that differs (-size: none), so that none goes on to wait
    // for it.
    const int64_t none = -static_cast<int64_t>(world_->size());
    auto first = torch::tensor({why.empty() ? none : -static_cast<int64_t>(world_->rank())}, torch::kLong);
    world_->all_reduce(first, tk::ReduceOp::Max);
    if (!why.empty())
      throw std::runtime_error("the model on rank " + std::to_string(world_->rank()) + " differs from rank 0's: " + why +
                               "; every rank must build the same model");
    if (first.item<int64_t>() != none)
      throw std::runtime_error("the model on rank " + std::to_string(-first.item<int64_t>()) +
                               " differs from rank 0's (that rank's error names the difference)");
  }

  /// Every rank starts from rank 0's parameters and buffers.
  void broadcast_from_rank0(tk::Model& model) {
    torch::NoGradGuard no_grad;
    std::vector<at::Tensor> state;
    for (const auto& p : model.parameters()) state.push_back(p);
    for (const auto& b : model.buffers()) state.push_back(b);
    c10d::broadcast_coalesced(world_->process_group(), state, static_cast<size_t>(std::min<int64_t>(bucket_bytes_, 256 << 20)), 0);
  }

  void build_reducer(tk::Context& ctx) {
    std::unordered_map<size_t, std::string> names;
    for (size_t i = 0; i < param_names_.size(); ++i) names[i] = param_names_[i];
    // Buckets in the reverse order of definition, which approximates the order gradients become
    // ready in backward: the first (small) bucket is launched earliest.
    std::vector<at::Tensor> reversed(params_.rbegin(), params_.rend());
    std::vector<int64_t> order(params_.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(order.size() - 1 - i);
    const std::vector<bool> sparse(params_.size(), false);
    auto assigned = c10d::compute_bucket_assignment_by_size(
        reversed, {static_cast<size_t>(first_bucket_bytes_), static_cast<size_t>(bucket_bytes_)}, sparse, order);
    auto& buckets = std::get<0>(assigned);
    buckets_ = static_cast<int64_t>(buckets.size());
    const auto group = world_->process_group();
    reducer_ = tk::compat::make_reducer<WindowReducer>(params_, buckets, std::get<1>(assigned), group, sparse, bucket_bytes_,
                                                       find_unused_, /*bucket_view=*/true, names, first_bucket_bytes_);
    reducer_->register_comm_hook(std::make_unique<SumHook>(group, launches_));
    // Which parameters got a gradient in the last backward: counted in the step's record, and
    // named when the search is off and one did not.
    got_grad_ = std::make_shared<std::vector<char>>(params_.size(), 0);
    for (size_t i = 0; i < params_.size(); ++i)
      hooks_.push_back(params_[i].register_hook([flags = got_grad_, i](const at::Tensor&) { (*flags)[i] = 1; }));
    std::ostringstream m;
    m << params_.size() << " parameters in " << buckets_ << " bucket" << (buckets_ == 1 ? "" : "s") << " (first "
      << first_bucket_mb_ << " MiB, then " << bucket_mb_ << " MiB), unused-parameter search "
      << (find_unused_ ? "on" : "off");
    ctx.info(m.str());
  }

  /// After the run's first step: where the unused-parameter search found every parameter used on
  /// every rank, says once (rank 0) what it costs and how to turn it off.
  void search_note(tk::Context& ctx, int64_t unused_in_world) {
    if (noted_ || ctx.trial()) return;
    noted_ = true;
    if (!find_unused_ || unused_in_world > 0 || world_->rank() != 0) return;
    ctx.info("every rank used every parameter in step " + std::to_string(ctx.counters().step + 1) +
             ": the unused-parameter search (find_unused_parameters, on by default) walks the autograd graph in "
             "every backward and sums one more tensor a step; for a model that always uses all its parameters, "
             "set plugins.ddp.find_unused_parameters = false");
  }

  std::string unused_message(const tk::Context& ctx) const {
    std::string missing;
    int64_t count = 0;
    for (size_t i = 0; got_grad_ && i < params_.size(); ++i)
      if (!(*got_grad_)[i] && count++ < 5) missing += (missing.empty() ? "'" : ", '") + param_names_[i] + "'";
    if (!find_unused_ && count > 0)
      return "parameter" + std::string(count == 1 ? " " : "s ") + missing + (count > 5 ? " and others" : "") +
             " got no gradient in the last backward of step " + std::to_string(ctx.counters().step + 1) + " on rank " +
             std::to_string(world_->rank()) + ", and find_unused_parameters = false: set it to true (the default) for a "
             "model that does not use every parameter in every micro-batch";
    return "the reducer launched " + std::to_string(launches_->count) + " of its " + std::to_string(buckets_) +
           " buckets in the last backward of step " + std::to_string(ctx.counters().step + 1) + " on rank " +
           std::to_string(world_->rank());
  }

  void leave() {
    param_names_.clear();
    for (size_t i = 0; i < hooks_.size(); ++i) params_[i].remove_hook(hooks_[i]);
    hooks_.clear();
    reducer_.reset();
    params_.clear();
  }

  /// Fails the run when the ranks no longer hold the same parameters.
  void check_same(tk::Context& ctx) {
    torch::NoGradGuard no_grad;
    // Parameters sharded between uses (ZeRO stage 3) are gathered for the check, on every rank.
    tk::WholeParameters whole(&ctx.optimizer());
    double sum = 0.0;
    for (const auto& p : ctx.model().parameters()) sum += p.to(torch::kDouble).sum().item<double>();
    auto lo = torch::tensor({sum}, torch::kDouble), hi = lo.clone();
    world_->all_reduce(lo, tk::ReduceOp::Min);
    world_->all_reduce(hi, tk::ReduceOp::Max);
    if (lo.item<double>() != hi.item<double>()) {
      std::ostringstream m;
      m.precision(17);
      m << "ranks diverged after step " << ctx.counters().step << ": parameter checksums range from " << lo.item<double>()
        << " to " << hi.item<double>();
      throw std::runtime_error(m.str());
    }
  }

  // Options, with their defaults.
  double bucket_mb_ = 25.0, first_bucket_mb_ = 1.0;
  bool find_unused_ = true;
  bool noted_ = false;  // the search's cost was judged (after the first step)
  int64_t check_every_ = 0;
  std::string moved_backend_;
  double moved_timeout_s_ = 0, moved_rendezvous_timeout_s_ = 0;
  int64_t moved_zero_stage_ = 0;
  // Derived from them, and state.
  tk::World* world_ = nullptr;  // the run's, from on_fit_start on
  int64_t bucket_bytes_ = 25 << 20, first_bucket_bytes_ = 1 << 20;
  bool average_ = false;
  bool sharded_grads_ = false;  // another plugin sums the gradients onto their owners (tk::cap::kGradsSharded)
  int64_t syncs_ = 0, allreduces_ = 0;
  // The reducer, the parameters it sums (trainable ones, in model order) and their names.
  std::unique_ptr<WindowReducer> reducer_;
  std::vector<at::Tensor> params_;
  std::vector<std::string> param_names_;
  int64_t buckets_ = 0;
  std::shared_ptr<Launches> launches_ = std::make_shared<Launches>();
  std::shared_ptr<std::vector<char>> got_grad_;
  std::vector<unsigned> hooks_;
  // The last window's figures, for its step's record.
  Clock::time_point backward_start_;
  double prepare_ms_ = 0, backward_ms_ = 0, overlap_ms_ = 0, wait_ms_ = 0;
  int64_t unused_ = 0;  // trainable parameters without a gradient in the last backward, here
};


}  // namespace

TK_PLUGIN(Ddp, "ddp", "0.4.0", "data parallel on c10d's Reducer: gradients summed across ranks during each window's last backward")
