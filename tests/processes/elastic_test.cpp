// Runs that survive the cluster (docs/reliability.md, docs/distributed.md), checked from outside
// with tk-run processes: --resume auto, restarts of tk-run's launcher, a world that changes size
// between a checkpoint and its resume, Slurm's variables and its warning signal.
#include <signal.h>

#include <cmath>

#include "process_support.h"

namespace fs = std::filesystem;
using tkt::check_same_run;
using tkt::Proc;
using tkt::records;
using tkt::tk_run;
using tkt::weights;

namespace {

bool has(const Proc& p, const std::string& text) { return p.out.find(text) != std::string::npos; }

/// A start of the run in `dir` that the fault `fault` (TK_FAULT) stops, ending with exit code `rc`
/// (128 + 9: one process killed; 1: a launch whose rank was killed): its output.
Proc killed_start(const fs::path& dir, const std::string& recipe, const std::string& args, const std::string& fault,
                  int rc) {
  Proc p = tk_run(dir, recipe, args, "TK_FAULT=" + fault);
  INFO(p.out);
  REQUIRE(p.rc == rc);
  return p;
}

/// An MLP on 240 examples in float64, 12 examples a step whatever the world (micro-batches of 2),
/// a checkpoint every 4 steps; 30 steps cross an epoch's end (20 steps an epoch).
std::string recipe(const std::string& batch) {
  return R"(
[run]
seed = 9
steps = 30
checkpoint_every = 4
dtype = "float64"

[model]
name = "mlp"
hidden = [16]
activation = "tanh"

[data]
name = "synthetic-classification"
samples = 240
validation_samples = 0
features = 8
classes = 4

[batch]
)" + batch + R"(

[optimizer]
name = "sgd"
lr = 0.1
momentum = 0.9

[[plugins]]
name = "grad_accum"
[[plugins]]
name = "ddp"
)";
}
const std::string kEffective = recipe("micro_batch = 2\neffective_batch = 12");
/// The window given per rank: 12 examples a step on 2 ranks only.
const std::string kPerRank = recipe("micro_batch = 2\naccumulation = 3");

/// The same steps as `reference`, to `tol`: weights, and each record's loss, learning rate and
/// counts (the world's).
void check_same_steps(const fs::path& dir, const fs::path& reference, double tol) {
  const auto a = weights(dir), b = weights(reference);
  REQUIRE(a.sizes() == b.sizes());
  CHECK((a - b).abs().max().item<double>() <= tol);
  const auto got = records(dir / "out/metrics.jsonl"), want = records(reference / "out/metrics.jsonl");
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("record " << i << ": " << got[i].dump() << " vs " << want[i].dump());
    for (const char* key : {"step", "epoch", "micro_batches", "effective_batch", "samples", "tokens"})
      CHECK(got[i].at(key) == want[i].at(key));
    CHECK(std::abs(got[i].at("loss").get<double>() - want[i].at("loss").get<double>()) <= tol);
    CHECK(got[i].at("lr").get<double>() == want[i].at("lr").get<double>());
  }
}

}  // namespace

TEST_SUITE("elastic") {
  TEST_CASE("--resume auto starts a run, continues it after a kill, restarts one killed before its first checkpoint, and refuses another run's folder") {
    const fs::path root = tkt::temp_dir("auto");
    const std::string one = "--set run.steps=20 ";
    REQUIRE(tk_run(root / "whole", kEffective, one).rc == 0);
    // The first start, killed after its second checkpoint; the same command continues it.
    killed_start(root / "auto", kEffective, one + "--resume auto", "checkpoint-done:2", 128 + 9);
    auto again = tk_run(root / "auto", kEffective, one + "--resume auto");
    INFO(again.out);
    REQUIRE(again.rc == 0);
    CHECK(has(again, "resuming from"));
    check_same_run(root / "auto", root / "whole");
    // Complete: nothing to train.
    auto done = tk_run(root / "auto", kEffective, one + "--resume auto");
    CHECK(done.rc == 0);
    CHECK(has(done, "already complete"));
    // Killed before any checkpoint: its records are trained again, once each.
    killed_start(root / "early", kEffective, one + "--resume auto", "metrics-written:2", 128 + 9);
    auto early = tk_run(root / "early", kEffective, one + "--resume auto");
    INFO(early.out);
    REQUIRE(early.rc == 0);
    CHECK(has(early, "holds no checkpoint of this run yet; starting it again from step 0"));
    check_same_run(root / "early", root / "whole");
    // A restart (TK_RESTART_COUNT > 0) resumes without being told, an --overwrite of its first start ignored.
    killed_start(root / "restart", kEffective, one + "--overwrite", "checkpoint-done:1", 128 + 9);
    auto restart = tk_run(root / "restart", kEffective, one + "--overwrite", "TK_RESTART_COUNT=1");
    INFO(restart.out);
    REQUIRE(restart.rc == 0);
    CHECK(has(restart, "resuming from"));
    check_same_run(root / "restart", root / "whole");
    // Another recipe's run without a checkpoint is not this run's to start over.
    killed_start(root / "other", kEffective, one + "--set optimizer.lr=0.05", "metrics-written:2", 128 + 9);
    auto other = tk_run(root / "other", kEffective, one + "--resume auto");
    CHECK(other.rc == 2);
    CHECK(has(other, "--resume auto continues only a run of this same recipe"));
    // Its own recipe, with what a resume may change changed (run.log_every): the same run, started again.
    auto own = tk_run(root / "other", kEffective, one + "--set optimizer.lr=0.05 --set run.log_every=3 --resume auto");
    INFO(own.out);
    CHECK(own.rc == 0);
    CHECK(has(own, "holds no checkpoint of this run yet; starting it again from step 0"));
    fs::remove_all(root);
  }

  TEST_CASE("a checkpoint of 2 ranks goes on in 1 process, then on 3 ranks, with the steps of one process to 1e-12") {
    const fs::path root = tkt::temp_dir("resize");
    REQUIRE(tk_run(root / "whole", kEffective, "").rc == 0);
    const fs::path dir = root / "resized";
    // 2 ranks to step 8 (rank 0 killed after its second checkpoint), 1 process to step 16, 3 ranks to the end.
    killed_start(dir, kEffective, "--nproc 2 --resume auto", "checkpoint-done:2", 1);
    auto alone = killed_start(dir, kEffective, "--resume auto", "checkpoint-done:2", 128 + 9);
    INFO(alone.out);
    CHECK(has(alone, "continuing the run of 2 ranks on 1: 12 examples a step, micro-batches of 2 x 6 per rank"));
    auto three = tk_run(dir, kEffective, "--nproc 3 --resume auto");
    INFO(three.out);
    REQUIRE(three.rc == 0);
    CHECK(has(three, "continuing the run of 1 rank on 3: 12 examples a step, micro-batches of 2 x 2 per rank"));
    check_same_steps(dir, root / "whole", 1e-12);

    // A window given per rank keeps the checkpoint's 12 examples a step: 2 x 3 on 2 ranks goes on as 2 x 6 alone.
    const fs::path per_rank = root / "per-rank";
    killed_start(per_rank, kPerRank, "--nproc 2", "checkpoint-done:2", 1);
    // No exact split on 5 ranks: refused before a step, naming the sizes that go on exactly.
    auto five = tk_run(root / "five", kPerRank, "--nproc 5 --resume " + (per_rank / "out/checkpoints").string());
    INFO(five.out);
    CHECK(five.rc == 2);
    CHECK(has(five, "on 5 with the same steps: its 12 examples a step do not divide over 5 ranks; it continues "
                    "exactly on 1, 2, 3, 4, 6 ranks"));
    // A dry run refuses it alike; one that goes on says nothing is left to check but the tensors.
    auto five_dry = tk_run(root / "five", kPerRank, "--nproc 5 --dry-run --resume " + (per_rank / "out/checkpoints").string());
    INFO(five_dry.out);
    CHECK(five_dry.rc == 2);
    CHECK(has(five_dry, "do not divide over 5 ranks; it continues exactly on 1, 2, 3, 4, 6 ranks"));
    auto three_dry = tk_run(root / "five", kPerRank, "--nproc 3 --dry-run --resume " + (per_rank / "out/checkpoints").string());
    INFO(three_dry.out);
    CHECK(three_dry.rc == 0);
    CHECK(has(three_dry, "(compared without loading it: its tensors are checked when the run starts)"));
    // 22 examples in micro-batches of 3, 6 a step: alone, step 4 is micro-batches of 3 and 1 (a mean loss weighs
    // the last example 1/2), on 2 ranks one of 2 and 2 (1/4 each): the same examples, another step.
    const std::string ragged = "--set data.samples=22 --set batch.micro_batch=3 --set batch.effective_batch=6 "
                               "--set run.steps=8 --set run.checkpoint_every=2 ";
    killed_start(root / "ragged", kEffective, ragged, "checkpoint-done:1", 128 + 9);
    auto ragged_two = tk_run(root / "ragged", kEffective, ragged + "--nproc 2 --resume auto");
    INFO(ragged_two.out);
    CHECK(ragged_two.rc == 2);
    CHECK(has(ragged_two, "on 2 with the same steps: step 4 would take other examples on 2 ranks (micro-batches of 3 x 1), "
                          "or weigh them otherwise"));
    CHECK(has(ragged_two, "it continues exactly on 1 rank\n"));
    auto rederived = tk_run(per_rank, kPerRank, "--resume auto");
    INFO(rederived.out);
    REQUIRE(rederived.rc == 0);
    CHECK(has(rederived, "continuing the run of 2 ranks on 1: 12 examples a step, micro-batches of 2 x 6 per rank"));
    check_same_steps(per_rank, root / "whole", 1e-12);
    fs::remove_all(root);
  }

  TEST_CASE("ZeRO stages 2 and 3: a sharded checkpoint of 2 ranks goes on on 3 ranks, then in 1 process, with the steps of one process to 1e-12") {
    const fs::path root = tkt::temp_dir("resize-zero");
    REQUIRE(tk_run(root / "whole", kEffective, "").rc == 0);
    for (int stage : {2, 3}) {
      CAPTURE(stage);
      const std::string sharded = kEffective + "[[plugins]]\nname = \"shard\"\nstage = " + std::to_string(stage) + "\n";
      const fs::path dir = root / ("stage" + std::to_string(stage));
      // Rank 0 killed after its second checkpoint each time: steps 8 and 16.
      killed_start(dir, sharded, "--nproc 2 --resume auto", "checkpoint-done:2", 1);
      auto three = killed_start(dir, sharded, "--nproc 3 --resume auto", "checkpoint-done:2", 1);
      INFO(three.out);
      CHECK(has(three, "continuing the run of 2 ranks on 3: 12 examples a step, micro-batches of 2 x 2 per rank"));
      CHECK(has(three, stage == 2 ? "stage 2: the optimizer state and the gradients are sharded over 3 ranks"
                                  : "stage 3: the optimizer state, the gradients and the parameters are sharded over 3 ranks"));
      auto alone = tk_run(dir, sharded, "--resume auto");
      INFO(alone.out);
      REQUIRE(alone.rc == 0);
      CHECK(has(alone, "continuing the run of 3 ranks on 1: 12 examples a step, micro-batches of 2 x 6 per rank"));
      check_same_steps(dir, root / "whole", 1e-12);
    }
    fs::remove_all(root);
  }

  TEST_CASE("tk-run --max-restarts: a worker killed mid-run restarts the world, which resumes by itself and ends identical") {
    const fs::path root = tkt::temp_dir("restarts");
    REQUIRE(tk_run(root / "whole", kEffective, "--nproc 2").rc == 0);
    auto p = tk_run(root / "restarted", kEffective, "--nproc 2 --max-restarts 1", "TK_FAULT=checkpoint-done:3");
    INFO(p.out);
    REQUIRE(p.rc == 0);
    CHECK(has(p, "restart 1 of 1: starting the 2 workers again"));
    CHECK(has(p, "resuming from"));
    check_same_run(root / "restarted", root / "whole");
    // Without restarts left, the failure is the launch's.
    auto none = tk_run(root / "none", kEffective, "--nproc 2", "TK_FAULT=checkpoint-done:1");
    CHECK(none.rc == 1);
    CHECK(!has(none, "restart 1"));
    auto nodes = tk_run(root / "nodes", kEffective, "--nnodes 2 --master-port 29999 --max-restarts 1");
    CHECK(nodes.rc == 2);
    CHECK(has(nodes, "--max-restarts restarts the workers of one node"));
    fs::remove_all(root);
  }

  TEST_CASE("Slurm: tasks placed by SLURM_* variables meet on the node list's first host, SIGUSR1 stops them at a checkpoint, --resume auto ends identical") {
    const fs::path root = tkt::temp_dir("slurm");
    const std::string steps = "--set run.steps=2000 --set run.checkpoint_every=0 ";
    REQUIRE(tk_run(root / "whole", kEffective, "--nproc 2 " + steps).rc == 0);
    const fs::path dir = root / "job";
    const std::string port = std::to_string(20000 + (getpid() % 20000));
    auto task = [&](int r) {
      return "env -u WORLD_SIZE -u RANK -u MASTER_ADDR OMP_NUM_THREADS=1 SLURM_PROCID=" + std::to_string(r) +
             " SLURM_NTASKS=2 SLURM_LOCALID=" + std::to_string(r) +
             " SLURM_NODEID=0 SLURM_STEP_ID=0 SLURM_JOB_NODELIST='127.0.0.[1-2]' MASTER_PORT=" + port + " " +
             tkt::tk_run_command(dir, kEffective, steps + "--resume auto");
    };
    // Both tasks get the warning, as sbatch --signal=USR1@SECONDS sends it to every task of the step.
    auto job = tkt::shell("(" + task(0) + ") > " + (root / "0.log").string() + " 2>&1 & a=$!\n(" + task(1) + ") > " +
                          (root / "1.log").string() + " 2>&1 & b=$!\ni=0; while [ ! -s " +
                          (dir / "out/metrics.jsonl").string() +
                          " ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done\n"
                          "kill -USR1 $a $b; wait $a; ra=$?; wait $b; rb=$?; echo \"rc $ra $rb\"; cat " +
                          (root / "0.log").string());
    INFO(job.out);
    CHECK(has(job, "rc 138 138"));
    CHECK(has(job, "SLURM_PROCID/SLURM_NTASKS, node 0, rendezvous on the first node of 127.0.0.[1-2]"));
    CHECK(has(job, "stopped early (signal)"));
    // The plan is printed once, by the task Slurm numbers 0.
    CHECK(has(job, "plan:"));
    CHECK(tkt::read_text(root / "1.log").find("plan:") == std::string::npos);
    REQUIRE(fs::exists(dir / "out/checkpoints/latest"));
    // The requeued job: the same command.
    auto requeued = tkt::shell("(" + task(0) + ") > " + (root / "0.log").string() + " 2>&1 & a=$!\n(" + task(1) +
                               ") > /dev/null 2>&1; rb=$?; wait $a; ra=$?; echo \"rc $ra $rb\"; cat " +
                               (root / "0.log").string());
    INFO(requeued.out);
    CHECK(has(requeued, "rc 0 0"));
    CHECK(has(requeued, "resuming from"));
    check_same_run(dir, root / "whole");
    // A node list it cannot read is named.
    auto bad = tkt::shell("env -u WORLD_SIZE -u MASTER_ADDR SLURM_PROCID=0 SLURM_NTASKS=2 SLURM_STEP_ID=0 "
                          "SLURM_JOB_NODELIST='node[a-b]' " + tkt::tk_run_command(root / "bad", kEffective, ""));
    CHECK(bad.rc != 0);
    CHECK(has(bad, "cannot read the Slurm node list 'node[a-b]': '[a-b]' is not a range of numbers"));
    fs::remove_all(root);
  }
}
