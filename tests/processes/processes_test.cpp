// tk-run as a process: data parallel with --nproc on loopback (Gloo, CPU), kills and resumes.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <regex>

#include "process_support.h"

namespace fs = std::filesystem;

using tkt::tk_run;
using tkt::weights;
using tkt::kBase;
using tkt::Proc;
using tkt::kLongTimeout;
using tkt::reports_timeout;

/// kBase trains in float64.
const tkt::Tol kF64 = tkt::tol_for(torch::kDouble);


/// `recipe` with `sets` run whole into ROOT/one, and into ROOT/two killed right after the record
/// of step 9 (give a checkpoint at 8) and then resumed: the two end bit-identical, with the same
/// losses. Returns the killed run.
Proc kill_and_resume(const fs::path& root, const std::string& recipe, const std::string& sets) {
  auto one = tk_run(root / "one", recipe, sets);
  INFO(one.out);
  REQUIRE(one.rc == 0);
  auto killed = tk_run(root / "two", recipe, sets, "TK_FAULT=metrics-written:9");
  auto resumed = tk_run(root / "two", recipe, sets + "--resume latest");
  INFO(resumed.out);
  REQUIRE(resumed.rc == 0);
  CHECK(resumed.out.find("resuming from") != std::string::npos);
  // Its summary counts what it trained, and says where in the run.
  CHECK(std::regex_search(resumed.out, std::regex("trained [0-9]+ optimizer steps \\([0-9]+ micro-batches\\) in [^,]+, "
                                                  "steps [1-9][0-9]* to [0-9]+ of the run")));
  CHECK(torch::equal(weights(root / "two"), weights(root / "one")));
  CHECK(tkt::metric(root / "two/out/metrics.jsonl", "loss") == tkt::metric(root / "one/out/metrics.jsonl", "loss"));
  return killed;
}

// Hard-routed experts (tests/fixtures/components_lib.cpp): with micro-batches of 2, each rank's
// micro-batch uses at most 2 of the 4 experts, so ranks use different parameters in a window,
// and a parameter used in a window's first micro-batch is often unused in its last.
std::string experts_recipe(bool varied) {
  std::string r = kBase;
  r.replace(r.find("name = \"mlp\"\nhidden = [16]\nactivation = \"tanh\""), 46,
            std::string("name = \"toy_experts\"\nhidden = 8\nexperts = 4\nvaried = ") + (varied ? "true" : "false"));
  return r + "[[plugins]]\nname = \"toy_components\"\n";
}

const char* const kAdamW = "[optimizer]\nname = \"adamw\"\nlr = 0.02\nweight_decay = 0.1\n";

/// kBase with its [optimizer] replaced by `optimizer` (none: kBase's SGD with momentum).
std::string base_with(const char* optimizer) {
  std::string r = kBase;
  if (optimizer) r = r.substr(0, r.find("[optimizer]")) + optimizer;
  return r;
}

/// The GPT with dropout on documents of 1 to 40 letters, in float32, written into ROOT.
std::string gpt_recipe(const fs::path& root) {
  fs::create_directories(root);
  tkt::write_documents(root / "corpus.txt", 80);
  return "[run]\nseed = 3\nsteps = 6\ndtype = \"float32\"\n"
         "[model]\nname = \"gpt\"\nlayers = 3\nwidth = 32\nheads = 2\ndropout = 0.1\n"
         "[data]\nname = \"text\"\npath = \"" + (root / "corpus.txt").string() +
         "\"\nseq_len = 24\ndocument_separator = \"\\n%\\n\"\nvalidation_fraction = 0.0\n[batch]\nmicro_batch = 2\n"
         "[loss]\nname = \"cross_entropy\"\nreduction = \"sum\"\n"
         "[optimizer]\nname = \"adamw\"\nlr = 0.01\n"
         "[[plugins]]\nname = \"grad_accum\"\nsteps = 2\nnormalize = \"tokens\"\n";
}

/// Token shards of 2 x 700 tokens in ROOT/data and a one-layer GPT on them.
std::string shards_recipe(const fs::path& root) {
  fs::create_directories(root / "data");
  for (int s = 0; s < 2; ++s) {
    std::vector<int64_t> tokens;
    for (int64_t i = 0; i < 700; ++i) tokens.push_back((i * 13 + s * 7) % 97);
    tkt::write_shard(root / "data" / ("train_00" + std::to_string(s) + ".bin"), tokens);
  }
  return "[run]\nseed = 9\nsteps = 6\ndtype = \"float64\"\n[model]\nname = \"gpt\"\nlayers = 1\n"
         "heads = 2\nwidth = 16\n[data]\nname = \"tokens\"\ntrain = \"" +
         (root / "data/train_*.bin").string() +
         "\"\nseq_len = 8\n[batch]\nmicro_batch = 2\n[optimizer]\nname = \"adamw\"\nlr = 0.01\n";
}

/// kBase on synthetic token sequences of 1 to 10 tokens (112 of them, 2 epochs).
std::string tokens_recipe(const fs::path&) {
  std::string base = kBase;
  base.replace(base.find("classes = 4"), 11, "classes = 4\nseq_len = 10\nmin_len = 1");
  return base;
}
std::string base_recipe(const fs::path&) { return kBase; }
std::string experts_alike(const fs::path&) { return experts_recipe(false); }
std::string experts_varied(const fs::path&) { return experts_recipe(true); }

const char* const kAccumulate2 = "[[plugins]]\nname = \"grad_accum\"\nsteps = 2\n";

/// "N ranks equal one process": the case's recipe (made for its folder ROOT) trained with ddp
/// (`ddp_options` follow its entry) and `accumulation` on `ranks` ranks (ROOT/two, `rank_sets`) and
/// with `accumulation` alone in one process (ROOT/one, `one_sets`) ends with the same weights, in
/// float64; `then` checks what the case adds, given the run of several ranks.
struct RanksEqualOneProcess {
  const char* name;
  std::string (*recipe)(const fs::path& root);
  const char* accumulation;
  const char* ddp_options;
  int ranks;
  const char* rank_sets;
  const char* one_sets;
  void (*then)(const RanksEqualOneProcess& c, const fs::path& root, const Proc& ranks_run);
};

void ranks_equal_one_process(const RanksEqualOneProcess& c) {
  const fs::path root = tkt::temp_dir("ranks-equal");
  const std::string recipe = c.recipe(root);
  auto two = tk_run(root / "two", recipe + "[[plugins]]\nname = \"ddp\"\n" + c.ddp_options + c.accumulation,
                    "--nproc " + std::to_string(c.ranks) + " " + c.rank_sets);
  INFO(two.out);
  REQUIRE(two.rc == 0);
  auto one = tk_run(root / "one", recipe + c.accumulation, c.one_sets);
  INFO(one.out);
  REQUIRE(one.rc == 0);
  CHECK(tkt::excess(weights(root / "two"), weights(root / "one"), kF64) <= 1.0);
  if (c.then) c.then(c, root, two);
  fs::remove_all(root);
}

/// 2 ranks x m x k also equal 1 process x 2mk; the steps moved the weights; the logged loss is the
/// global window's; one sync per window; only rank 0 writes; LibTorch's unused-parameter note once.
void then_one_sync_per_window(const RanksEqualOneProcess&, const fs::path& root, const Proc& two) {
  auto big = tk_run(root / "big", kBase, "--set batch.micro_batch=16");
  REQUIRE(big.rc == 0);
  CHECK(tkt::excess(weights(root / "two"), weights(root / "big"), kF64) <= 1.0);
  // Not the equality of runs that did nothing: the last three steps moved the weights.
  auto half = tk_run(root / "half", kBase, "--set batch.micro_batch=16 --set run.steps=3");
  REQUIRE(half.rc == 0);
  CHECK(tkt::distance(weights(root / "two"), weights(root / "half")) > 1e-4);
  // The logged loss is the global window's.
  auto l2 = tkt::metric(root / "two/out/metrics.jsonl", "loss"), lb = tkt::metric(root / "big/out/metrics.jsonl", "loss");
  REQUIRE(l2.size() == 6);
  for (size_t i = 0; i < l2.size(); ++i) CHECK(l2[i] == doctest::Approx(lb[i]).epsilon(1e-12));
  // One sync per window (6), each one gradient bucket, the used-map of the unused-parameter search
  // and the window totals: not per micro-batch (12).
  CHECK(tkt::metric(root / "two/out/metrics.jsonl", "ddp_syncs") == std::vector<double>{1, 2, 3, 4, 5, 6});
  CHECK(tkt::metric(root / "two/out/metrics.jsonl", "ddp_allreduces") == std::vector<double>{3, 6, 9, 12, 15, 18});
  CHECK(tkt::metric(root / "two/out/metrics.jsonl", "micro_batches").back() == 4);  // 2 ranks x k = 2
  // Only rank 0 wrote; every line of the launcher's output carries its rank.
  CHECK(two.out.find("[rank 1] ") != std::string::npos);
  // LibTorch's note that the unused-parameter search found nothing (one per rank) is said once,
  // for the world, with what it costs and how to turn it off.
  CHECK(two.out.find("did not find any unused parameters") == std::string::npos);
  const std::string note = "every rank used every parameter in step 1: the unused-parameter search";
  CHECK(two.out.find(note) != std::string::npos);
  CHECK(two.out.find(note) == two.out.rfind(note));
  CHECK(two.out.find("set plugins.ddp.find_unused_parameters = false") != std::string::npos);
}

/// The experts also equal one process with the whole window in one micro-batch; in some window's
/// last backward rank 0 left parameters without a gradient; the steps moved the weights.
void then_unused_counted(const RanksEqualOneProcess& c, const fs::path& root, const Proc&) {
  const std::string base = c.recipe(root);
  auto big = tk_run(root / "big", base, "--set batch.micro_batch=" + std::to_string(4 * c.ranks));
  REQUIRE(big.rc == 0);
  CHECK(tkt::excess(weights(root / "two"), weights(root / "big"), kF64) <= 1.0);
  const auto unused = tkt::metric(root / "two/out/metrics.jsonl", "ddp_unused");
  REQUIRE(unused.size() == 6);
  CHECK(*std::max_element(unused.begin(), unused.end()) >= 2);
  auto half = tk_run(root / "half", base, "--set batch.micro_batch=8 --set run.steps=3");
  REQUIRE(half.rc == 0);
  CHECK(tkt::distance(weights(root / "two"), weights(root / "half")) > 1e-4);
}

/// Without the search: per window the one bucket and the totals, no used-map; and a model that
/// leaves parameters unused gets an error naming one, in bounded time, not a hang.
void then_unused_named(const RanksEqualOneProcess&, const fs::path& root, const Proc&) {
  CHECK(tkt::metric(root / "two/out/metrics.jsonl", "ddp_allreduces") == std::vector<double>{2, 4, 6, 8, 10, 12});
  auto bad = tk_run(root / "bad",
                    experts_recipe(false) + "[[plugins]]\nname = \"ddp\"\nfind_unused_parameters = false\n" +
                        kLongTimeout + kAccumulate2,
                    "--nproc 2 --set batch.micro_batch=2");
  CHECK(bad.rc == 1);
  CHECK(bad.out.find("got no gradient in the last backward of step 1 on rank") != std::string::npos);
  CHECK(bad.out.find("parameters 'expert") != std::string::npos);
  CHECK(bad.out.find("find_unused_parameters = false: set it to true") != std::string::npos);
  CHECK_FALSE(reports_timeout(bad.out));  // the error stopped the world, not a collective's timeout
}

/// 112 sequences: 56 per rank, micro-batches of 4 -> 14 per epoch -> windows of 4, 4, 4, 2.
void then_short_last_windows(const RanksEqualOneProcess&, const fs::path& root, const Proc&) {
  CHECK(tkt::metric(root / "one/out/metrics.jsonl", "micro_batches") == std::vector<double>{4, 4, 4, 2, 4, 4, 4, 2});
}

/// The ramp happened: k grew from the first step to the last, on both.
void then_k_ramped(const RanksEqualOneProcess&, const fs::path& root, const Proc&) {
  const auto k1 = tkt::metric(root / "one/out/metrics.jsonl", "micro_batches");
  const auto k2 = tkt::metric(root / "two/out/metrics.jsonl", "micro_batches");
  REQUIRE(k1.size() == 6);
  CHECK(k1.front() < k1.back());
  CHECK(k2.front() == 2 * k1.front());  // both ranks' micro-batches
  CHECK(k2.back() == 2 * k1.back());
}

#define TKT_TOKENS_SETS "--set data.name=synthetic-tokens --set data.samples=112 --set run.steps=0 --set run.epochs=2 " \
                        "--set loss.reduction=sum "
const RanksEqualOneProcess kRanksEqualOneProcess[] = {
    {"2 ranks x m x k == 1 process x 2m x k == 1 process x 2mk, with identical ranks and one sync per window",
     base_recipe, kAccumulate2, "check_every = 1\n[world]\ntimeout_s = 60.0\n", 2, "--set batch.micro_batch=4",
     "--set batch.micro_batch=8", then_one_sync_per_window},
    {"ranks that use different parameters take the DDP step: unused gradients count as zero (2 ranks, experts alike)",
     experts_alike, kAccumulate2, "check_every = 1\n", 2, "--set batch.micro_batch=2", "--set batch.micro_batch=4",
     then_unused_counted},
    {"ranks that use different parameters take the DDP step: unused gradients count as zero (2 ranks, experts of "
     "different shapes)",
     experts_varied, kAccumulate2, "check_every = 1\n", 2, "--set batch.micro_batch=2", "--set batch.micro_batch=4",
     then_unused_counted},
    {"ranks that use different parameters take the DDP step: unused gradients count as zero (3 ranks, experts of "
     "different shapes)",
     experts_varied, kAccumulate2, "check_every = 1\n", 3, "--set batch.micro_batch=2", "--set batch.micro_batch=6",
     then_unused_counted},
    {"find_unused_parameters = false: the same step without the search, and an unused parameter is named",
     base_recipe, kAccumulate2, "find_unused_parameters = false\n[world]\ntimeout_s = 20.0\n", 2,
     "--set batch.micro_batch=4", "--set batch.micro_batch=8", then_unused_named},
    {"tokens normalization is exact across ranks with uneven token counts and a short last window", tokens_recipe,
     "[[plugins]]\nname = \"grad_accum\"\nsteps = 4\nnormalize = \"tokens\"\n", "", 2, TKT_TOKENS_SETS,
     TKT_TOKENS_SETS "--set batch.micro_batch=8", then_short_last_windows},
    {"token shards: 2 ranks read disjoint sequences, equal to 1 process", shards_recipe, kAccumulate2,
     "check_every = 1\n", 2, "--set batch.micro_batch=2", "--set batch.micro_batch=4", nullptr},
    {"a batch-size ramp changes k at boundaries on every rank alike: 2 ranks == 1 process", base_recipe,
     "[[plugins]]\nname = \"grad_accum\"\neffective_batch = 32\nramp_from = 8\nramp_steps = 3\n", "check_every = 1\n", 2,
     "", "--set batch.micro_batch=8", then_k_ramped},
};
#undef TKT_TOKENS_SETS

TEST_SUITE("ddp") {
  TKT_TABLE_CASES(kRanksEqualOneProcess, ranks_equal_one_process);

  TEST_CASE("ranks whose models differ are refused at start, naming the first difference") {
    const fs::path root = tkt::temp_dir("ddp-differ");
    auto p = tk_run(root, experts_recipe(false) + "[[plugins]]\nname = \"ddp\"\n[world]\ntimeout_s = 20.0\n",
                    "--nproc 2 --set model.hidden_on_rank1=10");
    CHECK(p.rc == 1);
    CHECK(p.out.find("the model on rank 1 differs from rank 0's: parameter 'trunk.weight' is [10, 8] Double here and "
                     "[8, 8] Double on rank 0; every rank must build the same model") != std::string::npos);
    CHECK(p.out.find("step 1/") == std::string::npos);  // refused before any step
    // Rank 0 says which rank differs; a count that differs is named too.
    CHECK(p.out.find("[rank 0] [") != std::string::npos);
    CHECK(p.out.find("the model on rank 1 differs from rank 0's (that rank's error names the difference)") !=
          std::string::npos);
    auto count = tk_run(root / "count", experts_recipe(false) + "[[plugins]]\nname = \"ddp\"\n[world]\ntimeout_s = 20.0\n",
                        "--nproc 2 --set model.experts_on_rank1=3");
    CHECK(count.rc == 1);
    CHECK(count.out.find("the model on rank 1 differs from rank 0's: 14 parameters and 0 buffers here, 18 and 0 on "
                         "rank 0") != std::string::npos);
    CHECK(count.out.find("the model on rank 1 differs from rank 0's (that rank's error names the difference)") !=
          std::string::npos);
    fs::remove_all(root);
  }

  TEST_CASE("every rank starts from rank 0's parameters") {
    const fs::path root = tkt::temp_dir("ddp-broadcast");
    // Rank 1 starts from different weights; the broadcast at fit start must undo that.
    auto two = tk_run(root / "two", std::string(kBase) + "[[plugins]]\nname = \"probe\"\nperturb_at_start = true\n" +
                                        "only_rank = 1\n[[plugins]]\nname = \"ddp\"\ncheck_every = 1\n",
                      "--nproc 2");
    INFO(two.out);
    REQUIRE(two.rc == 0);
    auto big = tk_run(root / "big", kBase, "--set batch.micro_batch=8");
    REQUIRE(big.rc == 0);
    CHECK(tkt::excess(weights(root / "two"), weights(root / "big"), kF64) <= 1.0);
    fs::remove_all(root);
  }

  TEST_CASE("with mixed precision and clipping, every rank takes the same step: overflow veto and norm agree") {
    const fs::path root = tkt::temp_dir("ddp-amp");
    // An overflow on rank 1 only, at step 2: after the sync both ranks see it and both skip.
    const std::string plugins =
        "[[plugins]]\nname = \"clip\"\nmax_norm = 0.5\n"
        "[[plugins]]\nname = \"mixed_precision\"\ndtype = \"bf16\"\nloss_scale = \"dynamic\"\ninit_scale = 256.0\n"
        "[[plugins]]\nname = \"grad_accum\"\nsteps = 2\n"
        "[[plugins]]\nname = \"probe\"\ninf_grad_at_step = 2\nonly_rank = 1\n"
        "[[plugins]]\nname = \"ddp\"\ncheck_every = 1\n";
    auto two = tk_run(root, std::string(kBase) + plugins, "--nproc 2 --set run.dtype=float32");
    INFO(two.out);
    REQUIRE(two.rc == 0);
    CHECK(tkt::skipped(root / "out/metrics.jsonl") == std::vector<bool>{false, false, true, false, false, false});
    CHECK(tkt::metric(root / "out/metrics.jsonl", "loss_scale") == std::vector<double>{256, 256, 256, 128, 128, 128});
    CHECK(tkt::metric(root / "out/metrics.jsonl", "grad_norm")[0] > 0.5);
    fs::remove_all(root);
  }

  TEST_CASE("ranks that diverge are caught") {
    // Rank 1 nudges a parameter after step 3. step_end closes the step, so it goes to the plugins in
    // reverse order: the probe (listed after ddp) nudges first, and ddp's check after step 3 sees it.
    const fs::path root = tkt::temp_dir("ddp-diverge");
    auto p = tk_run(root, std::string(kBase) + "[[plugins]]\nname = \"ddp\"\ncheck_every = 1\n" +
                              "[[plugins]]\nname = \"probe\"\nperturb_at_step = 2\nonly_rank = 1\n",
                    "--nproc 2");
    CHECK(p.rc == 1);
    CHECK(p.out.find("ranks diverged after step 3") != std::string::npos);
    fs::remove_all(root);
  }

  TEST_CASE("a worker that fails stops the world, with its error, in bounded time") {
    const fs::path root = tkt::temp_dir("ddp-fail");
    auto p = tk_run(root, std::string(kBase) + "[[plugins]]\nname = \"ddp\"\n" + kLongTimeout +
                              "[[plugins]]\nname = \"probe\"\nthrow_at_step = 2\nonly_rank = 1\n",
                    "--nproc 2");
    CHECK(p.rc == 1);
    CHECK(p.out.find("[rank 1] ") != std::string::npos);
    CHECK(p.out.find("plugin 'probe' (") != std::string::npos);
    CHECK(p.out.find("tk_probe.so) failed in event backward in step 3, micro-batch 1 of 1: injected failure") !=
          std::string::npos);
    CHECK(p.out.find("tk-run: rank 1 failed (exited with code 1)") != std::string::npos);
    CHECK_FALSE(reports_timeout(p.out));  // the launcher stopped the world, not a collective's timeout
    fs::remove_all(root);
  }

  TEST_CASE("ranks that refuse the run make the launch exit 2, also when stopped on their way out") {
    const fs::path root = tkt::temp_dir("ddp-refused");
    const std::string recipe = std::string(kBase) + "[[plugins]]\nname = \"ddp\"\n";
    const std::string sets = "--nproc 2 --set batch.micro_batch='\"auto\"' --set batch.effective_batch=8 "
                             "--set batch.memory_budget='\"1KiB\"'";
    auto p = tk_run(root / "out", recipe, sets);
    CHECK(p.rc == 2);
    CHECK(p.out.find("batch.memory_budget: a training step of one micro-batch of 1 takes") != std::string::npos);
    // Rank 0 refuses first, records it, and lingers until the launcher stops it (as a rank slow
    // to leave its collectives does); rank 1 refuses after it and exits 2. The record says what
    // rank 0 did.
    auto lingering = tk_run(root / "lingering", recipe, sets, "TK_FAULT=refused-linger");
    INFO(lingering.out);
    CHECK(lingering.rc == 2);
    CHECK(lingering.out.find("failed (refused the run and was killed by signal 15 (Terminated) on its way out)") !=
          std::string::npos);
    fs::remove_all(root);
  }

  TEST_CASE("a worker killed by a signal stops the world, in bounded time") {
    const fs::path root = tkt::temp_dir("ddp-kill");
    auto p = tk_run(root, std::string(kBase) + "[[plugins]]\nname = \"ddp\"\n" + kLongTimeout +
                              "[[plugins]]\nname = \"probe\"\nkill_at_step = 2\nonly_rank = 1\n",
                    "--nproc 3");
    CHECK(p.rc == 1);
    CHECK(p.out.find("tk-run: rank 1 failed (was killed by signal 9") != std::string::npos);
    CHECK_FALSE(reports_timeout(p.out));  // the launcher stopped the world, not a collective's timeout
    // status.json has the cause, which rank 1 could not record, before what rank 0 saw after it.
    const auto status = nlohmann::json::parse(tkt::read_text(root / "out/status.json"));
    INFO(status.dump());
    CHECK(status["status"] == "failed");
    CHECK(status["detail"].get<std::string>().rfind("rank 1 was killed by signal 9 (Killed); rank 0 then failed: ", 0) == 0);
    fs::remove_all(root);
  }

  TEST_CASE("SIGTERM to rank 0 alone stops the world at one checkpoint: the launch exits 143, and resumes bit-identical") {
    const fs::path root = tkt::temp_dir("ddp-term-rank0");
    const std::string recipe = std::string(kBase) + "[[plugins]]\nname = \"ddp\"\n[[plugins]]\nname = \"probe\"\n";
    const std::string sets = "--nproc 2 --set run.steps=12 --set run.checkpoint_every=0 ";
    auto one = tk_run(root / "one", recipe, sets);
    REQUIRE(one.rc == 0);
    // Rank 0's process alone gets SIGTERM at step 3, as from a scheduler, not through the launcher.
    const std::string term = "--set plugins.probe.term_at_step=3 --set plugins.probe.only_rank=0 ";
    auto two = tk_run(root / "two", recipe, sets + term);
    INFO(two.out);
    CHECK(two.rc == 128 + 15);
    CHECK(two.out.find("[rank 0] stopped early (signal) after step 4") != std::string::npos);
    CHECK(two.out.find("[rank 1] stopped early (signal) after step 4") != std::string::npos);
    CHECK(two.out.find("tk-run: rank 0 got signal 15 and the world stopped with it at a checkpoint") != std::string::npos);
    CHECK(two.out.find("failed") == std::string::npos);
    auto resumed = tk_run(root / "two", recipe, sets + term + "--resume latest");
    INFO(resumed.out);
    REQUIRE(resumed.rc == 0);
    CHECK(torch::equal(weights(root / "two"), weights(root / "one")));
    fs::remove_all(root);
  }

  TEST_CASE("Ctrl-C at a terminal (SIGINT to the launcher and every rank) stops the world at one checkpoint, and a second Ctrl-C at once") {
    const fs::path root = tkt::temp_dir("ddp-ctrl-c");
    const std::string recipe = std::string(kBase) + "[[plugins]]\nname = \"ddp\"\n[[plugins]]\nname = \"probe\"\n";
    const std::string sets = "--nproc 2 --set run.steps=200000 --set run.max_time=\\\"60s\\\" --set run.checkpoint_every=0 ";
    // The launch in a session of its own, as a terminal's foreground job; SIGINT to its whole process
    // group once `ready` holds (twice: a second Ctrl-C once the launcher has passed the first on).
    auto again = [](const fs::path& log) {
      return "i=0; while ! grep -q \"got signal 2; stopping the workers\" " + log.string() +
             " && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done; t0=$(date +%s%N); kill -INT -$pid; ";
    };
    auto launch = [&](const std::string& name, const std::string& more, const std::string& ready, bool twice) {
      const fs::path dir = root / name;
      fs::create_directories(dir);
      const std::string cmd = "setsid env " + tkt::tk_run_command(dir, recipe, sets + more) + " > " + (dir / "log").string() +
                              " 2>&1 & pid=$!; i=0; while ! { " + ready + "; } && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); "
                              "done; kill -INT -$pid; " + (twice ? again(dir / "log") : "") + "wait $pid; rc=$?; " +
                              (twice ? "echo $(( ($(date +%s%N) - t0) / 1000000 )) > " + (dir / "kill_ms").string() + "; " : "") +
                              "exit $rc";
      const int status = std::system(("sh -c '" + cmd + "'").c_str());
      std::ifstream log(dir / "log");
      return std::make_pair(WEXITSTATUS(status), std::string((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>()));
    };
    const auto [rc, out] = launch("once", "", "[ -s " + (root / "once/out/metrics.jsonl").string() + " ]", false);
    INFO(out);
    CHECK(rc == 128 + 2);
    // Each rank got the signal twice (from the terminal and from the launcher): it keeps to the first.
    const size_t at = out.find("[rank 0] stopped early (signal) after step ");
    REQUIRE(at != std::string::npos);
    const std::string step = out.substr(at + 43, out.find(';', at) - at - 43);
    CHECK(out.find("[rank 1] stopped early (signal) after step " + step + ";") != std::string::npos);
    CHECK(fs::exists(root / ("once/out/checkpoints/step-" + std::string(8 - step.size(), '0') + step)));
    CHECK(out.find("failed") == std::string::npos);
    // Rank 1 hangs (SIGSTOP) at step 3, so the first Ctrl-C cannot stop the world at a boundary: the
    // second kills the ranks at once, not after the launcher's grace period.
    const auto [rc2, out2] = launch("twice", "--set plugins.probe.stop_at_step=3 --set plugins.probe.only_rank=1",
                                    "ps -o stat= --sid $pid | grep -q T", true);
    INFO(out2);
    CHECK(rc2 != 0);
    CHECK(out2.find("tk-run: got signal 2 again; killing the workers") != std::string::npos);
    // At once: the launch ended within the launcher's grace period (10 s) of the second Ctrl-C,
    // which it would have waited out for the hung rank had it not killed at once.
    const std::string ms = tkt::read_text(root / "twice/kill_ms");
    INFO("from the second Ctrl-C to the launch's end: " << ms << " ms");
    REQUIRE_FALSE(ms.empty());
    CHECK(std::stol(ms) < 8000);
    fs::remove_all(root);
  }

  /// A port that is free, with the next one free too (the launchers of several nodes use both).
  int free_port_pair() {
    for (int attempt = 0; attempt < 50; ++attempt) {
      int ports[2] = {0, 0};
      int s[2] = {socket(AF_INET, SOCK_STREAM, 0), socket(AF_INET, SOCK_STREAM, 0)};
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      socklen_t len = sizeof a;
      bool ok = bind(s[0], reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                getsockname(s[0], reinterpret_cast<sockaddr*>(&a), &len) == 0;
      ports[0] = ntohs(a.sin_port);
      a.sin_port = htons(static_cast<uint16_t>(ports[0] + 1));
      ok = ok && ports[0] < 65535 && bind(s[1], reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
      close(s[0]);
      close(s[1]);
      if (ok) return ports[0];
    }
    FAIL("no two free neighbouring ports on 127.0.0.1");
    return 0;
  }

  /// Two launchers on 127.0.0.1 as node 0 and node 1 of one world, 2 workers each: node 0's
  /// output in out, node 1's in DIR/node1.log (its exit status on the last line of out).
  /// `private1`: node 1 runs in a mount namespace of its own, with a file system of its own over the
  /// output folder (a machine that does not share node 0's).
  Proc two_nodes(const fs::path& dir, const std::string& recipe, const std::string& args, int nproc1 = 2,
                 const std::string& args1 = "", bool private1 = false) {
    const std::string nodes = " --nnodes 2 --master-addr 127.0.0.1 --master-port " + std::to_string(free_port_pair()) +
                              " " + args;
    std::string node1 =
        tkt::tk_run_command(dir, recipe, nodes + " --node-rank 1 --nproc " + std::to_string(nproc1) + args1);
    if (private1) {
      fs::create_directories(dir / "out");
      std::ofstream(dir / "node1.sh") << node1 << "\n";
      node1 = "unshare -m --propagation private sh -c 'mount -t tmpfs tmpfs " + (dir / "out").string() + " && exec sh " +
              (dir / "node1.sh").string() + "'";
    }
    const std::string node0 = tkt::tk_run_command(dir, recipe, nodes + " --node-rank 0 --nproc 2");
    return tkt::shell("{ " + node1 + " > " + (dir / "node1.log").string() + " 2>&1; echo \"node 1 exited $?\" >> " +
                      (dir / "node1.log").string() + "; } & n1=$!; " + node0 + " 2>&1; rc=$?; wait $n1; exit $rc");
  }

  TEST_CASE("two launchers as node 0 and node 1, 2 workers each, form a world of 4 equal to one process") {
    const fs::path root = tkt::temp_dir("ddp-nodes");
    const std::string accum = "[[plugins]]\nname = \"grad_accum\"\nsteps = 2\n";
    auto four = two_nodes(root / "four", std::string(kBase) + "[[plugins]]\nname = \"ddp\"\ncheck_every = 1\n" + accum, "");
    const std::string node1 = tkt::read_text(root / "four/node1.log");
    INFO(four.out);
    INFO(node1);
    REQUIRE(four.rc == 0);
    CHECK(node1.find("node 1 exited 0") != std::string::npos);
    CHECK(node1.find("[rank 3] ") != std::string::npos);
    CHECK(four.out.find("world         rank 0 of 4 (RANK/WORLD_SIZE, gloo, rendezvous 127.0.0.1:") != std::string::npos);
    CHECK(node1.find("world: rank 3 of 4 (RANK/WORLD_SIZE, gloo, rendezvous 127.0.0.1:") != std::string::npos);
    auto one = tk_run(root / "one", std::string(kBase) + accum, "--set batch.micro_batch=16");
    REQUIRE(one.rc == 0);
    CHECK(tkt::excess(weights(root / "four"), weights(root / "one"), kF64) <= 1.0);
    CHECK(tkt::metric(root / "four/out/metrics.jsonl", "micro_batches").back() == 8);  // 4 ranks x k = 2
    fs::remove_all(root);
  }

  TEST_CASE("launchers given different recipes are refused before training, each differing rank naming its keys") {
    const fs::path root = tkt::temp_dir("ddp-nodes-recipe");
    auto p = two_nodes(root, std::string(kBase) + "[[plugins]]\nname = \"ddp\"\n" + kLongTimeout, "", 2,
                       " --set optimizer.lr=0.5 --set run.seed=10");
    const std::string node1 = tkt::read_text(root / "node1.log");
    INFO(p.out);
    INFO(node1);
    CHECK(p.rc != 0);
    CHECK(node1.find("rank 2 trains another recipe than rank 0: ") != std::string::npos);
    CHECK(node1.find("optimizer.lr = 0.5") != std::string::npos);
    CHECK(node1.find("run.seed = 10") != std::string::npos);
    CHECK(node1.find("every launcher of a run must be given the same recipe and the same --set options") !=
          std::string::npos);
    CHECK(p.out.find("another rank trains another recipe than rank 0 (that rank's error names the keys)") !=
          std::string::npos);
    CHECK(p.out.find("step 1/") == std::string::npos);  // no step was trained
    CHECK_FALSE(reports_timeout(p.out));
    fs::remove_all(root);
  }

  TEST_CASE("a rank that dies on one node stops the other node, which names it") {
    const fs::path root = tkt::temp_dir("ddp-nodes-kill");
    auto p = two_nodes(root, std::string(kBase) + "[[plugins]]\nname = \"ddp\"\n" + kLongTimeout +
                                 "[[plugins]]\nname = \"probe\"\nkill_at_step = 2\nonly_rank = 3\n", "");
    const std::string node1 = tkt::read_text(root / "node1.log");
    INFO(p.out);
    INFO(node1);
    CHECK(p.rc == 1);
    CHECK(p.out.find("tk-run: the world failed: rank 3 failed (was killed by signal 9 (Killed)) on node 1") !=
          std::string::npos);
    CHECK(node1.find("tk-run: rank 3 failed (was killed by signal 9 (Killed))") != std::string::npos);
    CHECK(node1.find("node 1 exited 1") != std::string::npos);
    CHECK_FALSE(reports_timeout(p.out));  // the launcher stopped the world, not a collective's timeout
    fs::remove_all(root);
  }

  TEST_CASE("a node whose launcher dies stops the other node, which names it") {
    const fs::path root = tkt::temp_dir("ddp-nodes-gone");
    auto p = two_nodes(root, std::string(kBase) + "[[plugins]]\nname = \"ddp\"\n" + kLongTimeout +
                                 "[[plugins]]\nname = \"probe\"\nkill_launcher_at_step = 2\nonly_rank = 2\n", "");
    INFO(p.out);
    CHECK(p.rc == 1);
    CHECK(p.out.find("tk-run: the world failed: node 1 stopped answering") != std::string::npos);
    CHECK_FALSE(reports_timeout(p.out));  // the launcher stopped the world, not a collective's timeout
    fs::remove_all(root);
  }

  TEST_CASE("with a sharded optimizer, a node that does not see the output folder of rank 0 is refused before training (may skip)") {
    const fs::path root = tkt::temp_dir("ddp-nodes-unshared");
    fs::create_directories(root);
    const bool can = std::system(("unshare -m --propagation private mount -t tmpfs tmpfs " + root.string() +
                                  " > /dev/null 2>&1").c_str()) == 0;
    if (!can) fs::remove_all(root);
    TK_SKIP_IF(!can, "no private mount namespace with a file system of its own here (unshare -m and mount need root)");
    auto p = two_nodes(root, base_with(kAdamW) + "[[plugins]]\nname = \"ddp\"\n" + kLongTimeout +
                                 "[[plugins]]\nname = \"shard\"\nstage = 1\n", "", 2, "", true);
    const std::string node1 = tkt::read_text(root / "node1.log");
    INFO(p.out);
    INFO(node1);
    CHECK(p.rc == 2);
    CHECK(p.out.find("rank 0 does not see what rank 2 writes in the checkpoint folder '" + (root / "out/checkpoints").string() +
                     "': with an optimizer sharded over the ranks each rank writes its own share") != std::string::npos);
    CHECK(node1.find("node 1 exited 2") != std::string::npos);
    CHECK(p.out.find("step 1/") == std::string::npos);  // before the first step
    fs::remove_all(root);
  }

  TEST_CASE("--nnodes needs --master-port, and --node-rank inside --nnodes") {
    const fs::path root = tkt::temp_dir("ddp-nodes-usage");
    const std::string recipe = std::string(kBase) + "[[plugins]]\nname = \"ddp\"\n";
    auto p = tk_run(root, recipe, "--nnodes 2 --node-rank 0 --nproc 2");
    CHECK(p.rc == 2);
    CHECK(p.out.find("--nnodes 2 needs --master-port (the same on every node)") != std::string::npos);
    p = tk_run(root, recipe, "--nnodes 2 --node-rank 2 --master-port 29500 --nproc 2");
    CHECK(p.rc == 2);
    CHECK(p.out.find("--node-rank 2 is outside --nnodes 2 (node ranks go from 0 to 1)") != std::string::npos);
    // Nodes with different numbers of workers: both refuse, before any worker starts.
    p = two_nodes(root / "uneven", recipe, "", 1);
    CHECK(p.rc == 1);
    CHECK(p.out.find("node 1 starts 1 workers and node 0 2: give every node the same --nproc") != std::string::npos);
    CHECK(tkt::read_text(root / "uneven/node1.log").find("give every node the same --nproc") != std::string::npos);
    fs::remove_all(root);
  }

  TEST_CASE("a rank that never comes is named within rendezvous_timeout_s, and a stop signal while waiting for it ends the wait at once") {
    const fs::path root = tkt::temp_dir("rendezvous-stop");
    const std::string recipe = std::string(kBase) + "[[plugins]]\nname = \"ddp\"\n[world]\nrendezvous_timeout_s = 120\n";
    const std::string env = "WORLD_SIZE=2 RANK=0 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                            std::to_string(free_port_pair()) + " ";
    // Rank 0 of 2 alone (torchrun's variables, rank 1 never started): stopped 2 s after its plan.
    const fs::path log = root / "rank0.log";
    auto p = tkt::shell(env + tkt::tk_run_command(root, recipe, "") + " > " + log.string() + " 2>&1 & pid=$!; " +
                        "for i in $(seq 600); do grep -q 'plan:' " + log.string() + " && break; sleep 0.1; done; sleep 2; " +
                        "s=$(date +%s%N); kill -TERM $pid; wait $pid; rc=$?; echo \"stopped in $((($(date +%s%N) - s) / 1000000)) ms\"; exit $rc");
    const std::string out = tkt::read_text(log);
    INFO(out);
    INFO(p.out);
    CHECK(p.rc == 128 + SIGTERM);
    CHECK(out.find("stopped while waiting for the other ranks at 127.0.0.1:") != std::string::npos);
    CHECK(out.find("(rank 0 of 2): nothing was trained, nothing written (signal 15)") != std::string::npos);
    CHECK(out.find("the run failed") == std::string::npos);
    const size_t at = p.out.find("stopped in ");
    REQUIRE(at != std::string::npos);
    CHECK(std::stol(p.out.substr(at + 11)) < 5000);  // the wait was to last 120 s
    CHECK(!fs::exists(root / "out/metrics.jsonl"));
    // Not stopped: rank 1 is named after rendezvous_timeout_s (3 s), not after the collectives' timeout_s (300 s).
    auto alone = tkt::shell(env + tkt::tk_run_command(root, recipe, "--set world.rendezvous_timeout_s=3"));
    INFO(alone.out);
    CHECK(alone.rc == 1);
    CHECK(alone.out.find("failed for rank 0 of 2: rank 1 did not join within [world] rendezvous_timeout_s = 3 s") !=
          std::string::npos);
    CHECK(alone.out.find("the run failed before it wrote anything") != std::string::npos);
    CHECK(alone.out.find("Exception raised from") == std::string::npos);
    CHECK(alone.seconds < 60);
    fs::remove_all(root);
  }

  TEST_CASE("a node that never comes, and two launchers given one node rank, are named within rendezvous_timeout_s") {
    const fs::path root = tkt::temp_dir("ddp-nodes-wait");
    const std::string recipe = std::string(kBase) + "[[plugins]]\nname = \"ddp\"\n[world]\nrendezvous_timeout_s = 10\n";
    const std::string port = std::to_string(free_port_pair());
    const std::string nodes = "--nnodes 2 --master-addr 127.0.0.1 --master-port " + port + " --nproc 1 ";
    // Node 1 never starts: node 0 names it after 10 s, not 300.
    auto alone = tk_run(root / "alone", recipe, nodes + "--node-rank 0");
    INFO(alone.out);
    CHECK(alone.rc == 1);
    CHECK(alone.out.find("node 1 did not join within [world] rendezvous_timeout_s = 10 s") != std::string::npos);
    CHECK(alone.seconds < 60);
    // Node 0 never starts: node 1 says that node 0's launcher did not answer.
    auto orphan = tk_run(root / "orphan", recipe, nodes + "--node-rank 1");
    INFO(orphan.out);
    CHECK(orphan.rc == 1);
    CHECK(orphan.out.find("node 0's launcher did not answer within [world] rendezvous_timeout_s = 10 s") !=
          std::string::npos);
    // Two launchers given --node-rank 0 on one machine: the one that comes second finds the port
    // taken and says why; the other names node 1 as missing.
    const std::string first = tkt::tk_run_command(root / "first", recipe, nodes + "--node-rank 0");
    const std::string second = tkt::tk_run_command(root / "second", recipe, nodes + "--node-rank 0");
    auto twice = tkt::shell("{ " + first + " > " + (root / "first.log").string() + " 2>&1; } & n0=$!; " + second +
                            " > " + (root / "second.log").string() + " 2>&1; wait $n0; exit 0");
    const std::string both = tkt::read_text(root / "first.log") + tkt::read_text(root / "second.log");
    INFO(both);
    CHECK(both.find("another launcher was given --node-rank 0 (each launcher of a run needs its own)") !=
          std::string::npos);
    CHECK(both.find("node 1 did not join within") != std::string::npos);
    // Three nodes, two of them given --node-rank 1: one is told, and node 2 is named missing.
    const std::string three = "--nnodes 3 --master-addr 127.0.0.1 --master-port " + port + " --nproc 1 ";
    const std::string a = tkt::tk_run_command(root / "a", recipe, three + "--node-rank 0");
    const std::string b = tkt::tk_run_command(root / "b", recipe, three + "--node-rank 1");
    const std::string c = tkt::tk_run_command(root / "c", recipe, three + "--node-rank 1");
    auto dup = tkt::shell("{ " + a + " > " + (root / "a.log").string() + " 2>&1; } & n0=$!; { " + b + " > " +
                          (root / "b.log").string() + " 2>&1; } & n1=$!; " + c + " > " + (root / "c.log").string() +
                          " 2>&1; wait $n0; wait $n1; exit 0");
    const std::string logs = tkt::read_text(root / "a.log") + tkt::read_text(root / "b.log") + tkt::read_text(root / "c.log");
    INFO(logs);
    CHECK(logs.find(") was given --node-rank 1 too: each launcher of a run needs its own node rank") != std::string::npos);
    CHECK(logs.find("node 2 did not join within") != std::string::npos);
    CHECK(logs.find("step 1/") == std::string::npos);
    fs::remove_all(root);
  }

  TEST_CASE("--dry-run with --nproc shows the per-rank and the global batch") {
    const fs::path root = tkt::temp_dir("ddp-dry");
    auto p = tk_run(root, std::string(kBase) + "[[plugins]]\nname = \"ddp\"\n[[plugins]]\nname = \"grad_accum\"\nsteps = 3\n",
                    "--nproc 4 --dry-run");
    CHECK(p.rc == 0);
    CHECK(p.out.find("effective     48 examples per optimizer step (4 x 3 x 4); 12 per rank") != std::string::npos);
    CHECK(p.out.find("world         rank 0 of 4 (RANK/WORLD_SIZE, gloo, rendezvous 127.0.0.1:") != std::string::npos);
    CHECK(p.out.find("; not joined: a dry run plans this rank alone") != std::string::npos);
    // The training state, and what each rank holds of it: all of it without a stage that shards.
    CHECK(p.out.find("state         ") != std::string::npos);
    CHECK(p.out.find(" unsharded (parameters ") != std::string::npos);
    CHECK(p.out.find("; at ZeRO stage 0 over 4 ranks about ") != std::string::npos);
    CHECK(p.out.find(" for the 4 on a machine") != std::string::npos);
    // At stage 3 the MLP's first weight (128 of its 212 parameters) makes the shares uneven.
    auto zero = tk_run(root / "zero", std::string(kBase) + "[[plugins]]\nname = \"ddp\"\n[[plugins]]\nname = \"shard\"\nstage = 3\n",
                       "--nproc 4 --dry-run");
    INFO(zero.out);
    CHECK(zero.rc == 0);
    CHECK(zero.out.find("; at ZeRO stage 3 over 4 ranks about ") != std::string::npos);
    // On a model this small stage 3's buffers outweigh what it shards: the plan says so, and why.
    CHECK(zero.out.find(" (more than unsharded: on this model the blocks' parameters gathered and their gradients sent, "
                        "and the uneven shares below, take more than the stage saves)") != std::string::npos);
    CHECK(zero.out.find("; uneven: its largest tensor is 60% of the trainable parameters, and the rank that holds it holds "
                        "that tensor's optimizer state whole, and its gradient and its weights") != std::string::npos);
    fs::remove_all(root);
  }
}

TEST_SUITE("zero") {
  const char* const kStage1 = "stage = 1\n";
  const char* const kStage2 = "stage = 2\n";                         // summed onto the owners after every backward
  const char* const kStage2Window = "stage = 2\nreduce = \"window\"\n";  // after the window's last
  const char* const kStage3 = "stage = 3\n";
  const char* const kStage3Window = "stage = 3\nreduce = \"window\"\n";

  /// Every record's `key` in run folder `a` equals that in `b` to `tol` (relative, above 1), NaN
  /// where it is NaN.
  void check_metric_close(const fs::path& a, const fs::path& b, const char* key, double tol) {
    CAPTURE(key);
    const auto x = tkt::metric(a / "out/metrics.jsonl", key), y = tkt::metric(b / "out/metrics.jsonl", key);
    REQUIRE(x.size() == y.size());
    for (size_t i = 0; i < x.size(); ++i)
      CHECK(((std::isnan(x[i]) && std::isnan(y[i])) || std::abs(x[i] - y[i]) <= tol * std::max(1.0, std::abs(y[i]))));
  }

  /// `recipe` + `plugins` on `ranks` ranks with ddp and the shard plugin given `shard` (ROOT/zero)
  /// and ddp alone (ROOT/ddp), with `sets`: the same weights and the same record of every step, bit
  /// for bit (`tol` 0), or to `tol` (stage 2 sums a gradient's parts in another order than ddp's
  /// all-reduce: onto its owner, and with reduce = "micro_batch" backward by backward). Returns the
  /// sharded run.
  Proc zero_equals_ddp(const fs::path& root, const std::string& recipe, const std::string& plugins, int ranks,
                       const std::string& sets = "", const std::string& shard = kStage1, double tol = 0.0) {
    const std::string args = "--nproc " + std::to_string(ranks) + " " + sets;
    auto zero = tk_run(root / "zero", recipe + plugins + "[[plugins]]\nname = \"ddp\"\ncheck_every = 1\n[[plugins]]\nname = \"shard\"\n" + shard, args);
    INFO(zero.out);
    REQUIRE(zero.rc == 0);
    auto ddp = tk_run(root / "ddp", recipe + plugins + "[[plugins]]\nname = \"ddp\"\ncheck_every = 1\n", args);
    REQUIRE(ddp.rc == 0);
    const auto a = weights(root / "zero"), b = weights(root / "ddp");
    REQUIRE(a.sizes() == b.sizes());
    CHECK((a - b).abs().max().item<double>() <= tol * std::max(1.0, b.abs().max().item<double>()));
    for (const char* key : {"loss", "lr", "micro_batches", "effective_batch", "grad_norm", "loss_scale"})
      check_metric_close(root / "zero", root / "ddp", key, tol);
    CHECK(tkt::skipped(root / "zero/out/metrics.jsonl") == tkt::skipped(root / "ddp/out/metrics.jsonl"));
    // Each rank updates its share and broadcasts it: the check of every step saw equal ranks.
    const std::string stage = shard.substr(0, shard.find('\n')).substr(8);
    const char* what = stage == "3" ? ", the gradients and the parameters are" : stage == "2" ? " and the gradients are" : " is";
    CHECK(zero.out.find(ranks == 1 ? "stage " + stage + " in a world of one rank: it holds and updates every parameter"
                                   : "stage " + stage + ": the optimizer state" + what + " sharded over " +
                                         std::to_string(ranks) + " ranks;") != std::string::npos);
    return zero;
  }

  TEST_CASE("AdamW with a schedule, clipping and accumulation: the sharded step is the ddp step, bit for bit") {
    const fs::path root = tkt::temp_dir("zero-adamw");
    const std::string plugins =
        "[schedule]\nname = \"warmup_cosine\"\nwarmup_steps = 2\nmin_lr = 0.001\n"
        "[[plugins]]\nname = \"clip\"\nmax_norm = 0.5\n[[plugins]]\nname = \"grad_accum\"\nsteps = 2\n";
    zero_equals_ddp(root, base_with(kAdamW), plugins, 2);
    // Clipping bit: the global norm over all parameters, the same on every rank.
    CHECK(tkt::metric(root / "zero/out/metrics.jsonl", "grad_norm")[0] > 0.5);
    // Each rank holds its share of the state: AdamW's two moments of 212 float64 parameters in
    // all, within one largest tensor (8 x 16 weights) of half of them here on rank 0.
    const auto sharded = tkt::metric(root / "zero/out/metrics.jsonl", "optimizer_state_mib");
    const auto whole = tkt::metric(root / "ddp/out/metrics.jsonl", "optimizer_state_mib");
    constexpr double kMiB = 1024.0 * 1024.0;
    CHECK(whole.back() * kMiB == doctest::Approx(2 * 212 * 8).epsilon(1e-6));
    CHECK(sharded.back() * kMiB < whole.back() * kMiB);
    CHECK(sharded.back() * kMiB <= 212 * 8 + 2 * 128 * 8);
    CHECK(sharded.back() > 0);
    // Stage 2, both ways of summing: rank 0 holds the gradients of its share alone at the boundary.
    for (const char* shard : {kStage2, kStage2Window}) {
      CAPTURE(shard);
      const fs::path dir = root / (std::string(shard).size() > 10 ? "window" : "micro");
      zero_equals_ddp(dir, base_with(kAdamW), plugins, 2, "", shard, 1e-12);
      const auto held = tkt::metric(dir / "zero/out/metrics.jsonl", "grad_mib");
      const auto state = tkt::metric(dir / "zero/out/metrics.jsonl", "optimizer_state_mib");
      REQUIRE(!held.empty());
      CHECK(held.back() * kMiB == doctest::Approx(state.back() * kMiB / 2).epsilon(1e-9));  // AdamW: 2 moments a gradient
      CHECK(held.back() * kMiB < 212 * 8);
      CHECK(tkt::metric(dir / "zero/out/metrics.jsonl", "param_mib").back() * kMiB == doctest::Approx(212 * 8));
      CHECK(tkt::metric(dir / "zero/out/metrics.jsonl", "shard_grad_reduces").back() >= 2);
    }
    fs::remove_all(root);
  }

  TEST_CASE("stage 2 on 1, 2, 3 and 4 ranks, summed after every backward or every window: the weights of ddp and of one process to 1e-12") {
    const fs::path root = tkt::temp_dir("zero-stage2");
    const std::string recipe = base_with(kAdamW) + "[schedule]\nname = \"warmup_cosine\"\nwarmup_steps = 2\n"
                               "[[plugins]]\nname = \"clip\"\nmax_norm = 0.5\n[[plugins]]\nname = \"grad_accum\"\n";
    // 24 examples a step whatever the world: micro-batches of 4, 6 per step in all.
    const std::string batch = "--set batch.effective_batch=24 --set run.steps=8 ";
    auto one = tk_run(root / "one", recipe, batch);
    REQUIRE(one.rc == 0);
    for (int ranks : {1, 2, 3, 4}) {
      // 24 examples a step do not divide over 4 ranks in micro-batches of 4: 32 there.
      const std::string sets = ranks == 4 ? "--set batch.effective_batch=32 --set run.steps=8 " : batch;
      const fs::path reference = ranks == 4 ? root / "one-32" : root / "one";
      if (ranks == 4) REQUIRE(tk_run(reference, recipe, sets).rc == 0);
      for (const char* shard : {kStage2, kStage2Window}) {
        CAPTURE(ranks);
        CAPTURE(shard);
        const fs::path dir = root / (std::to_string(ranks) + (std::string(shard).size() > 10 ? "-window" : "-micro"));
        zero_equals_ddp(dir, recipe, "", ranks, sets, shard, 1e-12);
        const auto a = weights(dir / "zero"), b = weights(reference);
        CHECK((a - b).abs().max().item<double>() <= 1e-12);
        check_metric_close(dir / "zero", reference, "loss", 1e-12);
      }
    }
    // Experts the ranks do not all use in a window: a gradient a rank lacks adds zeros to its owner's sum.
    zero_equals_ddp(root / "experts", experts_recipe(true), kAccumulate2, 2, "", kStage2, 1e-12);
    // Six blocks of a few hundred bytes: an owner's neighbouring small blocks share a bucket, one
    // reduce (a bucket per block would be 6, and the head's a 7th).
    std::string deep = base_with(kAdamW);
    deep.replace(deep.find("hidden = [16]"), 13, "hidden = [8, 8, 8, 8, 8, 8]");
    zero_equals_ddp(root / "small-blocks", deep, "", 2, "", kStage2, 1e-12);
    const auto reduces = tkt::metric(root / "small-blocks/zero/out/metrics.jsonl", "shard_grad_reduces");
    REQUIRE(!reduces.empty());
    CHECK(reduces.back() >= 2);  // two owners
    CHECK(reduces.back() <= 4);  // each owner's blocks in one bucket, the head's (of no block) apart
    fs::remove_all(root);
  }

  TEST_CASE("stage 3 on 1, 2, 3 and 4 ranks, with validation, summed after every backward or every window: the weights of ddp and of one process to 1e-12") {
    const fs::path root = tkt::temp_dir("zero-stage3");
    // Two blocks (the hidden layers) and the head, which is of no block: 6 tensors, 316 float64s.
    std::string recipe = base_with(kAdamW) + "[schedule]\nname = \"warmup_cosine\"\nwarmup_steps = 2\n"
                         "[[plugins]]\nname = \"clip\"\nmax_norm = 0.5\n[[plugins]]\nname = \"grad_accum\"\n";
    recipe.replace(recipe.find("hidden = [16]"), 13, "hidden = [16, 8]");
    const std::string batch = "--set batch.effective_batch=24 --set run.steps=8 --set data.validation_samples=40 "
                              "--set run.validate_every=3 ";
    auto one = tk_run(root / "one", recipe, batch);
    REQUIRE(one.rc == 0);
    constexpr double kMiB = 1024.0 * 1024.0;
    for (int ranks : {1, 2, 3, 4}) {
      const std::string sets = ranks == 4 ? batch + "--set batch.effective_batch=32 " : batch;
      const fs::path reference = ranks == 4 ? root / "one-32" : root / "one";
      if (ranks == 4) REQUIRE(tk_run(reference, recipe, sets).rc == 0);
      for (const char* shard : {kStage3, kStage3Window}) {
        CAPTURE(ranks);
        CAPTURE(shard);
        const fs::path dir = root / (std::to_string(ranks) + (std::string(shard).size() > 10 ? "-window" : "-micro"));
        auto zero = zero_equals_ddp(dir, recipe, "", ranks, sets, shard, 1e-12);
        CHECK((weights(dir / "zero") - weights(reference)).abs().max().item<double>() <= 1e-12);
        for (const char* key : {"loss", "validation_loss"}) check_metric_close(dir / "zero", reference, key, 1e-12);
        if (ranks > 1)  // a world of one gathers nothing, and says so (zero_equals_ddp)
          CHECK(zero.out.find("parameters gathered for each of the model's 2 blocks in forward and backward, the rest for "
                              "each micro-batch") != std::string::npos);
        // Between steps rank 0 holds its own parameters alone: as many bytes as the state it steps
        // has per moment, and fewer than the model's when other ranks update some.
        const auto held = tkt::metric(dir / "zero/out/metrics.jsonl", "param_mib");
        const auto state = tkt::metric(dir / "zero/out/metrics.jsonl", "optimizer_state_mib");
        REQUIRE(!held.empty());
        CHECK(held.back() * kMiB == doctest::Approx(state.back() * kMiB / 2).epsilon(1e-9));
        if (ranks > 1) {
          CHECK(held.back() * kMiB < 316 * 8);
          CHECK(tkt::metric(dir / "zero/out/metrics.jsonl", "shard_param_gathers").back() > 0);
        } else {
          CHECK(held.back() * kMiB == doctest::Approx(316 * 8));
        }
      }
    }
    // Without prefetch the same gathers start later: the same weights, bit for bit. As the fit ends no
    // rank holds a gradient beside the weights it gathers whole (the memory check counts on it).
    auto late = tk_run(root / "late", recipe + "[[plugins]]\nname = \"ddp\"\n[[plugins]]\nname = \"shard\"\n" + kStage3 +
                                          "prefetch = false\n[[plugins]]\nname = \"probe\"\nno_grads_at_end = true\n",
                       "--nproc 3 " + batch);
    INFO(late.out);
    REQUIRE(late.rc == 0);
    CHECK(torch::equal(weights(root / "late"), weights(root / "3-micro/zero")));
    // Ten blocks, validation and a checkpoint after every step: a rank holds its share, the head
    // and at most two blocks of other ranks at once (backward's prefetch waits for the block after
    // the one computing to go), in training and in validation alike, and writes the parameters it
    // keeps into the checkpoint, gathering none.
    std::string deep = recipe;
    deep.replace(deep.find("hidden = [16, 8]"), 16, "hidden = [16, 16, 16, 16, 16, 16, 16, 16, 16, 16]");
    const std::string every = "--set batch.effective_batch=24 --set run.steps=4 --set data.validation_samples=40 "
                              "--set run.validate_every=1 ";
    REQUIRE(tk_run(root / "deep-one", deep, every).rc == 0);
    auto deep3 = tk_run(root / "deep", deep + "[[plugins]]\nname = \"ddp\"\n[[plugins]]\nname = \"shard\"\n" + kStage3,
                        "--nproc 2 --set run.checkpoint_every=1 " + every);
    INFO(deep3.out);
    REQUIRE(deep3.rc == 0);
    check_metric_close(root / "deep", root / "deep-one", "validation_loss", 1e-12);
    // 8 -> 16, nine 16 -> 16 and the head 16 -> 4, in float64.
    const double model = 8.0 * (144 + 9 * 272 + 68), head_and_two = 8.0 * (68 + 2 * 272);
    REQUIRE(static_cast<double>(weights(root / "deep-one").numel()) * 8 == model);
    const auto own = tkt::metric(root / "deep/out/metrics.jsonl", "param_mib");
    const auto peak = tkt::metric(root / "deep/out/metrics.jsonl", "shard_param_peak_mib");
    REQUIRE(peak.size() == 4);
    REQUIRE(own.size() == 4);
    for (size_t i = 0; i < peak.size(); ++i) {
      CAPTURE(i);
      CHECK(peak[i] > own[i]);
      CHECK(peak[i] * kMiB <= own[i] * kMiB + head_and_two + 1e-6);
      CHECK(peak[i] * kMiB < model);
    }
    // The checkpoint: model.pt by rank 0 with what no rank keeps (here nothing but the empty
    // list of buffers), and a share of the parameters from each rank; read whole as `[model] init`.
    const fs::path step2 = root / "deep/out/checkpoints/step-00000002";
    for (const char* f : {"model.pt", "model-share-0.pt", "model-share-1.pt", "optimizer-share-1.pt"})
      CHECK(fs::is_regular_file(step2 / f));
    CHECK(!fs::exists(step2 / "model-share-2.pt"));
    // The last checkpoint's files merged by name (what a script with torch.load does) are the
    // run's weights.pt: rank 1 kept some tensors, and model.pt holds none of them.
    const fs::path last = root / "deep/out/checkpoints/step-00000004";
    std::map<std::string, at::Tensor> merged;
    for (const char* f : {"model.pt", "model-share-0.pt", "model-share-1.pt"})
      for (const auto& [name, t] : tk::load_tensor_dict(last / f)) CHECK(merged.emplace(name, t).second);
    CHECK(tk::load_tensor_dict(last / "model-share-1.pt").size() > 0);
    const auto final_weights = tk::load_tensor_dict(root / "deep/out/weights.pt");
    CHECK(merged.size() == final_weights.size());
    for (const auto& [name, t] : final_weights) {
      CAPTURE(name);
      REQUIRE(merged.count(name) == 1);
      CHECK(torch::equal(merged.at(name), t));
    }
    // tk::load_model_weights (tk-sample's and tk-export's --weights) merges the folder the same.
    const auto consolidated = tk::load_model_weights(last);
    CHECK(consolidated.size() == merged.size());
    for (const auto& [name, t] : consolidated) {
      CAPTURE(name);
      REQUIRE(merged.count(name) == 1);
      CHECK(torch::equal(merged.at(name), t));
    }
    auto init = tk_run(root / "init", deep, "--set run.steps=1 --set model.init='\"" + (step2 / "model.pt").string() + "\"'");
    INFO(init.out);
    CHECK(init.rc == 0);
    CHECK(init.out.find("init: loaded all 22 tensors of " + (step2 / "model.pt").string()) != std::string::npos);
    fs::remove(step2 / "model-share-1.pt");
    auto gap = tk_run(root / "gap", deep, "--set run.steps=1 --set model.init='\"" + (step2 / "model.pt").string() + "\"'");
    CHECK(gap.rc == 2);
    CHECK(gap.out.find((step2 / "model-share-1.pt").string() + " is missing: " + (step2 / "run.json").string() +
                       " says 2 ranks wrote a share of the parameters beside model.pt") != std::string::npos);
    // Experts the ranks do not all use in a window, inside the model's one block.
    zero_equals_ddp(root / "experts", experts_recipe(true), kAccumulate2, 2, "", kStage3, 1e-12);
    fs::remove_all(root);
  }

  TEST_CASE("SGD with momentum on 3 ranks: samples normalization, a short last window, and a ramp") {
    const fs::path root = tkt::temp_dir("zero-sgd");
    // 256 examples: 85 per rank, 22 micro-batches of 4 per epoch -> windows of 4 and a last one of 2.
    const std::string samples =
        "[[plugins]]\nname = \"grad_accum\"\nsteps = 4\nnormalize = \"samples\"\n";
    zero_equals_ddp(root, base_with(nullptr), samples, 3,
                    "--set run.steps=0 --set run.epochs=1 --set loss.reduction=sum");
    CHECK(tkt::metric(root / "zero/out/metrics.jsonl", "micro_batches").back() == 6);  // 3 ranks x 2
    const std::string ramp = "[[plugins]]\nname = \"grad_accum\"\neffective_batch = 48\nramp_from = 12\nramp_steps = 3\n";
    zero_equals_ddp(root / "ramp", base_with(kAdamW), ramp, 3);
    const auto k = tkt::metric(root / "ramp/zero/out/metrics.jsonl", "micro_batches");
    CHECK(k.front() < k.back());
    // Stage 2: the short window's and the ramp's gradients summed onto their owners.
    zero_equals_ddp(root / "2", base_with(nullptr), samples, 3, "--set run.steps=0 --set run.epochs=1 --set loss.reduction=sum",
                    kStage2, 1e-12);
    zero_equals_ddp(root / "2-ramp", base_with(kAdamW), ramp, 3, "", kStage2, 1e-12);
    fs::remove_all(root);
  }

  TEST_CASE("tokens normalization with uneven token counts, and bf16 with the dynamic loss scaler and an overflow") {
    const fs::path root = tkt::temp_dir("zero-tokens");
    std::string tokens = base_with(kAdamW);
    tokens.replace(tokens.find("classes = 4"), 11, "classes = 4\nseq_len = 10\nmin_len = 1");
    zero_equals_ddp(root, tokens, "[[plugins]]\nname = \"grad_accum\"\nsteps = 4\nnormalize = \"tokens\"\n", 2,
                    "--set data.name=synthetic-tokens --set data.samples=112 --set run.steps=0 --set run.epochs=2 "
                    "--set loss.reduction=sum");
    // An overflow on rank 1 only, at step 2: both ranks skip it, with one decision.
    const std::string amp =
        "[[plugins]]\nname = \"clip\"\nmax_norm = 0.5\n"
        "[[plugins]]\nname = \"mixed_precision\"\ndtype = \"bf16\"\nloss_scale = \"dynamic\"\ninit_scale = 256.0\n"
        "[[plugins]]\nname = \"grad_accum\"\nsteps = 2\n"
        "[[plugins]]\nname = \"probe\"\ninf_grad_at_step = 2\nonly_rank = 1\n";
    zero_equals_ddp(root / "amp", base_with(kAdamW), amp, 2, "--set run.dtype=float32");
    CHECK(tkt::skipped(root / "amp/zero/out/metrics.jsonl") == std::vector<bool>{false, false, true, false, false, false});
    CHECK(tkt::metric(root / "amp/zero/out/metrics.jsonl", "loss_scale") ==
          std::vector<double>{256, 256, 256, 128, 128, 128});
    // Stage 2: rank 1's overflow is in a gradient rank 0 may not hold; the ranks decide together.
    // The tokens case in float64; the amp case in float32, to its precision.
    zero_equals_ddp(root / "2", tokens, "[[plugins]]\nname = \"grad_accum\"\nsteps = 4\nnormalize = \"tokens\"\n", 2,
                    "--set data.name=synthetic-tokens --set data.samples=112 --set run.steps=0 --set run.epochs=2 "
                    "--set loss.reduction=sum", kStage2, 1e-12);
    for (const char* shard : {kStage2, kStage2Window, kStage3}) {
      CAPTURE(shard);
      const fs::path dir = root / (std::string(shard) == kStage3 ? "amp-3" : std::string(shard).size() > 10 ? "amp-window" : "amp-micro");
      // The overflow looked for after every backward too: the same decisions (sharded, at the last backward).
      zero_equals_ddp(dir, base_with(kAdamW), amp, 2,
                      "--set run.dtype=float32 --set plugins.mixed_precision.check_every_micro_batch=true", shard, 1e-5);
      CHECK(tkt::skipped(dir / "zero/out/metrics.jsonl") == std::vector<bool>{false, false, true, false, false, false});
    }
    // Stage 3 gathering in bf16 under autocast to bf16: autocast reads the MLP's parameters (Linear
    // layers') in bf16 either way, so the steps are ddp's.
    const std::string narrow = std::string(kStage3) + "gather_dtype = \"bf16\"\n";
    auto halved = zero_equals_ddp(root / "amp-3-bf16", base_with(kAdamW), amp, 2,
                                  "--set run.dtype=float32 --set plugins.mixed_precision.check_every_micro_batch=true",
                                  narrow, 1e-5);
    CHECK(halved.out.find("parameters gathered in bf16 for the model's block in forward and backward") != std::string::npos);
    // Without autocast the rounding shows, the same on every rank: the first step's loss (float64)
    // is that of one process started from the weights rounded to bf16, not from the weights.
    const std::string accumulate = base_with(kAdamW) + "[[plugins]]\nname = \"grad_accum\"\n";
    const std::string sharded = accumulate + "[[plugins]]\nname = \"ddp\"\n[[plugins]]\nname = \"shard\"\n" + kStage3;
    REQUIRE(tk_run(root / "start", base_with(kAdamW), "--set run.steps=1").rc == 0);
    tk::NamedTensors rounded;
    for (const auto& [name, t] : tk::load_tensor_dict(root / "start/out/weights.pt"))
      rounded.emplace_back(name, t.to(at::kBFloat16).to(t.scalar_type()));
    tk::save_tensor_dict(root / "rounded.pt", rounded);
    const auto init = [&](const fs::path& file) {
      return "--set batch.effective_batch=8 --set run.steps=2 --set model.init='\"" + file.string() + "\"' ";
    };
    auto bf16 = tk_run(root / "narrow", sharded + "gather_dtype = \"bf16\"\n", "--nproc 2 " + init(root / "start/out/weights.pt"));
    INFO(bf16.out);
    REQUIRE(bf16.rc == 0);
    REQUIRE(tk_run(root / "exact", sharded, "--nproc 2 " + init(root / "start/out/weights.pt")).rc == 0);
    REQUIRE(tk_run(root / "from-rounded", accumulate, init(root / "rounded.pt")).rc == 0);
    const auto first_loss = [&](const char* run) { return tkt::metric(root / run / "out/metrics.jsonl", "loss").front(); };
    CHECK(std::abs(first_loss("narrow") - first_loss("from-rounded")) <= 1e-12 * first_loss("from-rounded"));
    CHECK(std::abs(first_loss("narrow") - first_loss("exact")) > 1e-6 * first_loss("exact"));
    // A weight that fp16 cannot hold is refused at its gather, named, not trained on as infinite.
    rounded.front().second.view({-1})[0] = 1e5;
    tk::save_tensor_dict(root / "large.pt", rounded);
    auto large = tk_run(root / "large", sharded + "gather_dtype = \"fp16\"\n", "--nproc 2 " + init(root / "large.pt"));
    CHECK(large.rc != 0);
    CHECK(large.out.find("stage 3: parameter '" + rounded.front().first + "' does not fit gather_dtype \"fp16\": its "
                         "largest magnitude, 100000.000000, rounds to infinity") != std::string::npos);
    // A quarter of float64's bytes gathered, every step.
    const auto bytes = tkt::metric(root / "narrow/out/metrics.jsonl", "shard_param_gather_mib");
    const auto whole = tkt::metric(root / "exact/out/metrics.jsonl", "shard_param_gather_mib");
    REQUIRE(bytes.size() == 2);
    REQUIRE(whole.size() == 2);
    for (size_t i = 0; i < bytes.size(); ++i) CHECK(bytes[i] * 4 == doctest::Approx(whole[i]).epsilon(1e-12));
    // The owners step their own values: the weights are not bf16's.
    const auto final_weights = weights(root / "narrow");
    CHECK_FALSE(torch::equal(final_weights, final_weights.to(at::kBFloat16).to(final_weights.scalar_type())));
    fs::remove_all(root);
  }

  TEST_CASE("out of time, every rank stops at the same boundary - the resumed run ends bit-identical") {
    const fs::path root = tkt::temp_dir("zero-max-time");
    const std::string recipe = base_with(kAdamW) + "[[plugins]]\nname = \"grad_accum\"\nsteps = 2\n"
                               "[[plugins]]\nname = \"ddp\"\n[[plugins]]\nname = \"shard\"\nstage = 1\n[world]\ntimeout_s = 20.0\n";
    const std::string sets = "--nproc 2 --set run.steps=400 ";
    auto whole = tk_run(root / "whole", recipe, sets);
    REQUIRE(whole.rc == 0);
    // The ranks' clocks started apart: alone, one would stop a step before the other and leave it
    // waiting in a collective. They agree on each boundary.
    auto stopped = tk_run(root / "stopped", recipe, sets + "--set run.max_time=\\\"0.5s\\\"");
    INFO(stopped.out);
    REQUIRE(stopped.rc == 0);
    const auto at = [&](const std::string& rank) {
      const std::string said = "[rank " + rank + "] stopped early (max_time) after step ";
      const auto pos = stopped.out.find(said);
      REQUIRE(pos != std::string::npos);
      return std::stoll(stopped.out.substr(pos + said.size()));
    };
    const long long step = at("0");
    CHECK(step == at("1"));
    CHECK(step < 400);
    CHECK(stopped.out.find("[rank 1] stopped early (max_time) after step " + std::to_string(step) + "; continue") !=
          std::string::npos);
    auto resumed = tk_run(root / "stopped", recipe, sets + "--resume latest");
    INFO(resumed.out);
    REQUIRE(resumed.rc == 0);
    CHECK(torch::equal(weights(root / "stopped"), weights(root / "whole")));
    fs::remove_all(root);
  }

  TEST_CASE("killed while the ranks write their shares of a checkpoint: that checkpoint is absent, the one before resumes bit-identical") {
    const fs::path root = tkt::temp_dir("zero-share-killed");
    const std::string recipe = base_with(kAdamW) + kAccumulate2 + "[[plugins]]\nname = \"ddp\"\n[[plugins]]\nname = \"shard\"\nstage = 2\n";
    const std::string sets = "--nproc 2 --set run.steps=12 --set run.checkpoint_every=4 ";
    auto whole = tk_run(root / "whole", recipe, sets);
    INFO(whole.out);
    REQUIRE(whole.rc == 0);
    // Every rank kills itself once its share of the second checkpoint (step 8) is written.
    auto killed = tk_run(root / "killed", recipe, sets, "TK_FAULT=checkpoint-share:2");
    INFO(killed.out);
    REQUIRE(killed.rc != 0);
    const fs::path checkpoints = root / "killed/out/checkpoints";
    CHECK(fs::is_regular_file(checkpoints / "step-00000004/optimizer-share-1.pt"));
    CHECK_FALSE(fs::exists(checkpoints / "step-00000008"));
    auto resumed = tk_run(root / "killed", recipe, sets + "--resume latest");
    INFO(resumed.out);
    REQUIRE(resumed.rc == 0);
    CHECK(resumed.out.find("step-00000004 at step 4") != std::string::npos);
    CHECK(torch::equal(weights(root / "killed"), weights(root / "whole")));
    CHECK(tkt::metric(root / "killed/out/metrics.jsonl", "loss") == tkt::metric(root / "whole/out/metrics.jsonl", "loss"));
    // A share missing, or damaged: refused, naming the file.
    const fs::path step4 = root / "whole/out/checkpoints/step-00000004";
    const std::string from = "--resume " + step4.string();
    fs::rename(step4 / "optimizer-share-1.pt", root / "share-1.pt");
    auto missing = tk_run(root / "missing", recipe, sets + from);
    INFO(missing.out);
    CHECK(missing.rc == 2);
    CHECK(missing.out.find((step4 / "optimizer-share-1.pt").string() + ": missing; the checkpoint holds 2 shares of the "
                           "optimizer state, 0 to 1") != std::string::npos);
    // Damaged: refused naming the file (in one process, which reads both shares).
    std::ofstream(step4 / "optimizer-share-1.pt") << "not an archive";
    auto damaged = tk_run(root / "damaged", recipe, "--set run.steps=12 --set run.checkpoint_every=4 " + from);
    INFO(damaged.out);
    CHECK(damaged.rc == 2);
    CHECK(damaged.out.find((step4 / "optimizer-share-1.pt").string() + ": damaged, or saved for another optimizer") !=
          std::string::npos);
    // On 2 ranks rank 1 reads it: the launch names rank 1, whose peer fails only on losing it.
    for (int attempt = 0; attempt < 3; ++attempt) {
      auto two = tk_run(root / ("damaged-2-" + std::to_string(attempt)), recipe, sets + from);
      INFO(two.out);
      CHECK(two.rc == 2);
      CHECK(two.out.find("tk-run: rank 1 failed") != std::string::npos);
      CHECK(two.out.find("tk-run: rank 0 failed") == std::string::npos);
    }
    // What a start killed while its ranks looked for each other's files leaves is the run's own:
    // a new start over it deletes it.
    std::ofstream(root / "killed/out/checkpoints/.rank-1-4242") << "";
    std::ofstream(root / "killed/out/checkpoints/.rank-0-4242.tmp") << "";
    auto again = tk_run(root / "killed", recipe, sets + "--overwrite");
    INFO(again.out);
    CHECK(again.rc == 0);
    CHECK_FALSE(fs::exists(root / "killed/out/checkpoints/.rank-1-4242"));
    fs::remove_all(root);
  }

  TEST_CASE("a resume re-shards exactly: 2 sharded ranks -> 4, and an unsharded checkpoint -> sharded (with and without the plugin)") {
    // 256 examples, 16 per step on 2 ranks (4 x 2) and on 4 (4 x 1): step 16 ends epoch 1, where a
    // resume on another world starts epoch 2 from its beginning.
    const fs::path root = tkt::temp_dir("zero-reshard");
    const std::string recipe = base_with(kAdamW) + "[[plugins]]\nname = \"grad_accum\"\nsteps = 2\n"
                               "[[plugins]]\nname = \"ddp\"\ncheck_every = 1\n[[plugins]]\nname = \"shard\"\n";
    const std::string sets = "--set run.steps=20 --set run.checkpoint_every=16 ";
    auto sharded = tk_run(root / "sharded", recipe, "--nproc 2 --set plugins.shard.stage=1 " + sets);
    REQUIRE(sharded.rc == 0);
    auto whole = tk_run(root / "whole", recipe, "--nproc 2 " + sets);
    REQUIRE(whole.rc == 0);
    CHECK(torch::equal(weights(root / "sharded"), weights(root / "whole")));
    const std::string four = "--nproc 4 --set plugins.grad_accum.steps=1 --allow-change world_size "
                             "--allow-change plugins.grad_accum.steps --allow-change plugins.shard.stage " + sets;
    auto resume = [&](const char* from, const char* to, int stage) {
      auto p = tk_run(root / to, recipe,
                      four + "--set plugins.shard.stage=" + std::to_string(stage) + " --resume " +
                          (root / from / "out/checkpoints/step-00000016").string());
      INFO(p.out);
      REQUIRE(p.rc == 0);
      CHECK(p.out.find("resuming from") != std::string::npos);
    };
    resume("sharded", "sharded-4", 1);  // the two shards re-cut into four
    resume("whole", "whole-4", 1);      // the whole optimizer cut into four
    resume("whole", "plain-4", 0);      // the reference: LibTorch's own load, unsharded
    CHECK(torch::equal(weights(root / "sharded-4"), weights(root / "plain-4")));
    CHECK(torch::equal(weights(root / "whole-4"), weights(root / "plain-4")));
    // Stage 1's checkpoint goes on at stage 2 (the same files): the gradients summed onto their owners.
    resume("sharded", "stage2-4", 2);
    CHECK((weights(root / "stage2-4") - weights(root / "plain-4")).abs().max().item<double>() <= 1e-12);
    // A sharded checkpoint that LibTorch's own optimizer cannot read: the change let through is named.
    auto unsharded = tk_run(root / "unsharded", recipe,
                            "--nproc 2 --set plugins.shard.stage=0 --allow-change plugins.shard.stage " + sets +
                                "--resume " + (root / "sharded/out/checkpoints/step-00000016").string());
    INFO(unsharded.out);
    CHECK(unsharded.rc == 2);
    CHECK(unsharded.out.find("optimizer.pt: the optimizer state was saved in 2 shares (optimizer-share-<rank>.pt), "
                             "one per rank of an optimizer sharded over the ranks; this run's optimizer is not "
                             "sharded") != std::string::npos);
    CHECK(unsharded.out.find("  plugins.shard.stage: 1 -> 0") != std::string::npos);
    // A dry run refuses it alike, by the files (nothing loaded).
    auto unsharded_dry = tk_run(root / "unsharded", recipe,
                                "--nproc 2 --set plugins.shard.stage=0 --allow-change plugins.shard.stage " + sets +
                                    "--dry-run --resume " + (root / "sharded/out/checkpoints/step-00000016").string());
    INFO(unsharded_dry.out);
    CHECK(unsharded_dry.rc == 2);
    CHECK(unsharded_dry.out.find("optimizer.pt: the optimizer state was saved in 2 shares") != std::string::npos);
    // A checkpoint of a run without the shard plugin goes on sharded once the plugin list may change:
    // the plugin's options come with it (no "newer options" warning), and stage 1 steps as ddp did.
    const std::string plain_recipe = recipe.substr(0, recipe.rfind("[[plugins]]\nname = \"shard\"\n"));
    REQUIRE(tk_run(root / "without", plain_recipe, "--nproc 2 " + sets).rc == 0);
    const std::string from_without = "--nproc 2 --set plugins.shard.stage=1 " + sets + "--resume " +
                                     (root / "without/out/checkpoints/step-00000016").string();
    auto refused = tk_run(root / "added-refused", recipe, from_without);
    CHECK(refused.rc == 2);
    CHECK(refused.out.find("  plugins: \"grad_accum, ddp\" -> \"grad_accum, ddp, shard\"") != std::string::npos);
    auto added = tk_run(root / "added", recipe, from_without + " --allow-change plugins");
    INFO(added.out);
    REQUIRE(added.rc == 0);
    CHECK(added.out.find("does not record these options") == std::string::npos);
    CHECK(torch::equal(weights(root / "added"), weights(root / "whole")));
    fs::remove_all(root);
  }

  /// The number after `prefix` in `text` (a figure of a log line), or -1.
  double figure_after(const std::string& text, const std::string& prefix) {
    const size_t at = text.find(prefix);
    return at == std::string::npos ? -1.0 : std::stod(text.substr(at + prefix.size()));
  }

  TEST_CASE("a memory budget smaller than the unsharded training state: trained at stage 3 on 2 ranks, refused without it naming the stage that fits") {
    const fs::path root = tkt::temp_dir("zero-budget");
    // 8 blocks of 256 x 256 in float64 with AdamW: 3.5 MiB of parameters, 14 MiB of training state,
    // little beside it at a micro-batch of 1.
    std::string recipe = base_with(kAdamW);
    recipe.replace(recipe.find("hidden = [16]"), 13, "hidden = [256, 256, 256, 256, 256, 256, 256, 256]");
    const std::string ddp = recipe + "[[plugins]]\nname = \"ddp\"\n", stage3 = ddp + "[[plugins]]\nname = \"shard\"\nstage = 3\n";
    const std::string sets = "--nproc 2 --set run.steps=3 --set batch.micro_batch='\"auto\"' --set batch.effective_batch=2 ";
    auto budget = [](double bytes) { return "--set batch.memory_budget='\"" + std::to_string(static_cast<int64_t>(bytes)) + "B\"' "; };
    constexpr double kMiB = 1024.0 * 1024.0;
    // What a step at stage 3 takes, measured by the planner given room.
    auto roomy = tk_run(root / "roomy", stage3, sets + budget(1e9));
    INFO(roomy.out);
    REQUIRE(roomy.rc == 0);
    const double peak = figure_after(roomy.out, "a step's peak ") * kMiB;
    REQUIRE(peak > 0);
    // Without sharding, given too little: the step each stage would take, from ddp's measured one.
    auto probe = tk_run(root / "probe", ddp, sets + budget(kMiB));
    REQUIRE(probe.rc == 2);
    const double at2 = figure_after(probe.out, "MiB at stage 1, ") * kMiB, at3 = figure_after(probe.out, "MiB at stage 2 and ") * kMiB;
    REQUIRE(at2 > std::max(at3, peak));
    // A budget between the larger of stage 3's estimate and its measurement, and stage 2's
    // estimate (the planner keeps a 10% margin).
    const double limit = 1.1 * (std::max(at3, peak) + at2) / 2;
    auto refused = tk_run(root / "ddp", ddp, sets + budget(limit));
    INFO(refused.out);
    CHECK(refused.rc == 2);
    CHECK(refused.out.find("batch.memory_budget: a training step of one micro-batch of 1 takes") != std::string::npos);
    CHECK(refused.out.find("this step is at ZeRO stage 0. Over its 2 ranks, with the optimizer state sharded from stage 1, "
                           "the gradients from 2 and the parameters from 3, the step would take about") != std::string::npos);
    CHECK(refused.out.find(": by these figures stage 3 would fit (set by a plugin that provides optimizer.sharded") != std::string::npos);
    const double state = figure_after(refused.out, "the training state is ") * kMiB;
    CHECK(state > limit);
    CHECK(refused.out.find("step 1/") == std::string::npos);
    // The stage named, in the same budget: it trains, holding its own parameters between steps.
    auto trained = tk_run(root / "stage3", stage3, sets + budget(limit));
    INFO(trained.out);
    REQUIRE(trained.rc == 0);
    const auto held = tkt::metric(root / "stage3/out/metrics.jsonl", "param_mib");
    REQUIRE(held.size() == 3);
    CHECK(held.back() * kMiB < state / 4 * 0.6);
    // The trials left nothing behind: the steps of the micro-batch picked, set by hand.
    auto by_hand = tk_run(root / "by-hand", stage3, "--nproc 2 --set run.steps=3 --set batch.micro_batch=1 --set batch.effective_batch=2");
    REQUIRE(by_hand.rc == 0);
    CHECK(torch::equal(weights(root / "stage3"), weights(root / "by-hand")));
    fs::remove_all(root);
  }

  TEST_CASE("bad input: a stage other than 0 to 3, a stage without data parallel, more ranks than tensors, ranks whose models differ") {
    const fs::path root = tkt::temp_dir("zero-bad");
    auto stage = tk_run(root / "stage", base_with(kAdamW) + "[[plugins]]\nname = \"shard\"\nstage = 4\n", "");
    CHECK(stage.rc != 0);
    CHECK(stage.out.find("plugins.shard.stage: must be 0, 1, 2 or 3") != std::string::npos);
    CHECK(stage.out.find("recipe.toml:") != std::string::npos);
    // A stage shards across the world that a data-parallel plugin syncs: refused without one, even alone.
    auto alone = tk_run(root / "alone", base_with(kAdamW) + "[[plugins]]\nname = \"shard\"\nstage = 2\n", "");
    CHECK(alone.rc == 2);
    // At the shard plugin's entry in the recipe.
    CHECK(alone.out.find("recipe.toml:") != std::string::npos);
    CHECK(alone.out.find(": plugin 'shard' requires 'grads.synced', which no plugin in this run provides") != std::string::npos);
    // reduce applies to stages 2 and 3 alone, prefetch to 3: said once, not refused.
    auto ignored = tk_run(root / "ignored", base_with(kAdamW) + "[[plugins]]\nname = \"ddp\"\n[[plugins]]\nname = \"shard\"\n"
                                                                "stage = 1\nreduce = \"window\"\nprefetch = false\n", "");
    CHECK(ignored.rc == 0);
    CHECK(ignored.out.find("reduce = \"window\" is ignored: only stages 2 and 3 sum the gradients themselves (stage is 1)") !=
          std::string::npos);
    CHECK(ignored.out.find("prefetch is ignored: only stage 3 gathers parameters (stage is 1)") != std::string::npos);
    // At the line that sets it; a dry run says it too.
    CHECK(std::regex_search(ignored.out, std::regex("recipe\\.toml:[0-9]+(:[0-9]+)?: prefetch is ignored")));
    auto dry = tk_run(root / "ignored-dry", base_with(kAdamW) + "[[plugins]]\nname = \"ddp\"\n[[plugins]]\nname = \"shard\"\n"
                                                              "stage = 1\ngather_dtype = \"bf16\"\n", "--dry-run");
    CHECK(dry.rc == 0);
    CHECK(std::regex_search(dry.out, std::regex("recipe\\.toml:[0-9]+(:[0-9]+)?: gather_dtype is ignored: only stage 3 "
                                                "gathers parameters \\(stage is 1\\)")));
    auto early = tk_run(root / "early", base_with(kAdamW) + "[[plugins]]\nname = \"ddp\"\n[[plugins]]\nname = \"shard\"\n"
                                                            "stage = 2\nprefetch = false\n", "");
    CHECK(early.rc == 0);
    CHECK(early.out.find("prefetch is ignored: only stage 3 gathers parameters (stage is 2)") != std::string::npos);
    // ddp's zero_stage of earlier versions: refused, saying where the setting went.
    auto moved = tk_run(root / "moved", base_with(kAdamW) + "[[plugins]]\nname = \"ddp\"\nzero_stage = 1\n", "");
    CHECK(moved.rc == 2);
    CHECK(moved.out.find("plugins.ddp.zero_stage: the sharded optimizer is its own plugin now: write [[plugins]] name = "
                         "\"shard\" with stage = 1 instead") != std::string::npos);
    // An MLP without hidden layers has 2 tensors: 3 ranks cannot each update whole ones (refused at
    // the recipe's line that sets the stage).
    std::string flat = base_with(kAdamW);
    flat.replace(flat.find("hidden = [16]"), 13, "hidden = []");
    auto many = tk_run(root / "many", flat + "[[plugins]]\nname = \"ddp\"\n[[plugins]]\nname = \"shard\"\nstage = 1\n[world]\ntimeout_s = 20.0\n", "--nproc 3");
    CHECK(many.rc != 0);
    CHECK(many.out.find(".toml:" + std::to_string(std::count(flat.begin(), flat.end(), '\n') + 5) +
                        ":9: plugins.shard.stage: stage 1 shards whole tensors: the model has 2 trainable tensors for 3 "
                        "ranks; use fewer ranks or stage = 0") != std::string::npos);
    // Each rank refuses alike: the refusal forwarded once, by the first rank to print it (the others
    // say theirs is the same, or were stopped before they printed), and in the launcher's account.
    size_t forwarded = 0, printed = 0;
    for (size_t at = many.out.find(":9: plugins.shard.stage: stage 1 shards"); at != std::string::npos;
         at = many.out.find(":9: plugins.shard.stage: stage 1 shards", at + 1)) {
      ++printed;
      const size_t line = many.out.rfind('\n', at) + 1;  // npos + 1 == 0 on the first line
      forwarded += many.out.compare(line, 6, "[rank ") == 0;
    }
    CHECK(printed >= 1);
    CHECK(forwarded <= 1);
    CHECK(many.out.find("step 1/") == std::string::npos);
    auto differ = tk_run(root / "differ",
                         experts_recipe(false) + "[[plugins]]\nname = \"ddp\"\n[[plugins]]\nname = \"shard\"\nstage = 2\n[world]\ntimeout_s = 20.0\n",
                         "--nproc 2 --set model.experts_on_rank1=3");
    CHECK(differ.rc == 1);
    CHECK(differ.out.find("the model on rank 1 differs from rank 0's: 14 parameters and 0 buffers here, 18 and 0 on "
                          "rank 0") != std::string::npos);
    CHECK(differ.out.find("step 1/") == std::string::npos);
    fs::remove_all(root);
  }
}

TEST_SUITE("recompute") {
  TEST_CASE("micro_batch = \"auto\" with recomputation picked by memory at stage 3 on 2 ranks: the steps of the settings picked, set by hand") {
    const fs::path root = tkt::temp_dir("recompute-stage3");
    std::string base = gpt_recipe(root);
    base.replace(base.find("micro_batch = 2\n"), 16, "");
    base.replace(base.find("steps = 2\n"), 10, "");
    const std::string plugins = "[[plugins]]\nname = \"ddp\"\n[[plugins]]\nname = \"shard\"\nstage = 3\n";
    const std::string sets = "--nproc 2 --set run.steps=3 --set batch.micro_batch='\"auto\"' --set batch.effective_batch=16 ";
    auto budget = [](double bytes) { return "--set batch.memory_budget='\"" + std::to_string(static_cast<int64_t>(bytes)) + "B\"' "; };
    const std::string automatic = base + plugins + "[[plugins]]\nname = \"recompute\"\nmodules = \"auto\"\n";
    // Given room, the largest micro-batch (8 a rank) without recomputation; its step measured.
    auto roomy = tk_run(root / "roomy", automatic, sets + budget(1e9));
    INFO(roomy.out);
    REQUIRE(roomy.rc == 0);
    REQUIRE(roomy.out.find("micro-batch 8 picked by memory with 0 of 3 recomputed blocks") != std::string::npos);
    const double peak = std::stod(roomy.out.substr(roomy.out.find("a step's peak ") + 14)) * 1024 * 1024;
    // Less than that step with its margin: the planner recomputes blocks of the stage-3 step.
    auto picked = tk_run(root / "picked", automatic, sets + budget(peak * 1.1 * 0.9));
    INFO(picked.out);
    REQUIRE(picked.rc == 0);
    const size_t at = picked.out.find("recompute: recomputing ");
    REQUIRE(at != std::string::npos);
    const int blocks = std::stoi(picked.out.substr(at + 23));
    CHECK(blocks >= 1);
    const size_t m_at = picked.out.find("] micro-batch ", picked.out.find("picked by memory") - 40);
    const int m = std::stoi(picked.out.substr(m_at + 14));
    std::string modules;
    for (int b = 0; b < blocks; ++b) modules += (b ? ", " : "") + std::string("\"blocks.") + std::to_string(b) + "\"";
    CHECK(picked.out.find("recomputing " + std::to_string(blocks) + " of 3 blocks (blocks.0") != std::string::npos);
    // A dry run plans rank 0 alone: its trial steps gather the other rank's parameters as zeros, and
    // measure a stage-3 step (it crashed computing with parameters it could not gather).
    auto dry = tk_run(root / "dry", automatic, sets + budget(peak * 1.1 * 0.9) + "--dry-run");
    INFO(dry.out);
    CHECK(dry.rc == 0);
    CHECK(dry.out.find("picked by memory with ") != std::string::npos);
    // A trial step that fails leaves the parameters of other ranks freed: restored, the error is
    // reported (it crashed restoring them).
    auto failed = tk_run(root / "failed", automatic + "[[plugins]]\nname = \"probe\"\nthrow_at_step = 0\n", sets + budget(1e9));
    CHECK(failed.rc != 0);
    INFO(failed.out);
    CHECK(failed.out.find("tk_probe.so) failed in event backward in a trial step before training, micro-batch 1 of ") !=
          std::string::npos);
    // No rank crashed. (Both ranks refuse: the one that recorded it first may be stopped by the
    // launcher, SIGTERM, on its way out once the other has exited; that is no crash.)
    for (const char* crash : {"signal 11 (", "signal 6 (", "signal 7 (", "signal 4 (", "signal 8 ("})
      CHECK(failed.out.find(crash) == std::string::npos);
    auto by_hand = tk_run(root / "by-hand", base + plugins + "[[plugins]]\nname = \"recompute\"\nmodules = [" + modules + "]\n",
                          "--nproc 2 --set run.steps=3 --set batch.micro_batch=" + std::to_string(m) + " --set batch.effective_batch=16");
    INFO(by_hand.out);
    REQUIRE(by_hand.rc == 0);
    CHECK(torch::equal(weights(root / "picked"), weights(root / "by-hand")));
    CHECK(tkt::metric(root / "picked/out/metrics.jsonl", "loss") == tkt::metric(root / "by-hand/out/metrics.jsonl", "loss"));
    fs::remove_all(root);
  }

  TEST_CASE("2 DDP ranks with recomputation take the steps of 2 ranks without it, bit for bit (search on, off, ZeRO-1, ZeRO-2, ZeRO-3)") {
    const fs::path root = tkt::temp_dir("recompute-ddp");
    const std::string base = gpt_recipe(root);
    for (const std::string ddp : {"", "find_unused_parameters = false\n", "[[plugins]]\nname = \"shard\"\nstage = 1\n",
                                  "[[plugins]]\nname = \"shard\"\nstage = 2\n", "[[plugins]]\nname = \"shard\"\nstage = 3\n"}) {
      CAPTURE(ddp);
      const std::string with_ddp = base + "[[plugins]]\nname = \"ddp\"\n" + ddp;
      auto plain = tk_run(root / "plain", with_ddp, "--nproc 2 --overwrite");
      INFO(plain.out);
      REQUIRE(plain.rc == 0);
      auto with = tk_run(root / "with", with_ddp + "[[plugins]]\nname = \"recompute\"\nevery = 2\n", "--nproc 2 --overwrite");
      INFO(with.out);
      REQUIRE(with.rc == 0);
      CHECK(with.out.find("recomputing 2 of 3 blocks (blocks.0, blocks.2)") != std::string::npos);
      CHECK(torch::equal(weights(root / "with"), weights(root / "plain")));
      CHECK(tkt::metric(root / "with/out/metrics.jsonl", "loss") == tkt::metric(root / "plain/out/metrics.jsonl", "loss"));
      // Every parameter got its gradient once, in every window: none was left for the search.
      for (double unused : tkt::metric(root / "with/out/metrics.jsonl", "ddp_unused"))
        if (!std::isnan(unused)) CHECK(unused == 0);
    }
    fs::remove_all(root);
  }

}

TEST_SUITE("resume") {
  TEST_CASE("SIGTERM stops at the next boundary with a checkpoint and a non-zero exit - resuming completes the run") {
    const fs::path root = tkt::temp_dir("resume-term");
    const std::string sets = "--set run.steps=20000 --set run.checkpoint_every=0 ";
    auto one = tk_run(root / "one", kBase, sets);
    REQUIRE(one.rc == 0);
    fs::create_directories(root / "two");
    std::ofstream(root / "two/recipe.toml") << kBase;
    // Start, wait (bounded) until training has begun, send SIGTERM, wait for the exit code.
    const std::string cmd = std::string(TK_RUN_EXE) + " " + (root / "two/recipe.toml").string() +
                            " --progress none " + sets + "--set run.output=\\\"" + (root / "two/out").string() +
                            "\\\" > " + (root / "two/log").string() + " 2>&1 & pid=$!; i=0; while [ ! -s " +
                            (root / "two/out/metrics.jsonl").string() +
                            " ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done; kill -TERM $pid; wait $pid; exit $?";
    int status = std::system(("sh -c '" + cmd + "'").c_str());
    CHECK(WEXITSTATUS(status) == 128 + 15);
    std::ifstream log(root / "two/log");
    std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
    INFO(text);
    CHECK(text.find("stopped early (signal)") != std::string::npos);
    auto resumed = tk_run(root / "two", kBase, sets + "--resume latest");
    REQUIRE(resumed.rc == 0);
    CHECK(torch::equal(weights(root / "two"), weights(root / "one")));
    fs::remove_all(root);
  }
}

/// "Killed and resumed equals uninterrupted": the case's recipe (made for its folder ROOT) with
/// `sets`, run whole and killed right after the record of step 9 then resumed (kill_and_resume:
/// the weights and every step's loss are bit-identical); the killed launch exits with `killed_rc`
/// (137: a process killed by SIGKILL; 1: a launcher whose rank 0 was); `then` checks what the case
/// adds, given the killed run.
struct KilledAndResumed {
  const char* name;
  std::string (*recipe)(const fs::path& root);
  const char* sets;
  int killed_rc;
  void (*then)(const fs::path& root, const Proc& killed);
};

void killed_and_resumed(const KilledAndResumed& c) {
  const fs::path root = tkt::temp_dir("killed-resumed");
  const Proc killed = kill_and_resume(root, c.recipe(root), c.sets);
  CHECK(killed.rc == c.killed_rc);
  if (c.then) c.then(root, killed);
  fs::remove_all(root);
}

std::string experts_ddp(const fs::path&) {
  return experts_recipe(false) + "[[plugins]]\nname = \"ddp\"\n" + kAccumulate2;
}
std::string shards_ddp(const fs::path& root) { return shards_recipe(root) + "[[plugins]]\nname = \"ddp\"\n" + kAccumulate2; }
std::string adamw_sharded(const fs::path&) {
  return base_with(kAdamW) + kAccumulate2 + "[[plugins]]\nname = \"ddp\"\n[[plugins]]\nname = \"shard\"\nstage = 1\n";
}
std::string gpt_recomputed(const fs::path& root) { return gpt_recipe(root) + "[[plugins]]\nname = \"recompute\"\n"; }
std::string base_accumulated(const fs::path&) {
  return std::string(kBase) + "[[plugins]]\nname = \"grad_accum\"\nsteps = 3\n";
}

/// The world stopped with rank 0, which the launcher names; the resumed run synced as often.
void then_rank0_named(const fs::path& root, const Proc& killed) {
  CHECK(killed.out.find("tk-run: rank 0 failed (was killed by signal 9") != std::string::npos);
  CHECK(tkt::metric(root / "two/out/metrics.jsonl", "ddp_syncs") == tkt::metric(root / "one/out/metrics.jsonl", "ddp_syncs"));
}

/// The checkpoint holds every rank's share of the sharded optimizer state, each in its own file
/// (each rank wrote its own), and optimizer.pt only their count.
void then_every_share_saved(const fs::path& root, const Proc&) {
  const fs::path dir = root / "two/out/checkpoints/step-00000008";
  torch::serialize::InputArchive archive;
  archive.load_from((dir / "optimizer.pt").string());
  at::Tensor count, world, owners, unexpected;
  REQUIRE(archive.try_read("tk_optimizer_shares", count, /*is_buffer=*/true));
  CHECK(count.item<int64_t>() == 2);
  REQUIRE(archive.try_read("zero_world_size", world, /*is_buffer=*/true));
  CHECK(world.item<int64_t>() == 2);
  REQUIRE(archive.try_read("zero_owners", owners, /*is_buffer=*/true));
  CHECK(owners.min().item<int64_t>() == 0);  // both ranks own a part
  CHECK(owners.max().item<int64_t>() == 1);
  CHECK_FALSE(archive.try_read("zero_shard_0", unexpected, /*is_buffer=*/true));  // no rank gathered the others' shares
  for (const char* file : {"optimizer-share-0.pt", "optimizer-share-1.pt"}) {
    CAPTURE(file);
    torch::serialize::InputArchive share, groups;
    share.load_from((dir / file).string());
    CHECK(share.try_read("param_groups", groups));  // the recipe's AdamW over this rank's share
  }
}

/// And recomputation changed nothing: the run without it is the same.
void then_same_without_recompute(const fs::path& root, const Proc&) {
  auto plain = tk_run(root / "plain", gpt_recipe(root), "--set run.steps=12");
  REQUIRE(plain.rc == 0);
  CHECK(torch::equal(weights(root / "plain"), weights(root / "one")));
}

#define TKT_KILL_SETS "--set run.steps=12 --set run.checkpoint_every=4 "
const KilledAndResumed kKilledAndResumed[] = {
    {"2 ranks killed and resumed end bit-identical to an uninterrupted 2-rank run (the reducer rebuilt)", experts_ddp,
     "--nproc 2 --set batch.micro_batch=2 " TKT_KILL_SETS, 1, then_rank0_named},
    {"token shards: 2 ranks killed and resumed, bit-identical", shards_ddp, "--nproc 2 " TKT_KILL_SETS, 1, nullptr},
    {"ZeRO-1 killed and resumed: bit-identical, with every rank's share in the checkpoint", adamw_sharded,
     "--nproc 2 " TKT_KILL_SETS, 1, then_every_share_saved},
    {"killed and resumed with recomputation: bit-identical to the uninterrupted run", gpt_recomputed, TKT_KILL_SETS,
     128 + 9, then_same_without_recompute},
    {"a run killed by SIGKILL and resumed ends bit-identical to an uninterrupted one", base_accumulated,
     "--set data.samples=80 " TKT_KILL_SETS, 128 + 9, nullptr},
};
#undef TKT_KILL_SETS

TEST_SUITE("resume") {
  TKT_TABLE_CASES(kKilledAndResumed, killed_and_resumed);
}
