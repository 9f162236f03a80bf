#pragma once
// tk-run as a child process: run it on a recipe, read what it wrote.
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <tk/tensor_io.h>

#include <chrono>
#include <cstdio>
#include <fstream>

#include "support.h"

namespace tkt {

/// A small float64 run: 6 steps of an MLP on synthetic classes, every number exactly reproducible.
inline const char* kBase = R"(
[run]
seed = 9
steps = 6
dtype = "float64"

[model]
name = "mlp"
hidden = [16]
activation = "tanh"

[data]
name = "synthetic-classification"
samples = 256
validation_samples = 0
features = 8
classes = 4

[batch]
micro_batch = 4

[optimizer]
name = "sgd"
lr = 0.1
momentum = 0.9
)";

struct Proc {
  int rc = -1;
  std::string out;
  double seconds = 0;
};

/// Runs a shell command, returning its exit code (128 + signal when killed) and its output.
inline Proc shell(const std::string& cmd) {
  Proc p;
  auto t0 = std::chrono::steady_clock::now();
  FILE* f = popen((cmd + " 2>&1").c_str(), "r");
  REQUIRE(f != nullptr);
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, f)) > 0;) p.out.append(buf, n);
  int status = pclose(f);
  p.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  p.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return p;
}

/// A collective timeout far longer than any run of these tests: a world that stops within it stopped
/// because its launcher saw the failure, not because a collective gave up waiting.
inline constexpr const char* kLongTimeout = "[world]\ntimeout_s = 600.0\n";

/// Whether `out` reports a collective's timeout (as Gloo, NCCL and tk-run say it), not the option's name.
inline bool reports_timeout(const std::string& out) {
  std::string low = out;
  for (auto& ch : low) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  for (size_t at = low.find("timeout"); at != std::string::npos; at = low.find("timeout", at + 1))
    if (low.compare(at, 9, "timeout_s") != 0) return true;
  return low.find("timed out") != std::string::npos;
}

/// The tk-run command for `DIR/recipe.toml` (written from `recipe_text`) with outputs in DIR/out.
inline std::string tk_run_command(const std::filesystem::path& dir, const std::string& recipe_text,
                                  const std::string& args) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "recipe.toml") << recipe_text;
  return "TK_PLUGIN_PATH=" + std::string(TK_TEST_PLUGIN_DIR) + " " + TK_RUN_EXE + " " + (dir / "recipe.toml").string() +
         " --progress plain --set run.output=\\\"" + (dir / "out").string() + "\\\" " + args;
}

/// Runs tk-run on `recipe_text` (written to DIR/recipe.toml) with `args`; outputs go to DIR/out.
inline Proc tk_run(const std::filesystem::path& dir, const std::string& recipe_text, const std::string& args,
                   const std::string& env = "") {
  return shell(env + (env.empty() ? "" : " ") + tk_run_command(dir, recipe_text, args));
}

/// The weights a run in DIR/out wrote, as one flat tensor.
inline torch::Tensor weights(const std::filesystem::path& dir) {
  std::vector<torch::Tensor> parts;
  for (const auto& [name, t] : tk::load_tensor_dict(dir / "out/weights.pt")) parts.push_back(t.reshape({-1}));
  return torch::cat(parts);
}

/// Every record of a metrics.jsonl, without what differs between identical runs (time, memory: every
/// "*_ms" among them).
inline std::vector<nlohmann::json> records(const std::filesystem::path& file) {
  std::ifstream in(file);
  std::vector<nlohmann::json> out;
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    for (const char* timed : {"wall_time", "peak_rss_mib", "examples_per_s", "tokens_per_s", "gflops", "mfu", "data_ms",
                              "forward_ms", "backward_ms", "boundary_ms", "optimizer_ms", "validation_ms"})
      j.erase(timed);
    for (auto it = j.begin(); it != j.end();)  // a plugin's times too (ddp_wait_ms, ...)
      it = it.key().size() > 3 && it.key().compare(it.key().size() - 3, 3, "_ms") == 0 ? j.erase(it) : std::next(it);
    out.push_back(j);
  }
  return out;
}

/// The same run in DIR/out as in REFERENCE/out: weights and every record (but time and memory) alike.
inline void check_same_run(const std::filesystem::path& dir, const std::filesystem::path& reference) {
  CHECK(torch::equal(weights(dir), weights(reference)));
  const auto got = records(dir / "out/metrics.jsonl"), want = records(reference / "out/metrics.jsonl");
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("record " << i);
    CHECK(got[i] == want[i]);
  }
}

/// The whole text of a file ("" when missing).
inline std::string read_text(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace tkt
