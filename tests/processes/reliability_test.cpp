// What trainkit guarantees about a run folder (docs/reliability.md), checked from outside with
// tk-run processes: checked writes, one run per folder, strict resume, kill safety, signals.
#include <signal.h>

#include <random>
#include <thread>

#include "process_support.h"

namespace fs = std::filesystem;
using tkt::check_same_run;
using tkt::kBase;
using tkt::Proc;
using tkt::records;
using tkt::tk_run;
using tkt::weights;

namespace {

bool has(const Proc& p, const std::string& text) { return p.out.find(text) != std::string::npos; }

/// Waits (bounded) until `file` exists and is not empty.
bool wait_for(const fs::path& file, double seconds = 60) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  std::error_code ec;
  while (std::chrono::steady_clock::now() < until) {
    if (fs::file_size(file, ec) > 0 && !ec) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

/// A shell snippet: start `cmd` in the background, wait (bounded) until `file` has content.
std::string start_and_wait(const std::string& cmd, const fs::path& file) {
  return "(" + cmd + ") & pid=$!\ni=0; while [ ! -s " + file.string() +
         " ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done\n";
}

/// 40 steps of 3 accumulated micro-batches, checkpoints every 3.
const std::string kAccum = std::string(kBase) + "[[plugins]]\nname = \"grad_accum\"\nsteps = 3\n";
const std::string kAccumSets = "--set run.steps=40 --set run.checkpoint_every=3 ";
const std::string kPluginPath = "TK_PLUGIN_PATH=" + std::string(TK_TEST_PLUGIN_DIR) + " ";

}  // namespace

TEST_SUITE("reliability") {
  TEST_CASE("a write that fails stops the run at once, naming the file - the last good checkpoint is kept") {
    const fs::path root = tkt::temp_dir("full-disk");
    SUBCASE("metrics.jsonl a link to a device: not trainkit's, never written through") {
      fs::create_directories(root / "out");
      fs::create_symlink("/dev/full", root / "out/metrics.jsonl");
      auto p = tk_run(root, kBase, "--overwrite");
      INFO(p.out);
      CHECK(p.rc == 2);
      CHECK(has(p, "holds files trainkit did not write where it writes (metrics.jsonl)"));
      CHECK(fs::is_symlink(root / "out/metrics.jsonl"));
    }
    SUBCASE("files that may not grow past a limit, as on a disk that fills up") {
      // With a 24 KiB limit on file size the checkpoint files fit and metrics.jsonl, after some
      // 100 records, does not. SIGXFSZ has its default disposition (it would kill the process):
      // tk-run ignores it and fails the write instead.
      const std::string sets = "--set run.steps=400 --set run.checkpoint_every=10 ";
      auto p = tkt::shell("trap - XFSZ; ulimit -f 24; " + tkt::tk_run_command(root, kAccum, sets));
      INFO(p.out);
      CHECK(p.rc == 1);
      CHECK(has(p, "cannot write '" + (root / "out/metrics.jsonl").string() + "': File too large"));
      const std::string status = tkt::read_text(root / "out/status.json");
      CHECK(status.find("\"status\":\"failed\"") != std::string::npos);
      CHECK(status.find("File too large") != std::string::npos);
      const auto kept = records(root / "out/metrics.jsonl");
      REQUIRE(kept.size() > 20);
      CHECK(kept.size() < 400);
      CHECK(tkt::read_text(root / "out/checkpoints/latest").rfind("step-", 0) == 0);
      for (const auto& e : fs::directory_iterator(root / "out/checkpoints")) CHECK(e.path().extension() != ".tmp");
      // What was kept resumes: the run completes equal to one never interrupted.
      auto resumed = tk_run(root, kAccum, sets + "--resume latest");
      INFO(resumed.out);
      REQUIRE(resumed.rc == 0);
      REQUIRE(tk_run(root / "whole", kAccum, sets).rc == 0);
      check_same_run(root, root / "whole");
    }
    SUBCASE("a checkpoint that cannot be written leaves none half-written") {
      // 40 KiB: the records fit, a checkpoint of this wider model (~75 KiB) does not.
      const std::string sets = "--set run.steps=12 --set run.checkpoint_every=4 --set model.hidden=[96,96]";
      auto p = tkt::shell("trap - XFSZ; ulimit -f 40; " + tkt::tk_run_command(root, kBase, sets));
      INFO(p.out);
      CHECK(p.rc == 1);
      CHECK(has(p, "model.pt.tmp': File too large"));
      CHECK(!fs::exists(root / "out/checkpoints/step-00000004.tmp"));
      CHECK(!fs::exists(root / "out/checkpoints/step-00000004"));
      CHECK(records(root / "out/metrics.jsonl").size() == 4);
    }
    fs::remove_all(root);
  }

  TEST_CASE("one run per folder: a second live run is refused naming the first's PID") {
    const fs::path root = tkt::temp_dir("lock");
    const std::string cmd = tkt::tk_run_command(root, kBase, "--set run.steps=100000 --set run.max_time=\\\"60s\\\"");
    FILE* first = popen((cmd + " > " + (root / "first.log").string() + " 2>&1").c_str(), "r");
    REQUIRE(first != nullptr);
    REQUIRE(wait_for(root / "out/metrics.jsonl"));
    auto second = tk_run(root, kBase, "--set run.steps=5");
    INFO(second.out);
    CHECK(second.rc == 2);
    const std::string pid = tkt::read_text(root / "out/.tk-lock");
    CHECK(has(second, "is in use by another run (process " + pid.substr(0, pid.find('\n')) + ")"));
    // The first run is untouched: stop it and check its records.
    kill(std::stoi(pid), SIGTERM);
    pclose(first);
    const auto recs = records(root / "out/metrics.jsonl");
    REQUIRE(!recs.empty());
    for (size_t i = 0; i < recs.size(); ++i) CHECK(recs[i]["step"] == static_cast<int64_t>(i + 1));
    fs::remove_all(root);
  }

  TEST_CASE("a new run over a finished one is refused unless --overwrite, which starts clean") {
    const fs::path root = tkt::temp_dir("overwrite");
    REQUIRE(tk_run(root, kBase, "--set run.checkpoint_every=2").rc == 0);
    const std::string before = tkt::read_text(root / "out/metrics.jsonl");
    auto again = tk_run(root, kBase, "--set run.steps=4");
    INFO(again.out);
    CHECK(again.rc == 2);
    CHECK(has(again, "holds another run (metrics.jsonl, weights.pt, checkpoints/)"));
    CHECK(has(again, "--overwrite"));
    CHECK(tkt::read_text(root / "out/metrics.jsonl") == before);
    // A checkpoint picked behind a later one: the records after it go, and the run says so.
    REQUIRE(tk_run(root / "older", kBase, "--set run.checkpoint_every=2").rc == 0);  // 6 steps: 2, 4 and 6 kept
    auto older = tk_run(root / "older", kBase, "--set run.checkpoint_every=2 --resume " +
                                                   (root / "older/out/checkpoints/step-00000002").string());
    INFO(older.out);
    CHECK(older.rc == 0);
    CHECK(has(older, "the run had recorded up to step 6: its records of steps 3 to 6 are dropped from metrics.jsonl"));
    CHECK(records(root / "older/out/metrics.jsonl").size() == 6);
    // An output that cannot be a folder (a file stands there): refused at its key, nothing written.
    std::ofstream(root / "file") << "not a folder\n";
    auto blocked = tkt::shell(tkt::tk_run_command(root, kBase, "--set run.steps=4") + " --set run.output=\\\"" +
                              (root / "file/out").string() + "\\\"");
    INFO(blocked.out);
    CHECK(blocked.rc == 2);
    CHECK(has(blocked, ": run.output: cannot create the output folder '" + (root / "file/out").string() + "': "));
    CHECK(!has(blocked, "what it wrote so far is kept"));
    auto over = tk_run(root, kBase, "--set run.steps=4 --overwrite");
    REQUIRE(over.rc == 0);
    CHECK(records(root / "out/metrics.jsonl").size() == 4);
    CHECK(!fs::exists(root / "out/checkpoints/step-00000006"));  // the old run's checkpoints are gone
    CHECK(fs::exists(root / "out/checkpoints/step-00000004"));
    fs::remove_all(root);
  }

  TEST_CASE("--overwrite deletes only what trainkit wrote - files of a person's at trainkit's names are never touched") {
    const fs::path root = tkt::temp_dir("foreign");
    // A folder of a person's own, at the names trainkit writes: refused, with or without --overwrite.
    fs::create_directories(root / "out/checkpoints/epoch_10");
    std::ofstream(root / "out/checkpoints/epoch_10/model.bin") << "my model\n";
    std::ofstream(root / "out/weights.pt") << "my weights\n";
    std::ofstream(root / "out/notes.txt") << "my notes\n";
    for (const std::string flag : {"", "--overwrite"}) {
      auto p = tk_run(root, kBase, "--set run.steps=2 " + flag);
      INFO(p.out);
      CHECK(p.rc == 2);
      CHECK(has(p, "holds files trainkit did not write where it writes (weights.pt, checkpoints/epoch_10)"));
    }
    CHECK(tkt::read_text(root / "out/weights.pt") == "my weights\n");
    CHECK(tkt::read_text(root / "out/checkpoints/epoch_10/model.bin") == "my model\n");
    // Without them, a run trains there and leaves notes.txt alone; then a person's folder in
    // checkpoints/ of that run stops an --overwrite, which deletes nothing.
    fs::remove_all(root / "out/checkpoints");
    fs::remove(root / "out/weights.pt");
    REQUIRE(tk_run(root, kBase, "--set run.steps=2").rc == 0);
    fs::create_directories(root / "out/checkpoints/mine");
    auto over = tk_run(root, kBase, "--set run.steps=2 --overwrite");
    INFO(over.out);
    CHECK(over.rc == 2);
    CHECK(has(over, "(checkpoints/mine)"));
    CHECK(fs::exists(root / "out/weights.pt"));
    CHECK(fs::exists(root / "out/checkpoints/step-00000002"));
    fs::remove_all(root / "out/checkpoints/mine");
    auto clean = tk_run(root, kBase, "--set run.steps=3 --overwrite");
    INFO(clean.out);
    CHECK(clean.rc == 0);
    CHECK(!fs::exists(root / "out/checkpoints/step-00000002"));
    CHECK(tkt::read_text(root / "out/notes.txt") == "my notes\n");
    fs::remove_all(root);
  }

  TEST_CASE("--nproc without a plugin that makes the world is refused before any worker starts") {
    const fs::path root = tkt::temp_dir("nproc-no-world");
    auto p = tk_run(root, kBase, "--nproc 2");
    INFO(p.out);
    CHECK(p.rc == 2);
    // The recipe's fault, named with it; not the command line's (no --help hint).
    CHECK(has(p, "tk-run: error: " + (root / "recipe.toml").string() + ": --nproc 2 needs a plugin that sums the "
                 "gradients across the processes (grads.synced)"));
    CHECK(!has(p, "--help"));
    CHECK(!has(p, "starting 2 workers"));
    CHECK(!fs::exists(root / "out"));
    fs::remove_all(root);
  }

  TEST_CASE("--nproc checks the recipe and its plugins without building the run - a worker's refusal is the launch's") {
    const fs::path root = tkt::temp_dir("nproc-checks");
    const std::string recipe = std::string(kBase) + "[[plugins]]\nname = \"ddp\"\n[world]\ntimeout_s = 30.0\n";
    // A key no component has: refused by the launcher, at its place, before any worker starts.
    auto key = tk_run(root / "key", recipe, "--nproc 2 --set model.hiden=[8]");
    INFO(key.out);
    CHECK(key.rc == 2);
    CHECK(has(key, "unknown key 'hiden' in [model]"));
    CHECK(!has(key, "starting 2 workers"));
    // The launcher makes no data set: a value the data set's maker refuses is each worker's
    // refusal, and the launch exits as a refusal too.
    auto data = tk_run(root / "data", recipe, "--nproc 2 --set data.samples=0");
    INFO(data.out);
    CHECK(data.rc == 2);
    CHECK(has(data, "starting 2 workers"));
    CHECK(has(data, "data.samples: must be"));
    fs::remove_all(root);
  }

  TEST_CASE("resume refuses a different run, listing each change - --allow-change lets one through") {
    const fs::path root = tkt::temp_dir("strict-resume");
    const std::string sets = "--set run.steps=12 --set run.checkpoint_every=4 --set run.max_time=\\\"0s\\\" ";
    REQUIRE(tk_run(root, kAccum, sets).rc == 0);  // stops after step 1, with a checkpoint
    auto seed = tk_run(root, kAccum, sets + "--set run.seed=3 --set optimizer.lr=0.2 --resume latest");
    INFO(seed.out);
    CHECK(seed.rc == 2);
    CHECK(has(seed, "this run differs from the one that wrote it"));
    CHECK(has(seed, "run.seed: 9 -> 3"));
    CHECK(has(seed, "optimizer.lr: 0.1 -> 0.2"));
    // A dry run checks the resume as the run would, reading no tensor.
    auto dry = tk_run(root, kAccum, sets + "--set run.seed=3 --dry-run --resume latest");
    CHECK(dry.rc == 2);
    CHECK(has(dry, "run.seed: 9 -> 3"));
    auto dry_allowed = tk_run(root, kAccum, sets + "--set optimizer.lr=0.05 --allow-change optimizer.lr --dry-run --resume latest");
    INFO(dry_allowed.out);
    CHECK(dry_allowed.rc == 0);
    CHECK(has(dry_allowed, "resume        from " + (root / "out" / "checkpoints" / "step-").string()));
    CHECK(has(dry_allowed, "--allow-change lets through (checkpoint -> now):\n  optimizer.lr: 0.1 -> 0.05"));
    CHECK(has(dry_allowed, " of 12; --allow-change"));
    // The run's length, as the run would refuse it: compared with the checkpoint's position.
    auto dry_longer = tk_run(root, kAccum, "--set run.steps=24 --set run.checkpoint_every=4 --allow-change run.steps "
                                           "--dry-run --resume latest");
    CHECK(dry_longer.rc == 2);
    CHECK(has(dry_longer, "the checkpoint is of a run of 12 steps, this one has 24"));
    auto dry_auto = tk_run(root / "none-yet", kAccum, sets + "--dry-run --resume auto");
    CHECK(dry_auto.rc == 0);
    CHECK(has(dry_auto, "--resume auto: no checkpoint in "));
    auto split = tk_run(root, std::string(kBase) + "[[plugins]]\nname = \"grad_accum\"\nsteps = 6\n",
                        sets + "--set batch.micro_batch=2 --resume latest");
    CHECK(split.rc == 2);
    CHECK(has(split, "batch.micro_batch: 4 -> 2"));
    CHECK(has(split, "batch.accumulation: 3 -> 6"));  // grad_accum's steps moved there
    // Let through, the same 12 examples a step split 2 x 6 go on from the example the checkpoint
    // stopped at, to the weights of the run never stopped (float64, to rounding: other sums).
    const std::string accum6 = std::string(kBase) + "[[plugins]]\nname = \"grad_accum\"\nsteps = 6\n";
    const std::string twelve = "--set run.steps=12 --set run.checkpoint_every=4 ";
    REQUIRE(tk_run(root / "whole", kAccum, twelve).rc == 0);
    REQUIRE(tk_run(root / "resplit", kAccum, sets).rc == 0);
    auto resplit = tk_run(root / "resplit", accum6, twelve + "--set batch.micro_batch=2 --allow-change batch --resume latest");
    INFO(resplit.out);
    CHECK(resplit.rc == 0);
    CHECK(has(resplit, "continuing the run in micro-batches of 2 x 6 per rank (it trained in 4 x 3): 12 examples a step"));
    CHECK((weights(root / "resplit") - weights(root / "whole")).abs().max().item<double>() < 1e-12);
    // Another number of examples a step is another run: refused, saying so.
    REQUIRE(tk_run(root / "bigger", kAccum, sets).rc == 0);
    auto bigger = tk_run(root / "bigger", accum6, twelve + "--allow-change batch --resume latest");
    CHECK(bigger.rc == 2);
    CHECK(has(bigger, "with the same steps: a step of 12 examples is not one of 24: the examples a step takes cannot "
                      "change on a resume, only how they are split into micro-batches"));
    std::string with_adam = kAccum;
    with_adam.replace(with_adam.find("name = \"sgd\""), 12, "name = \"adam\"");
    with_adam.replace(with_adam.find("momentum = 0.9"), 14, "");
    auto adam = tk_run(root, with_adam, sets + "--resume latest");
    INFO(adam.out);
    CHECK(adam.rc == 2);
    CHECK(has(adam, "optimizer.name: \"sgd\" -> \"adam\""));
    CHECK(has(adam, "optimizer.momentum: 0.9 -> (not set)"));
    CHECK(!has(adam, "INTERNAL ASSERT"));
    auto relu = tk_run(root, kAccum, sets + "--set model.activation=relu --resume latest");
    CHECK(relu.rc == 2);
    CHECK(has(relu, "model.activation: \"tanh\" -> \"relu\""));
    auto no_accum = tk_run(root, kBase, sets + "--resume latest");
    CHECK(no_accum.rc == 2);
    CHECK(has(no_accum, "plugins: \"grad_accum\" -> \"\""));
    // A change let through that what was saved cannot follow is named with the load's error.
    auto unreadable = tk_run(root, with_adam, sets + "--allow-change optimizer --resume latest");
    INFO(unreadable.out);
    CHECK(unreadable.rc == 2);
    CHECK(has(unreadable, "optimizer.pt: damaged, or saved for another optimizer"));
    CHECK(has(unreadable, "this resume changes the run that wrote the checkpoint (let through with --allow-change):"));
    CHECK(has(unreadable, "  optimizer.name: \"sgd\" -> \"adam\""));
    // The run's length cannot change, allowed or not: both refusals say what trains on from the checkpoint.
    const std::string length_note = "the run's length in optimizer steps (run.steps; or run.epochs, with the batch and "
                                    "the data that make an epoch's steps) cannot change on a resume, --allow-change "
                                    "included: its schedule and data order were made for it; to train on from this "
                                    "checkpoint, start a new run from its weights with [model] init = \"";
    auto longer = tk_run(root, kAccum, "--set run.steps=24 --set run.checkpoint_every=4 --resume latest");
    INFO(longer.out);
    CHECK(longer.rc == 2);
    CHECK(has(longer, "run.steps: 12 -> 24"));
    CHECK(has(longer, length_note));
    auto allowed_longer = tk_run(root, kAccum, "--set run.steps=24 --set run.checkpoint_every=4 --allow-change run.steps --resume latest");
    INFO(allowed_longer.out);
    CHECK(allowed_longer.rc == 2);
    CHECK(has(allowed_longer, "the checkpoint is of a run of 12 steps, this one has 24"));
    CHECK(has(allowed_longer, length_note));
    CHECK(has(allowed_longer, "/model.pt\""));
    // In epochs, a change let through that makes an epoch's steps (micro-batches of 4 -> 8) is named as the cause.
    std::string in_epochs = kAccum;
    in_epochs.replace(in_epochs.find("steps = 6\n"), 10, "epochs = 1\n");
    REQUIRE(tk_run(root / "epochs", in_epochs, "--set run.checkpoint_every=4").rc == 0);
    auto coarser = tk_run(root / "epochs", in_epochs, "--set run.checkpoint_every=4 --set batch.micro_batch=8 "
                                                      "--allow-change batch.micro_batch --resume latest");
    INFO(coarser.out);
    CHECK(coarser.rc == 2);
    CHECK(has(coarser, "the checkpoint is of a run of 22 steps, this one has 11: what --allow-change let through changes "
                       "how many optimizer steps its epochs take:\n  batch.micro_batch: 4 -> 8\n" + length_note));
    // Keys that do not change what is trained may change; others only when allowed.
    auto allowed = tk_run(root, kAccum, "--set run.steps=12 --set run.checkpoint_every=6 --set optimizer.lr=0.05 "
                                        "--allow-change optimizer.lr --resume latest");
    INFO(allowed.out);
    CHECK(allowed.rc == 0);
    fs::remove_all(root);
  }

  TEST_CASE("a resume on other data files is refused, naming them - --allow-change data.fingerprint lets it through") {
    const fs::path root = tkt::temp_dir("strict-data");
    fs::create_directories(root / "data");
    auto shards = [&](int64_t shift) {
      for (int s = 0; s < 2; ++s) {
        std::vector<int64_t> tokens;
        for (int64_t i = 0; i < 700; ++i) tokens.push_back((i * 13 + s * 7 + (s == 1 ? shift : 0)) % 97);
        tkt::write_shard(root / "data" / ("train_00" + std::to_string(s) + ".bin"), tokens);
      }
    };
    shards(0);
    const std::string recipe = "[run]\nseed = 9\ndtype = \"float64\"\n[model]\nname = \"gpt\"\nlayers = 1\nheads = 2\n"
                               "width = 16\n[data]\nname = \"tokens\"\ntrain = \"" + (root / "data/train_*.bin").string() +
                               "\"\nseq_len = 8\nvocab = 97\n[batch]\nmicro_batch = 2\n[optimizer]\nname = \"adamw\"\nlr = 0.01\n";
    const std::string sets = "--set run.steps=12 --set run.checkpoint_every=4 --set run.max_time=\\\"0s\\\" ";
    REQUIRE(tk_run(root / "run", recipe, sets).rc == 0);  // stops after step 1, with a checkpoint
    shards(1);  // the second shard now holds other tokens, of the same count
    auto other = tk_run(root / "run", recipe, sets + "--resume latest");
    INFO(other.out);
    CHECK(other.rc == 2);
    CHECK(has(other, "this run differs from the one that wrote it"));
    CHECK(has(other, "  data.fingerprint: train: 2 files, 4848 bytes, digest "));
    CHECK(has(other, " -> train: 2 files, 4848 bytes, digest "));
    CHECK(!has(other, "data.train:"));  // the same recipe: the files are what changed
    auto allowed = tk_run(root / "run", recipe, sets + "--allow-change data.fingerprint --resume latest");
    INFO(allowed.out);
    CHECK(allowed.rc == 0);
    fs::remove_all(root);
  }

  TEST_CASE("a checkpoint that predates an option (or its move) resumes with its default, bit-identically - set otherwise, it is refused") {
    const fs::path root = tkt::temp_dir("older-options"), reference = root / "reference", run = root / "run";
    const std::string sets = "--set run.steps=12 --set run.checkpoint_every=4 ";
    REQUIRE(tk_run(reference, kAccum, sets).rc == 0);
    REQUIRE(tk_run(run, kAccum, sets + "--set run.max_time=\\\"0s\\\"").rc == 0);  // stops after step 1
    // As an older trainkit wrote it: without two options it did not have, both at their default
    // here (the recipe sets neither), one of them a plugin's.
    const std::vector<std::string> newer = {"optimizer.nesterov", "plugins.grad_accum.normalize"};
    int edited = 0;
    for (const auto& ck : fs::directory_iterator(run / "out/checkpoints")) {
      if (!fs::exists(ck.path() / "run.json")) continue;
      auto info = nlohmann::json::parse(tkt::read_text(ck.path() / "run.json"));
      for (const auto& key : newer) REQUIRE(info["recipe"].erase(key) == 1);
      // and with the batch where it stood before [batch]: [data] micro_batch, grad_accum's steps.
      for (const auto& [now, then] : {std::pair<std::string, std::string>{"batch.micro_batch", "data.micro_batch"},
                                      {"batch.accumulation", "plugins.grad_accum.steps"}}) {
        REQUIRE(info["recipe"].contains(now));
        info["recipe"][then] = info["recipe"][now];
        info["recipe"].erase(now);
      }
      std::ofstream(ck.path() / "run.json") << info.dump(1);
      ++edited;
    }
    REQUIRE(edited > 0);
    // Set to anything but its default, a missing option is a change like any other.
    auto nesterov = tk_run(run, kAccum, sets + "--set optimizer.nesterov=true --resume latest");
    INFO(nesterov.out);
    CHECK(nesterov.rc == 2);
    CHECK(has(nesterov, "optimizer.nesterov: (not set) -> true"));
    CHECK(!has(nesterov, "plugins.grad_accum.normalize"));
    auto resumed = tk_run(run, kAccum, sets + "--resume latest");
    INFO(resumed.out);
    REQUIRE(resumed.rc == 0);
    CHECK(has(resumed, "does not record these options"));
    CHECK(has(resumed, "optimizer.nesterov = false"));
    CHECK(has(resumed, "plugins.grad_accum.normalize = \"mean\""));
    check_same_run(run, reference);
    // A record that cannot be read is refused alike by a dry run and a run (exit 2: read again,
    // it is as damaged), naming the file.
    fs::path last;
    for (const auto& ck : fs::directory_iterator(run / "out/checkpoints"))
      if (fs::exists(ck.path() / "run.json") && (last.empty() || ck.path() > last)) last = ck.path();
    REQUIRE(!last.empty());
    std::ofstream(last / "run.json") << "{\"format\": 2, \"world";
    for (const std::string dry : {"--dry-run ", ""}) {
      auto damaged = tk_run(run, kAccum, sets + dry + "--resume latest");
      INFO(damaged.out);
      CHECK(damaged.rc == 2);
      CHECK(has(damaged, (last / "run.json").string() + ": damaged ("));
    }
    fs::remove_all(root);
  }

  TEST_CASE("a 2-rank checkpoint goes on in one process: without accumulation, with micro-batches twice the size") {
    const fs::path root = tkt::temp_dir("world-change");
    const std::string recipe = std::string(kBase) + "[[plugins]]\nname = \"ddp\"\n";
    const std::string sets = "--set run.steps=8 --set run.checkpoint_every=4 ";
    REQUIRE(tk_run(root / "alone", recipe, sets + "--set batch.micro_batch=8").rc == 0);
    REQUIRE(tk_run(root / "moved", recipe, sets + "--nproc 2", "TK_FAULT=checkpoint-done:1").rc == 1);
    auto moved = tk_run(root / "moved", recipe, sets + "--resume latest");
    INFO(moved.out);
    REQUIRE(moved.rc == 0);
    // A mean loss without a plugin that normalizes a window cannot accumulate: the window stays 1.
    CHECK(has(moved, "continuing the run of 2 ranks on 1: 8 examples a step, micro-batches of 8 x 1 per rank"));
    CHECK((weights(root / "moved") - weights(root / "alone")).abs().max().item<double>() <= 1e-12);
    // Killed again on 1 rank, its checkpoint in the split it was carried into: a restart on the
    // same world goes on in that split (not the recipe's 4 x 1, which takes other steps).
    REQUIRE(tk_run(root / "twice", recipe, sets + "--nproc 2", "TK_FAULT=checkpoint-done:1").rc == 1);
    REQUIRE(tk_run(root / "twice", recipe, "--set run.steps=8 --set run.checkpoint_every=2 --resume latest",
                   "TK_FAULT=checkpoint-done:1").rc == 128 + SIGKILL);
    auto twice = tk_run(root / "twice", recipe, sets + "--resume latest");
    INFO(twice.out);
    REQUIRE(twice.rc == 0);
    CHECK(has(twice, "continuing the run in its micro-batches of 8 x 1 per rank (in place of the plan's 4 x 1): 8 examples a step"));
    CHECK((weights(root / "twice") - weights(root / "alone")).abs().max().item<double>() <= 1e-12);
    fs::remove_all(root);
  }

  TEST_CASE("SIGHUP stops like SIGTERM - the printed command continues this very run - a finished run resumes to nothing") {
    const fs::path root = tkt::temp_dir("resume-hint");
    const std::string cmd = tkt::tk_run_command(root, kAccum, "--set run.steps=3000 --set 'optimizer.lr=0.05'");
    auto p = tkt::shell(start_and_wait(cmd, root / "out/metrics.jsonl") + "kill -HUP $pid; wait $pid");
    INFO(p.out);
    REQUIRE(p.rc == 128 + SIGHUP);
    CHECK(has(p, "stopped early (signal)"));
    const auto at = p.out.find("continue with: ");
    REQUIRE(at != std::string::npos);
    const std::string hint = kPluginPath + p.out.substr(at + 15, p.out.find('\n', at) - at - 15);
    INFO(hint);
    CHECK(hint.find("--set optimizer.lr=0.05") != std::string::npos);
    auto resumed = tkt::shell(hint);
    INFO(resumed.out);
    REQUIRE(resumed.rc == 0);
    CHECK(has(resumed, "resuming from"));
    // What this process trained, and where in the run.
    CHECK(has(resumed, " to 3000 of the run"));
    // Resuming the finished run changes nothing: no record, no file.
    const std::string metrics = tkt::read_text(root / "out/metrics.jsonl");
    CHECK(records(root / "out/metrics.jsonl").size() == 3000);
    const auto w = weights(root);
    auto again = tkt::shell(hint);
    CHECK(again.rc == 0);
    CHECK(has(again, "already complete (step 3000"));
    CHECK(tkt::read_text(root / "out/metrics.jsonl") == metrics);
    // Killed after its last checkpoint but before weights.pt: resuming writes them.
    fs::remove(root / "out/weights.pt");
    CHECK(tkt::shell(hint).rc == 0);
    CHECK(torch::equal(weights(root), w));
    fs::remove_all(root);
  }

  TEST_CASE("without checkpoints/latest, resume takes the newest complete checkpoint and says so") {
    const fs::path root = tkt::temp_dir("no-latest");
    REQUIRE(tk_run(root / "whole", kAccum, kAccumSets).rc == 0);
    CHECK(tk_run(root, kAccum, kAccumSets, "TK_FAULT=metrics-written:20").rc == 128 + 9);
    fs::remove(root / "out/checkpoints/latest");
    fs::create_directories(root / "out/checkpoints/step-00000019.tmp");  // a partial one is never taken
    auto p = tk_run(root, kAccum, kAccumSets + "--resume latest");
    INFO(p.out);
    REQUIRE(p.rc == 0);
    CHECK(has(p, "is missing; taking the newest complete one, step-00000018"));
    check_same_run(root, root / "whole");
    fs::remove_all(root);
  }

  TEST_CASE("killed at any instant, a resumed run ends identical, weights and every record") {
    const fs::path root = tkt::temp_dir("kill-anywhere");
    REQUIRE(tk_run(root / "whole", kAccum, kAccumSets).rc == 0);
    // Deterministic: right after a record, inside a checkpoint, after its rename, after `latest`,
    // after the last record.
    for (const char* fault : {"metrics-written:8", "checkpoint-partial:3", "checkpoint-renamed:3", "checkpoint-done:3",
                              "metrics-written:40"}) {
      CAPTURE(fault);
      const fs::path dir = root / "fault";
      fs::remove_all(dir);
      CHECK(tk_run(dir, kAccum, kAccumSets, std::string("TK_FAULT=") + fault).rc == 128 + 9);
      auto resumed = tk_run(dir, kAccum, kAccumSets + "--resume latest");
      INFO(resumed.out);
      REQUIRE(resumed.rc == 0);
      check_same_run(dir, root / "whole");
    }
    // Random: SIGKILL at random moments of a longer run, resuming after each, until it completes.
    const std::string long_sets = "--set run.steps=2000 --set run.checkpoint_every=7 ";
    REQUIRE(tk_run(root / "long", kAccum, long_sets).rc == 0);
    std::mt19937 rng(1234);
    const fs::path dir = root / "random";
    const std::string first = tkt::tk_run_command(dir, kAccum, long_sets + "--overwrite");
    const std::string again = tkt::tk_run_command(dir, kAccum, long_sets + "--resume latest");
    int kills = 0;
    for (int round = 0; round < 8; ++round) {
      const std::string cmd = fs::exists(dir / "out/checkpoints/latest") ? again : first;
      const int ms = std::uniform_int_distribution<int>(500, 2500)(rng);
      auto p = tkt::shell("(" + cmd + ") & pid=$!; sleep " + std::to_string(ms / 1000.0) +
                          "; kill -KILL $pid 2>/dev/null; wait $pid");
      if (p.rc == 0) break;
      ++kills;
    }
    auto last = tkt::shell(fs::exists(dir / "out/checkpoints/latest") ? again : first);
    INFO(last.out);
    REQUIRE(last.rc == 0);
    CHECK(kills > 0);
    check_same_run(dir, root / "long");
    fs::remove_all(root);
  }

  TEST_CASE("workers die with their launcher") {
    const fs::path root = tkt::temp_dir("orphans");
    const std::string cmd = tkt::tk_run_command(root, std::string(kBase) + "[[plugins]]\nname = \"ddp\"\n",
                                                "--nproc 2 --set run.steps=100000");
    const std::string recipe = (root / "recipe.toml").string();
    // Live processes whose command line names this test's recipe (a zombie's is empty).
    auto running = [&] {
      int n = 0;
      std::error_code ec;
      for (const auto& e : fs::directory_iterator("/proc", ec)) {
        const std::string pid = e.path().filename().string();
        if (pid.find_first_not_of("0123456789") != std::string::npos) continue;
        if (tkt::read_text(e.path() / "cmdline").find(recipe) != std::string::npos) ++n;
      }
      return n;
    };
    REQUIRE(std::system(("(" + cmd + " > " + (root / "log").string() + " 2>&1 & echo $! > " + (root / "pid").string() +
                         ")").c_str()) == 0);
    REQUIRE(wait_for(root / "out/metrics.jsonl"));
    CHECK(running() == 3);  // the launcher and its two workers
    kill(std::stoi(tkt::read_text(root / "pid")), SIGKILL);
    for (int i = 0; i < 100 && running() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    CHECK(running() == 0);
    fs::remove_all(root);
  }

  TEST_CASE("a rank that hangs is named") {
    const fs::path root = tkt::temp_dir("hung-rank");
    auto p = tk_run(root, std::string(kBase) + "[[plugins]]\nname = \"ddp\"\n[world]\ntimeout_s = 5.0\n" +
                              "[[plugins]]\nname = \"probe\"\nstop_at_step = 2\nonly_rank = 1\n",
                    "--nproc 2");
    INFO(p.out);
    CHECK(p.rc == 1);
    CHECK(has(p, "tk-run: rank 1 hung: rank 0 timed out waiting for it"));
    fs::remove_all(root);
  }
}
