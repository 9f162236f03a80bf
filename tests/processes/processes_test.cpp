// tk-run as a process: data parallel with --nproc on loopback (Gloo, CPU), kills and resumes.

#include "process_support.h"

namespace fs = std::filesystem;

using tkt::tk_run;
using tkt::weights;
using tkt::kBase;

/// kBase trains in float64.
const tkt::Tol kF64 = tkt::tol_for(torch::kDouble);


TEST_SUITE("ddp") {
  TEST_CASE("2 ranks x m x k == 1 process x 2m x k == 1 process x 2mk, with identical ranks and one sync per window") {
    const fs::path root = tkt::temp_dir("ddp-equal");
    const std::string accum = "[[plugins]]\nname = \"grad_accum\"\nsteps = 2\n";
    const std::string ddp = "[[plugins]]\nname = \"ddp\"\ncheck_every = 1\ntimeout_s = 60.0\n";
    auto two = tk_run(root / "two", std::string(kBase) + ddp + accum, "--nproc 2");
    INFO(two.out);
    REQUIRE(two.rc == 0);
    auto one = tk_run(root / "one", std::string(kBase) + accum, "--set data.micro_batch=8");
    REQUIRE(one.rc == 0);
    auto big = tk_run(root / "big", kBase, "--set data.micro_batch=16");
    REQUIRE(big.rc == 0);
    CHECK(tkt::excess(weights(root / "two"), weights(root / "one"), kF64) <= 1.0);
    CHECK(tkt::excess(weights(root / "two"), weights(root / "big"), kF64) <= 1.0);
    // Not the equality of runs that did nothing: the last three steps moved the weights.
    auto half = tk_run(root / "half", kBase, "--set data.micro_batch=16 --set run.steps=3");
    REQUIRE(half.rc == 0);
    CHECK(tkt::distance(weights(root / "two"), weights(root / "half")) > 1e-4);
    // The logged loss is the global window's.
    auto l2 = tkt::metric(root / "two/out/metrics.jsonl", "loss"), lb = tkt::metric(root / "big/out/metrics.jsonl", "loss");
    REQUIRE(l2.size() == 6);
    for (size_t i = 0; i < l2.size(); ++i) CHECK(l2[i] == doctest::Approx(lb[i]).epsilon(1e-12));
    // One sync per window (6), each one gradient bucket plus the window totals: not per micro-batch (12).
    auto syncs = tkt::metric(root / "two/out/metrics.jsonl", "ddp_syncs");
    auto calls = tkt::metric(root / "two/out/metrics.jsonl", "ddp_allreduces");
    CHECK(syncs == std::vector<double>{1, 2, 3, 4, 5, 6});
    CHECK(calls == std::vector<double>{2, 4, 6, 8, 10, 12});
    CHECK(tkt::metric(root / "two/out/metrics.jsonl", "micro_batches").back() == 4);  // 2 ranks x k = 2
    // Only rank 0 wrote; every line of the launcher's output carries its rank.
    CHECK(two.out.find("[rank 1] ") != std::string::npos);
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
    auto big = tk_run(root / "big", kBase, "--set data.micro_batch=8");
    REQUIRE(big.rc == 0);
    CHECK(tkt::excess(weights(root / "two"), weights(root / "big"), kF64) <= 1.0);
    fs::remove_all(root);
  }

  TEST_CASE("tokens normalization is exact across ranks with uneven token counts and a short last window") {
    const fs::path root = tkt::temp_dir("ddp-tokens");
    // 112 sequences: 56 per rank, micro-batches of 4 -> 14 per epoch -> windows of 4, 4, 4, 2.
    std::string base = kBase;
    base.replace(base.find("classes = 4"), 11, "classes = 4\nseq_len = 10\nmin_len = 1");
    const std::vector<std::string> sets = {"--set data.name=synthetic-tokens", "--set data.samples=112",
                                           "--set run.steps=0", "--set run.epochs=2", "--set loss.reduction=sum"};
    std::string common;
    for (const auto& s : sets) common += s + " ";
    const std::string accum = "[[plugins]]\nname = \"grad_accum\"\nsteps = 4\nnormalize = \"tokens\"\n";
    auto two = tk_run(root / "two", base + "[[plugins]]\nname = \"ddp\"\n" + accum, common + "--nproc 2");
    INFO(two.out);
    REQUIRE(two.rc == 0);
    auto one = tk_run(root / "one", base + accum, common + "--set data.micro_batch=8");
    REQUIRE(one.rc == 0);
    CHECK(tkt::metric(root / "one/out/metrics.jsonl", "micro_batches") ==
          std::vector<double>{4, 4, 4, 2, 4, 4, 4, 2});
    CHECK(tkt::excess(weights(root / "two"), weights(root / "one"), kF64) <= 1.0);
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
    // Rank 1 nudges a parameter after step 3; the check after step 4 (ddp is listed first) sees it.
    const fs::path root = tkt::temp_dir("ddp-diverge");
    auto p = tk_run(root, std::string(kBase) + "[[plugins]]\nname = \"ddp\"\ncheck_every = 1\n" +
                              "[[plugins]]\nname = \"probe\"\nperturb_at_step = 2\nonly_rank = 1\n",
                    "--nproc 2");
    CHECK(p.rc == 1);
    CHECK(p.out.find("ranks diverged after step 4") != std::string::npos);
    fs::remove_all(root);
  }

  TEST_CASE("a worker that fails stops the world, with its error, in bounded time") {
    const fs::path root = tkt::temp_dir("ddp-fail");
    auto p = tk_run(root, std::string(kBase) + "[[plugins]]\nname = \"ddp\"\ntimeout_s = 30.0\n" +
                              "[[plugins]]\nname = \"probe\"\nthrow_at_step = 2\nonly_rank = 1\n",
                    "--nproc 2");
    CHECK(p.rc == 1);
    CHECK(p.out.find("[rank 1] ") != std::string::npos);
    CHECK(p.out.find("plugin 'probe' failed in event backward at step 2 (micro-batch 3): injected failure") !=
          std::string::npos);
    CHECK(p.out.find("tk-run: rank 1 failed (exited with code 1)") != std::string::npos);
    CHECK(p.seconds < 30.0);
    fs::remove_all(root);
  }

  TEST_CASE("a worker killed by a signal stops the world, in bounded time") {
    const fs::path root = tkt::temp_dir("ddp-kill");
    auto p = tk_run(root, std::string(kBase) + "[[plugins]]\nname = \"ddp\"\ntimeout_s = 30.0\n" +
                              "[[plugins]]\nname = \"probe\"\nkill_at_step = 2\nonly_rank = 1\n",
                    "--nproc 3");
    CHECK(p.rc == 1);
    CHECK(p.out.find("tk-run: rank 1 failed (was killed by signal 9") != std::string::npos);
    CHECK(p.seconds < 30.0);
    fs::remove_all(root);
  }

  TEST_CASE("--dry-run with --nproc shows the per-rank and the global batch") {
    const fs::path root = tkt::temp_dir("ddp-dry");
    auto p = tk_run(root, std::string(kBase) + "[[plugins]]\nname = \"ddp\"\n[[plugins]]\nname = \"grad_accum\"\nsteps = 3\n",
                    "--nproc 4 --dry-run");
    CHECK(p.rc == 0);
    CHECK(p.out.find("effective     48 examples per optimizer step (4 x 3 x 4); 12 per rank") != std::string::npos);
    CHECK(p.out.find("world size    4 (set by ddp)") != std::string::npos);
    fs::remove_all(root);
  }
}

TEST_SUITE("resume") {
  TEST_CASE("a run killed by SIGKILL and resumed ends bit-identical to an uninterrupted one") {
    const fs::path root = tkt::temp_dir("resume-kill");
    const std::string recipe = std::string(kBase) + "[[plugins]]\nname = \"grad_accum\"\nsteps = 3\n";
    const std::string sets = "--set run.steps=12 --set data.samples=80 --set run.checkpoint_every=4 ";
    auto one = tk_run(root / "one", recipe, sets);
    REQUIRE(one.rc == 0);
    // The same run, killed right after the record of step 9 (the checkpoint is at 8), then resumed.
    auto killed = tk_run(root / "two", recipe, sets, "TK_FAULT=metrics-written:9");
    CHECK(killed.rc == 128 + 9);
    auto resumed = tk_run(root / "two", recipe, sets + "--resume latest");
    INFO(resumed.out);
    REQUIRE(resumed.rc == 0);
    CHECK(resumed.out.find("resuming from") != std::string::npos);
    CHECK(torch::equal(weights(root / "two"), weights(root / "one")));
    CHECK(tkt::metric(root / "two/out/metrics.jsonl", "loss") == tkt::metric(root / "one/out/metrics.jsonl", "loss"));
    fs::remove_all(root);
  }

  TEST_CASE("SIGTERM stops at the next boundary with a checkpoint and a non-zero exit; resuming completes the run") {
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
