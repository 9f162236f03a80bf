// Window planning and plugin ordering: pure logic, no training.
#include <algorithm>
#include <tuple>

#include "support.h"

#include "api/api.h"
#include "planning/planning.h"
#include "support/support.h"

using tk::LastWindow;
using tk::WindowSchedule;

namespace {

/// (index, size) of every micro-batch of `epochs` epochs; (-1, -1) where it is dropped.
std::vector<std::pair<int64_t, int64_t>> layout(const WindowSchedule& s, int64_t m, int64_t epochs) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t e = 0; e < epochs; ++e)
    for (int64_t b = 0; b < m; ++b) {
      auto w = s.at(e, b);
      out.emplace_back(w ? w->index : -1, w ? w->size : -1);
    }
  return out;
}

tk::PluginDecl decl(std::string name, std::vector<tk::Capability> provides, std::vector<tk::Capability> after = {}) {
  tk::PluginDecl d;
  d.name = std::move(name);
  d.contract.provides = std::move(provides);
  d.contract.after = std::move(after);
  return d;
}

constexpr double kMB = 1024.0 * 1024.0;  // as the figures are written

/// 1Mi float32 parameters with AdamW: 4 MiB of them, 4 of gradients, 8 of moments; blocks of 0.5
/// MiB, 0.5 MiB in none; 100 tensors, the largest of 0.125 MiB.
tk::detail::TrainingState adamw_state() {
  tk::detail::TrainingState s;
  s.trainable = 4 * kMB;
  s.optimizer_whole = 8 * kMB;
  s.largest_block = 0.5 * kMB;
  s.loose = 0.5 * kMB;
  s.largest_tensor = 0.125 * kMB;
  s.tensors = 100;
  return s;
}

/// adamw_state() in two tensors, the largest of `largest` bytes, at `stage`.
tk::detail::TrainingState two_tensors(double largest, int stage) {
  tk::detail::TrainingState s = adamw_state();
  s.tensors = 2;
  s.largest_tensor = largest;
  s.stage = stage;
  return s;
}

}  // namespace

TEST_SUITE("plan") {
  TEST_CASE("step policy: the short last window of each epoch has its actual size") {
    WindowSchedule s(10, 4, LastWindow::Step, 2);
    auto l = layout(s, 10, 1);
    std::vector<std::pair<int64_t, int64_t>> expect = {{0, 4}, {1, 4}, {2, 4}, {3, 4}, {0, 4},
                                                       {1, 4}, {2, 4}, {3, 4}, {0, 2}, {1, 2}};
    CHECK(l == expect);
    CHECK(s.steps_in(2) == 6);
    auto w = s.at(1, 9);
    CHECK(w->is_last());
    CHECK(w->is_short());
  }

  TEST_CASE("drop policy: the tail of each epoch is skipped") {
    WindowSchedule s(10, 4, LastWindow::Drop, 2);
    auto l = layout(s, 10, 1);
    CHECK(l[7] == std::make_pair<int64_t, int64_t>(3, 4));
    CHECK(l[8] == std::make_pair<int64_t, int64_t>(-1, -1));
    CHECK(l[9] == std::make_pair<int64_t, int64_t>(-1, -1));
    CHECK(s.steps_in(2) == 4);
    CHECK_THROWS_WITH_AS(WindowSchedule(3, 4, LastWindow::Drop, 1), doctest::Contains("no window would ever complete"),
                         tk::Error);
  }

  TEST_CASE("carry policy: windows run across epochs; only the run's last one may be short") {
    WindowSchedule s(10, 4, LastWindow::Carry, 3);  // 30 micro-batches: 7 windows of 4 and one of 2
    auto l = layout(s, 10, 3);
    CHECK(l[8] == std::make_pair<int64_t, int64_t>(0, 4));   // epoch 0, b 8 opens a window ...
    CHECK(l[11] == std::make_pair<int64_t, int64_t>(3, 4));  // ... closed in epoch 1
    CHECK(l[28] == std::make_pair<int64_t, int64_t>(0, 2));
    CHECK(l[29] == std::make_pair<int64_t, int64_t>(1, 2));
    CHECK(s.steps_in(3) == 8);
    WindowSchedule unbounded(10, 4, LastWindow::Carry, 0);  // bounded by steps: never short
    CHECK(unbounded.at(2, 9)->size == 4);
  }

  TEST_CASE("without accumulation every micro-batch is its own window") {
    WindowSchedule s(5, 1, LastWindow::Step, 1);
    for (int64_t b = 0; b < 5; ++b) {
      CHECK(s.at(0, b)->size == 1);
      CHECK(s.at(0, b)->is_last());
    }
    CHECK(s.steps_in(3) == 15);
  }

  TEST_CASE("boundary order follows contracts, whatever the listing order") {
    std::vector<tk::PluginDecl> ds = {
        decl("clip", {tk::cap::kGradsClipped}, {tk::cap::kGradsSynced, tk::cap::kGradsNormalized, tk::cap::kGradsUnscaled}),
        decl("accum", {tk::cap::kWindow, tk::cap::kGradsNormalized}, {tk::cap::kGradsSynced}),
        decl("amp", {tk::cap::kGradsUnscaled}, {tk::cap::kGradsSynced, tk::cap::kGradsNormalized}),
        decl("ddp", {tk::cap::kGradsSynced}),
    };
    std::vector<size_t> perm = {0, 1, 2, 3};
    int permutations = 0;
    do {
      std::vector<tk::PluginDecl> listed;
      for (size_t i : perm) listed.push_back(ds[i]);
      std::vector<std::string> names;
      for (size_t i : tk::order_plugins(listed)) names.push_back(listed[i].name);
      CHECK(names == std::vector<std::string>{"ddp", "accum", "amp", "clip"});
      ++permutations;
    } while (std::next_permutation(perm.begin(), perm.end()));
    CHECK(permutations == 24);
  }

  TEST_CASE("unrelated plugins keep their recipe order") {
    auto order = tk::order_plugins({decl("b", {}), decl("a", {}), decl("c", {tk::Capability{"x"}}, {})});
    CHECK(order == std::vector<size_t>{0, 1, 2});
  }

  TEST_CASE("impossible combinations are refused, naming both plugins") {
    CHECK_THROWS_WITH(tk::order_plugins({decl("clip", {tk::cap::kGradsClipped}), decl("clip_value", {tk::cap::kGradsClipped})}),
                      "plugins 'clip' and 'clip_value' both provide 'grads.clipped'; a run can have only one of them");
    CHECK_THROWS_WITH(tk::order_plugins({decl("a", {tk::Capability{"x"}}, {tk::Capability{"y"}}),
                                        decl("b", {tk::Capability{"y"}}, {tk::Capability{"x"}})}),
                      doctest::Contains("each need to run after the other"));
    tk::PluginDecl needs = decl("ddp_hook", {});
    needs.contract.requires_ = {tk::cap::kGradsSynced};
    CHECK_THROWS_WITH(tk::order_plugins({needs}), doctest::Contains("'ddp_hook' requires 'grads.synced'"));
    tk::PluginDecl conflict = decl("fp8", {});
    conflict.contract.conflicts = {tk::cap::kAutocast};
    CHECK_THROWS_WITH(tk::order_plugins({decl("amp", {tk::cap::kAutocast}), conflict}),
                      "plugins 'fp8' and 'amp' cannot be combined: 'fp8' conflicts with 'autocast'");
  }

  TEST_CASE("only one plugin may shape the window, and only in its configure hook") {
    struct Shapes : tk::Plugin {
      explicit Shapes(int64_t k) : k_(k) {}
      void configure(tk::RunPlan& plan) override {
        tk::WindowRequest w;
        w.steps = k_;
        plan.set_window(w);
      }
      int64_t k_;
    };
    auto a = tk::testing::prepare(std::make_shared<Shapes>(4), "grad_accum");
    auto b = tk::testing::prepare(std::make_shared<Shapes>(2), "other");
    tk::testing::PlanSettings settings;
    settings.micro_batch = 8;
    tk::testing::ManualPlan plan(settings);
    plan.configure(*a);
    CHECK(plan.plan().accumulation() == 4);
    CHECK(plan.plan().window_owner() == "grad_accum");
    CHECK(plan.plan().effective_batch() == 32);
    CHECK_THROWS_WITH(plan.configure(*b),
                      "plugins 'grad_accum' and 'other' both set the accumulation window; keep one of them");
    // Outside configure (a hook that kept the plan, say), the plan cannot be changed.
    CHECK_THROWS_WITH(const_cast<tk::RunPlan&>(plan.plan()).set_window(tk::WindowRequest{}),
                      "a plugin called plan.set_window() in no hook (outside any call of the core); it belongs to "
                      "configure");
  }

  TEST_CASE("the data order is a pure function of seed and epoch") {
    auto a = tk::epoch_order(100, 5, 2, true), b = tk::epoch_order(100, 5, 2, true);
    CHECK(torch::equal(a, b));
    CHECK_FALSE(torch::equal(a, tk::epoch_order(100, 5, 3, true)));
    CHECK_FALSE(torch::equal(a, tk::epoch_order(100, 6, 2, true)));
    CHECK(torch::equal(std::get<0>(a.sort()), torch::arange(100)));
    CHECK(torch::equal(tk::epoch_order(10, 5, 0, false), torch::arange(10)));
  }

  TEST_CASE("ZeRO's arithmetic: each stage's bytes per rank, and the stage a refused step is told would fit") {
    tk::detail::TrainingState s = adamw_state();
    // The state's share as ZeRO counts it (16, 8 + 8/N, 4 + 12/N and 16/N bytes a parameter) plus
    // the buffers of its sharding: the owners' broadcast (1, 2); a block's gradients and their
    // copy (2, 3); three blocks and the loose parameters gathered, the loose gradients and their
    // copy, and the owner's copy of a block (3).
    const std::vector<double> two = s.per_rank(2), four = s.per_rank(4);
    REQUIRE(two.size() == 4);
    CHECK(two[0] == doctest::Approx(16 * kMB));
    CHECK(two[1] == doctest::Approx((4 + 4 + 4 + 2) * kMB));
    CHECK(two[2] == doctest::Approx((4 + 6 + 2 + 1) * kMB));
    CHECK(two[3] == doctest::Approx((8 + 2 + 0.5 + 0.5 + 1 + 0.5) * kMB));
    CHECK(four[3] == doctest::Approx((4 + 4.5) * kMB));
    // A machine's ranks hold their unsharded parts and buffers each, their shares once between them.
    for (size_t stage = 0; stage < 4; ++stage) CHECK(s.on_machine(2, 1)[stage] == doctest::Approx(two[stage]));
    CHECK(s.on_machine(4, 4)[0] == doctest::Approx(64 * kMB));
    CHECK(s.on_machine(4, 2)[1] == doctest::Approx((2 * 8 + 12 * 0.5) * kMB));
    CHECK(s.on_machine(4, 2)[3] == doctest::Approx(2 * 4 * kMB + 16 * 0.5 * kMB + 0.5 * kMB));
    s.frozen = 1 * kMB;  // frozen parameters are whole at every stage
    for (size_t stage = 0; stage < 4; ++stage) CHECK(s.per_rank(2)[stage] == doctest::Approx(two[stage] + kMB));
    s.frozen = 0;
    // A share is never less than the largest tensor's part: over 64 ranks as over 32.
    CHECK(s.per_rank(64)[3] == doctest::Approx(s.per_rank(32)[3]));
    CHECK(s.per_rank(32)[3] < s.per_rank(16)[3]);
    // Without blocks: everything gathered for a micro-batch, the gradients whole until backward ends.
    tk::detail::TrainingState flat = s;
    flat.largest_block = 0;
    flat.loose = 4 * kMB;
    CHECK(flat.per_rank(2)[3] == doctest::Approx((8 + 4 + 4 + 4) * kMB));
    CHECK(flat.per_rank(2)[2] == doctest::Approx((4 + 6 + 2 + 8) * kMB));

    // A step of ddp (stage 0) on 2 ranks that measured 17 MiB: 1 MiB beside its state.
    std::string advice = tk::detail::sharding_advice(s, 17 * kMB, 13.5 * kMB, 2);
    CHECK(advice.find("the training state is 16 MiB unsharded (parameters 4 MiB, gradients 4 MiB, optimizer state 8 MiB)") != std::string::npos);
    CHECK(advice.find("at ZeRO stage 0. Over its 2 ranks") != std::string::npos);
    CHECK(advice.find("17 MiB at stage 0, 15 MiB at stage 1, 14 MiB at stage 2 and 13.5 MiB at stage 3: by these figures "
                      "stage 3 would fit") != std::string::npos);
    CHECK(tk::detail::sharding_advice(s, 17 * kMB, 14 * kMB, 2).find(": by these figures stage 2 would fit") != std::string::npos);
    // None fits on 2 ranks: over k, stage 3 takes 5.5 + 16/k MiB -> 4 ranks for 9.5 MiB.
    CHECK(tk::detail::sharding_advice(s, 17 * kMB, 9.5 * kMB, 2).find("none fits; by these figures stage 3 would over 4 ranks "
                                                                     "(about 9.5 MiB each)") != std::string::npos);
    // No rank holds less than its largest tensor's part (1/32 of 16 MiB), nor is there a rank per tensor beyond 100.
    CHECK(tk::detail::sharding_advice(s, 17 * kMB, 5.9 * kMB, 2).find("by these figures none fits, over any number of ranks: the rest "
                                                                    "of the step (activations, the parameters gathered) and "
                                                                    "the least share of the state a rank can hold take 6 MiB "
                                                                    "on each (estimates: a stage the recipe sets is measured)") !=
          std::string::npos);
    tk::detail::TrainingState few = s;
    few.tensors = 3;
    few.largest_tensor = 0.01 * kMB;
    CHECK(tk::detail::sharding_advice(few, 17 * kMB, 9.5 * kMB, 2).find("none fits, over any number of ranks") != std::string::npos);
    // On one rank the figures are for 2.
    CHECK(tk::detail::sharding_advice(s, 17 * kMB, 13.5 * kMB, 1).find("On one rank nothing is sharded; over 2 ranks") != std::string::npos);
    // A world of one at stage 1 holds what stage 0 does (no broadcast buffer): the same figures.
    s.stage = 1;
    CHECK(tk::detail::sharding_advice(s, 17 * kMB, 13.5 * kMB, 1).find("17 MiB at stage 0, 15 MiB at stage 1, 14 MiB at stage 2 "
                                                                     "and 13.5 MiB at stage 3: by these figures stage 3 would "
                                                                     "fit") != std::string::npos);
    // and the stage it sets already shards over 2 ranks.
    CHECK(tk::detail::sharding_advice(s, 17 * kMB, 15 * kMB, 1).find("by these figures stage 1 would fit (over 2 ranks, tk-run "
                                                                   "--nproc 2 with ddp; the stage set by a plugin") !=
          std::string::npos);
    // A step at stage 2 that measured 14 MiB: only it and the stages above it are named.
    s.stage = 2;
    advice = tk::detail::sharding_advice(s, 14 * kMB, 14 * kMB, 2);
    CHECK(advice.find("would take about 14 MiB at stage 2 and 13.5 MiB at stage 3: by these figures stage 3 would fit") !=
          std::string::npos);
    CHECK(advice.find("at stage 0") == std::string::npos);
    // A stage-2 step that measured less than its state and buffers are reckoned (a small model's
    // buffers overcounted): its own figure is what it measured, stage 3's less by what their
    // reckoned states and buffers differ.
    advice = tk::detail::sharding_advice(s, 12 * kMB, 10 * kMB, 2);
    CHECK(advice.find("about 12 MiB at stage 2 and 11.5 MiB at stage 3") != std::string::npos);
    // A step at stage 3 that measured 13.5 MiB on 2 ranks: the same 1 MiB beside its state.
    s.stage = 3;
    advice = tk::detail::sharding_advice(s, 13.5 * kMB, 10 * kMB, 2);
    CHECK(advice.find("would take about 13.5 MiB at stage 3: none fits; by these figures stage 3 would over 4 ranks "
                      "(about 9.5 MiB each)") != std::string::npos);
    CHECK(advice.find("at stage 1") == std::string::npos);
    // Only a number of ranks the effective batch divides over: 6 of 6 (4 and 5 do not divide it),
    // 5 of 10, none of 3.
    CHECK(tk::detail::sharding_advice(s, 13.5 * kMB, 10 * kMB, 2, 6).find("stage 3 would over 6 ranks (about ") != std::string::npos);
    CHECK(tk::detail::sharding_advice(s, 13.5 * kMB, 10 * kMB, 2, 10).find("stage 3 would over 5 ranks (about ") != std::string::npos);
    CHECK(tk::detail::sharding_advice(s, 13.5 * kMB, 10 * kMB, 2, 8).find("stage 3 would over 4 ranks (about 9.5 MiB each)") != std::string::npos);
    CHECK(tk::detail::sharding_advice(s, 13.5 * kMB, 10 * kMB, 2, 3).find(
              ": none fits; by these figures stage 3 would fit over no number of ranks above 2 and up to one per "
              "trainable tensor (" + std::to_string(s.tensors) + ") that the effective batch of 3 divides over") !=
          std::string::npos);
    // At most one rank per tensor: 6 tensors, 5 ranks needed, 5 and 6 do not divide 14.
    tk::detail::TrainingState six = s;
    six.tensors = 6;
    CHECK(tk::detail::sharding_advice(six, 13.5 * kMB, 9 * kMB, 2, 14).find("stage 3 would fit over no number of ranks above 2 "
                                                                          "and up to one per trainable tensor (6) that the "
                                                                          "effective batch of 14 divides over") !=
          std::string::npos);
    // On one rank, over 2 ranks only where the effective batch divides over them.
    s.stage = 0;
    CHECK(tk::detail::sharding_advice(s, 17 * kMB, 15 * kMB, 1, 4).find("stage 1 would fit (over 2 ranks") != std::string::npos);
    CHECK(tk::detail::sharding_advice(s, 17 * kMB, 15 * kMB, 1, 9).find("would fit (over 2 ranks") == std::string::npos);
    s.stage = 3;
    // An optimizer that does not report its state's size.
    s.optimizer_known = false;
    CHECK(tk::detail::sharding_advice(s, 13.5 * kMB, 10 * kMB, 2).find("the optimizer's state not reported by it, counted as none") !=
          std::string::npos);
  }

  TEST_CASE("a training state that cannot fit the machine is refused before a step, by the stage and the ranks on it") {
    tk::detail::TrainingState s = adamw_state();  // 16 MiB unsharded
    // One process: the whole state, 16 MiB. Every stage fits over 2 machines (16, 14, 13 and 12.5 MiB a rank).
    CHECK(tk::detail::state_overflow(s, 1, 1, 16 * kMB).empty());
    std::string why = tk::detail::state_overflow(s, 1, 1, 15 * kMB);
    INFO(why);
    CHECK(why == "its training state does not fit this machine's memory: about 16 MiB a rank at ZeRO stage 0 over 1 rank, "
                 "and it has 15 MiB (unsharded: parameters 4 MiB, gradients 4 MiB, optimizer state 8 MiB); with 1 rank on "
                 "each machine, by these figures stage 1 on 2 machines, stage 2 on 2 machines, stage 3 on 2 machines would "
                 "fit (tk-run --nnodes; the stage set by a plugin that provides optimizer.sharded, and from stage 3 "
                 "params.sharded; tk-run --list shows the plugins)");
    // Stage 3 over 2 ranks: 12.5 MiB each. Where each rank has a machine of its own, a machine of 13
    // MiB trains what one process could not; two ranks on one machine need 24.5 MiB of it, and more
    // ranks there would need more: more machines, of two ranks each (stage 1 over 6 ranks takes 10
    // MiB a rank, stages 2 and 3 over 4 take 9 and 8.5).
    s.stage = 3;
    CHECK(tk::detail::state_overflow(s, 2, 1, 13 * kMB).empty());
    why = tk::detail::state_overflow(s, 2, 2, 20 * kMB);
    CHECK(why.find("about 12.5 MiB a rank at ZeRO stage 3 over 2 ranks, 24.5 MiB for the 2 ranks on this machine, and it "
                   "has 20 MiB") != std::string::npos);
    CHECK(why.find("with 2 ranks on each machine, by these figures stage 1 on 3 machines, stage 2 on 2 machines, stage 3 "
                   "on 2 machines would fit") != std::string::npos);
    // The ranks on a machine are never more than the world's.
    CHECK(tk::detail::state_overflow(s, 2, 8, 20 * kMB) == why);
    // A stage in a world of one shards nothing: the whole state.
    CHECK(tk::detail::state_overflow(s, 1, 1, 13 * kMB).find("about 16 MiB a rank at ZeRO stage 0 over 1 rank") != std::string::npos);
    // Fewer tensors (4, the largest a quarter of the state) than the 8 ranks on this machine: no rank's
    // share is less than a quarter, and each stage is still weighed on this one machine (stage 1: 11
    // MiB a rank).
    tk::detail::TrainingState few = adamw_state();
    few.tensors = 4;
    few.largest_tensor = 1 * kMB;
    CHECK(tk::detail::state_overflow(few, 8, 8, 100 * kMB).find("with 8 ranks on each machine, by these figures stage 1 "
                                                                "on 1 machine, stage 2 on 1 machine, stage 3 on 1 machine "
                                                                "would fit") != std::string::npos);
    // Nothing fits where a rank's least share (a 32nd: its largest tensor) and its buffers do not.
    CHECK(tk::detail::state_overflow(s, 1, 1, 1 * kMB).find("with 1 rank on each machine, no stage fits on any number of "
                                                            "machines") != std::string::npos);
  }

  TEST_CASE("stage 3 is never reckoned below the whole weights, which every rank holds as the model is built and the fit ends") {
    // Blocks of 64 KiB (and as many in none): over 8 ranks stage 3's share and buffers are 2.56 MiB a
    // rank, less than the 4 MiB of weights each rank builds whole, and gathers whole as the fit ends
    // beside its eighth of the moments (1 MiB; its gradients released first): 5 MiB.
    tk::detail::TrainingState s = adamw_state();
    s.largest_block = s.loose = s.largest_tensor = 0.0625 * kMB;
    s.tensors = 64;
    s.stage = 3;
    CHECK(s.per_rank(8)[3] < 4 * kMB);
    CHECK(tk::detail::state_overflow(s, 8, 1, 5 * kMB).empty());
    std::string why = tk::detail::state_overflow(s, 8, 1, 4.9 * kMB);
    INFO(why);
    CHECK(why.find("about 5 MiB a rank at ZeRO stage 3 over 8 ranks, and it has 4.9 MiB") != std::string::npos);
    // More machines shrink the shares, not the weights: 4 + 8/9 MiB over 9; stage 2 over 21 holds 4
    // MiB of parameters, 16/21 of its shares and two 64 KiB buckets.
    CHECK(why.find("; at stage 3 each rank still holds the whole weights as the model is built, and as the fit ends beside "
                   "its share of the optimizer's state; with 1 rank on each machine, by these figures "
                   "stage 2 on 21 machines, stage 3 on 9 machines would fit") != std::string::npos);
    // Below the weights themselves (and stage 2's parameters and buckets), nothing fits however many machines.
    CHECK(tk::detail::state_overflow(s, 8, 1, 3.5 * kMB).find("no stage fits on any number of machines") != std::string::npos);
    // Two ranks on a machine of 7.5 MiB: 8 MiB of weights, however many machines; one rank on each
    // fits at stage 2 and 3 over as many ranks as now (stage 2: 4 MiB, 16/8 and two 64 KiB buckets).
    CHECK(tk::detail::state_overflow(s, 8, 2, 7.5 * kMB).find(
              "; with 2 ranks on each machine, no stage fits on any number of machines; with 1 rank on each machine, by "
              "these figures stage 2 on 8 machines, stage 3 on 8 machines would fit (tk-run --nnodes, --nproc 1; the stage "
              "set by a plugin that provides optimizer.sharded") != std::string::npos);
    // Where the whole state fits one process, fewer ranks on each machine fit without sharding: 16 MiB
    // (12.5 MiB at stage 3 over 2 ranks, where the largest tensor is half the state: 24.5 for both here).
    const tk::detail::TrainingState whole = two_tensors(2 * kMB, 3);
    const std::string alone = tk::detail::state_overflow(whole, 2, 2, 16 * kMB, " (TK_MACHINE_MEMORY)");
    INFO(alone);
    CHECK(alone.find("and it has 16 MiB (TK_MACHINE_MEMORY) (unsharded:") != std::string::npos);
    CHECK(alone.find("; with 2 ranks on each machine, no stage fits on any number of machines; with 1 rank on each machine, "
                     "by these figures stage 0 on 2 machines, stage 1 on 2 machines, stage 2 on 2 machines, stage 3 on 2 "
                     "machines would fit (tk-run --nnodes, --nproc 1; the stage") != std::string::npos);
    // Where one tensor (in a block of its own) is most of the state, a rank's share is three
    // quarters: 16 MiB a rank at stage 0, and 17, 22 and 26 MiB at stages 1 to 3 (its block's
    // gradients and their copies). A stage that shards can then need more than stage 0 on the
    // machines there are.
    tk::detail::TrainingState lopsided = two_tensors(3 * kMB, 3);
    lopsided.largest_block = 3 * kMB;  // the block that holds it
    CHECK(tk::detail::state_overflow(lopsided, 2, 1, 16 * kMB).find(
              "about 26 MiB a rank at ZeRO stage 3 over 2 ranks, and it has 16 MiB (unsharded: parameters 4 MiB, gradients "
              "4 MiB, optimizer state 8 MiB); with 1 rank on each machine, by these figures stage 0 on 2 machines would fit "
              "(tk-run --nnodes; stage 0: without the plugin that provides optimizer.sharded)") != std::string::npos);
    // Two ranks on one machine hold one whole state between them (16 MiB), however uneven their
    // shares: at stage 3 each also its gathered blocks (all 4 MiB), the loose gradients and their
    // copy (1), a block's gradients and their copy (6), and the machine one copy of a block in
    // flight (3): 41 MiB, not twice the 26 of the rank that holds the large tensor.
    CHECK(lopsided.on_machine(2, 2)[3] == doctest::Approx(41 * kMB));
    CHECK(tk::detail::state_overflow(lopsided, 2, 2, 41 * kMB).empty());
    CHECK(tk::detail::state_overflow(lopsided, 2, 2, 40 * kMB).find(
              "about 26 MiB a rank at ZeRO stage 3 over 2 ranks, 41 MiB for the 2 ranks on this machine") != std::string::npos);
    // At stage 1 they hold their parameters and gradients each (16 MiB) and the optimizer's state
    // and its broadcast buffer once (12 MiB): 28 MiB, less than stage 0's 32.
    lopsided.stage = 1;
    CHECK(tk::detail::state_overflow(lopsided, 2, 2, 28 * kMB).empty());
    CHECK(tk::detail::state_overflow(lopsided, 2, 2, 27 * kMB).find("28 MiB for the 2 ranks on this machine") != std::string::npos);
    // Nothing at all.
    const std::string none = tk::detail::state_overflow(lopsided, 2, 2, 1 * kMB);
    CHECK(none.substr(none.size() - 101) == "; with 2 ranks on each machine, no stage fits on any number of machines, nor with "
                                             "fewer ranks on each");
    // One process at stage 3 shards nothing, and says so.
    CHECK(tk::detail::state_overflow(whole, 1, 1, 15 * kMB).find("over 1 rank (one rank shards nothing, whatever its stage)") !=
          std::string::npos);
  }

  TEST_CASE("Slurm's lists are read as Slurm writes them, and a list that cannot be read is not trusted") {
    using tk::detail::slurm_tasks_on_node;
    // SLURM_STEP_TASKS_PER_NODE: "2(x3),1" is 2 tasks on each of nodes 0-2 and 1 on node 3.
    const std::vector<std::tuple<std::string, long, long>> cases = {
        {"4", 0, 4},        {"2(x3),1", 0, 2},  {"2(x3),1", 2, 2}, {"2(x3),1", 3, 1},
        {"8,4(x2),3", 2, 4}, {"8,4(x2),3", 3, 3}, {"8,4(x2),3", 4, 1}, {"2(x3),1", 9, 1},
        // Unreadable: 1, never a count the list does not give.
        {"", 0, 1},         {"x", 0, 1},        {"-4", 0, 1},      {"0", 0, 1},
        {"2(x", 0, 1},      {"2(x0),3", 0, 1},  {"2(x3", 0, 1},    {"2(x-1),5", 0, 1},
        {"99999999999999999999", 0, 1}, {"2x", 0, 1}, {"2(x3)x,1", 0, 1},
        // A repeat count too large for a long, and one at a long's edge: no sum overflows.
        {"2(x99999999999999999999),5", 0, 1}, {"2(x9223372036854775807),5", 1L << 62, 2}};
    for (const auto& [list, node, tasks] : cases) {
      CAPTURE(list);
      CAPTURE(node);
      CHECK(slurm_tasks_on_node(list, node) == tasks);
    }
    using tk::detail::first_host;
    CHECK(first_host("node[01-04,07],gpu2") == "node01");
    CHECK(first_host("gpu2,node[01-04]") == "gpu2");
    CHECK(first_host("rack[3-4]-n[009-012]") == "rack3-n009");
    CHECK(first_host("solo") == "solo");
    CHECK_THROWS_WITH(first_host("node[01-04"), "cannot read the Slurm node list 'node[01-04': a '[' is not closed");
    CHECK_THROWS_WITH(first_host("node[a-b]"), "cannot read the Slurm node list 'node[a-b]': '[a-b]' is not a range of numbers");
  }
}
