// tk-plugin new: a plugin project that configures, builds and passes its tests as it is.
#include "scaffold.h"

#include <tk/version.h>

#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <vector>

namespace fs = std::filesystem;

namespace tk {
namespace {

const char* kCMake = R"(cmake_minimum_required(VERSION 3.18)
project(@NAME@ VERSION 0.1.0 LANGUAGES CXX)

# trainkit's package: trainkit::core, trainkit::testing, tk_add_plugin(), tk_add_plugin_test().
# Point CMake at an installed trainkit with -DCMAKE_PREFIX_PATH=<prefix> if it is not in /usr.
find_package(trainkit @TK_SERIES@ REQUIRED)

# Builds tk_@NAME@.so, the file a recipe loads, as the target tk_plugin_@NAME@.
tk_add_plugin(@NAME@ SOURCES src/@NAME@.cpp)

enable_testing()
# Registers the plugin contract (tk-plugin check, ctest @NAME@.contract) and the unit tests
# (ctest @NAME@.tests), built as the target @NAME@_tests.
tk_add_plugin_test(@NAME@ TESTS tests/@NAME@_test.cpp)

# Flags of your own go on those targets, for example:
#   target_compile_options(tk_plugin_@NAME@ PRIVATE -march=native)
#   target_link_libraries(@NAME@_tests PRIVATE my_test_helpers)
# The plugin guide (@GUIDE@) describes both functions.
)";

const char* kSource = R"(// @NAME@: a trainkit plugin. It counts the micro-batches of every optimizer step, writes the
// count to metrics.jsonl as `@NAME@_micro_batches`, and at the end of a completed run writes
// @NAME@.txt into the output folder; replace that with what your strategy does.
#include <tk/abi.h>

namespace {

class @CLASS@ final : public tk::Plugin {
 public:
  /// Options a recipe may set in this plugin's [[plugins]] entry (name and path are reserved),
  /// each bound to the member that holds it; the member's value here is the default.
  void bind(tk::OptionBinder& o) override { o.add("enabled", enabled_, "record the micro-batch count of every step"); }
  /// The recipe's values are in the members now; refuse a bad one with fail_option(member, "why").
  void init() override {}
  /// What this plugin provides and what must run before it (names from tk/capabilities.h).
  tk::Contract contract() const override { return {}; }
  /// Adjusts the run plan (accumulation window, world) before training.
  void configure(tk::RunPlan& plan) override {}
  /// Once, after the model is built and before the optimizer exists: may freeze or wrap it.
  void setup(tk::SetupContext& setup) override {}

  // Hooks, in the order the loop calls them. Delete the ones you do not need: a hook that is not
  // overridden costs nothing. Each gets its event's context, with the calls that belong to the
  // event (tk/context.h): ctx.gradients() and a changeable ctx.optimizer() at the boundary, say.
  /// Once before the first epoch (after load_state when resuming).
  void on_fit_start(tk::FitStartContext& ctx) override {}
  /// Before an epoch's first micro-batch.
  void on_epoch_start(tk::EpochStartContext& ctx) override {}
  /// A micro-batch was fetched; before its forward pass.
  void on_micro_batch(tk::MicroBatchContext& ctx) override { ++micro_batches_; }
  /// The loss is ready; ctx.set_loss() may replace it before backward.
  void on_loss(tk::LossContext& ctx) override {}
  /// This micro-batch's gradients were added in.
  void on_backward(tk::BackwardContext& ctx) override {}
  /// The window is complete; before the optimizer step (sync, normalize, unscale, clip, veto).
  void on_boundary(tk::BoundaryContext& ctx) override {
    if (enabled_) ctx.metric("@NAME@_micro_batches", static_cast<double>(micro_batches_));
    micro_batches_ = 0;
  }
  /// After the optimizer step (or its veto).
  void on_step_end(tk::StepEndContext& ctx) override { ++steps_; }
  /// After an epoch's last micro-batch.
  void on_epoch_end(tk::EpochEndContext& ctx) override {}
  /// Before a validation pass.
  void on_validation_start(tk::ValidationStartContext& ctx) override {}
  /// After a validation pass; ctx.validation_loss() is set.
  void on_validation_end(tk::ValidationEndContext& ctx) override {}
  /// Once at the end, however the run ended (ctx.status()).
  void on_fit_end(tk::FitEndContext& ctx) override {}

  /// At the end of a completed run (rank 0, outputs on): this plugin's files, which the core
  /// lists, deletes with the run on --overwrite, and writes again on a resume that finds one lost.
  void write_files(tk::OutputFiles& files) override {
    files.write_text("@NAME@.txt", "optimizer steps seen: " + std::to_string(steps_) + "\n");
  }
  /// What a checkpoint keeps of this plugin.
  tk::StateDict state() const override { return {{"steps", torch::tensor(steps_)}}; }
  /// Restores it; on a resume, before on_fit_start.
  void load_state(const tk::StateDict& s) override { steps_ = s.at("steps").item<int64_t>(); }

 private:
  bool enabled_ = true;
  int64_t micro_batches_ = 0, steps_ = 0;
};

}  // namespace

TK_PLUGIN(@CLASS@, "@NAME@", "0.1.0", "counts the micro-batches of every optimizer step")
)";

const char* kTest = R"(// Unit tests of @NAME@, run in process with trainkit::testing.
#include <tk/doctest.h>

TEST_CASE("@NAME@ records the micro-batches of every optimizer step") {
  tk::testing::RunOptions opts;
  opts.libraries = {{TK_PLUGIN_FILE, ""}};
  // k = 4 micro-batches per step ([batch]), normalized by trainkit's own accumulation plugin.
  opts.libraries.push_back({TK_PLUGIN_DIR "/tk_grad_accum.so", ""});
  opts.overrides = {"batch.accumulation=4"};
  const auto run = tk::testing::run(tk::testing::kTinyRecipe, opts);
  REQUIRE(run.fit.step_metrics.size() == 6);
  for (const auto& step : run.fit.step_metrics) CHECK(step.at("@NAME@_micro_batches") == 4.0);
}

TEST_CASE("@NAME@'s options: defaults, a value given, a mistyped one refused") {
  auto plugin = tk::testing::load_plugin(TK_PLUGIN_FILE, "enabled = false");
  CHECK(plugin->options().get_bool("enabled") == false);
  tk::testing::RunOptions opts;
  opts.plugins = {plugin};
  const auto run = tk::testing::run(tk::testing::kTinyRecipe, opts);
  for (const auto& step : run.fit.step_metrics) CHECK(step.count("@NAME@_micro_batches") == 0);
  CHECK_THROWS_AS(tk::testing::load_plugin(TK_PLUGIN_FILE, "enabled = 3"), tk::RecipeError);
}

TEST_CASE("@NAME@ leaves the training itself unchanged") {
  tk::testing::RunOptions with;
  with.libraries = {{TK_PLUGIN_FILE, ""}};
  const auto a = tk::testing::run(tk::testing::kTinyRecipe, with);
  const auto b = tk::testing::run(tk::testing::kTinyRecipe);
  CHECK(tk::testing::identical(a.parameters, b.parameters));
}
)";

const char* kRecipe = R"(# Trains a small MLP with the @NAME@ plugin. From this folder, after building into build/:
#   tk-run recipe.toml
[run]
name = "@NAME@-demo"
seed = 1
epochs = 2

[model]
name = "mlp"
hidden = [64]

[data]
name = "synthetic-classification"
samples = 2048

[batch]
micro_batch = 32
accumulation = 4   # micro-batches a step, normalized by the grad_accum plugin

[optimizer]
name = "adamw"
lr = 0.003

[[plugins]]
name = "grad_accum"

[[plugins]]
path = "build/tk_@NAME@.so"   # relative to this recipe
)";

const char* kReadme = R"(# @NAME@

A trainkit plugin. Build, test and try it:

```sh
cmake -S . -B build -G Ninja          # add -DCMAKE_PREFIX_PATH=<prefix> for a trainkit installed elsewhere
cmake --build build
ctest --test-dir build --output-on-failure   # the plugin contract and tests/@NAME@_test.cpp
tk-run recipe.toml                    # metrics.jsonl gets @NAME@_micro_batches every step; @NAME@.txt at the end
tk-plugin info build/tk_@NAME@.so     # what the library declares
```

- `src/@NAME@.cpp`: the plugin; every hook is there with a one-line doc. Delete the ones you do not
  need.
- `tests/@NAME@_test.cpp`: unit tests with trainkit::testing (`tk/testing.h`): whole runs in
  process, parameter comparison, capture and veto fixtures.
- `recipe.toml`: a run that loads the plugin by path.

The plugin guide, @GUIDE@, describes the loop, the context, contracts, the CMake functions and
targets, testing and the rules of the ABI (`tk-plugin --help` prints where it is).
)";

std::string fill(std::string text, const std::string& name, const std::string& cls) {
  // The trainkit these headers belong to: a plugin project asks for its series (major.minor).
  const std::string series = std::to_string(TK_VERSION_MAJOR) + "." + std::to_string(TK_VERSION_MINOR);
  for (const auto& [key, value] :
       {std::pair<std::string, std::string>{"@NAME@", name}, {"@CLASS@", cls}, {"@TK_SERIES@", series}, {"@GUIDE@", plugin_guide()}})
    for (size_t pos; (pos = text.find(key)) != std::string::npos;) text.replace(pos, key.size(), value);
  return text;
}

}  // namespace

std::string plugin_guide() {
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const fs::path guide = (self.parent_path() / TK_BIN_TO_DOC / "plugins.md").lexically_normal();
    if (fs::is_regular_file(guide, ec)) return guide.string();
  }
  return "docs/plugins.md in trainkit's source (installed: <prefix>/share/doc/trainkit/plugins.md)";
}

int scaffold(const std::string& name, const std::string& dir) {
  if (name.empty() || !std::isalpha(static_cast<unsigned char>(name[0])))
    throw std::invalid_argument("a plugin name starts with a letter, got '" + name + "'");
  for (char ch : name)
    if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '_')
      throw std::invalid_argument("a plugin name has letters, digits and _ only, got '" + name + "'");
  const fs::path root(dir);
  std::error_code ec;
  if (fs::exists(root, ec) && !fs::is_empty(root, ec))
    throw std::invalid_argument("'" + dir + "' exists and is not empty");
  std::string cls;
  bool upper = true;
  for (char ch : name) {
    if (ch == '_') {
      upper = true;
      continue;
    }
    cls += upper ? static_cast<char>(std::toupper(static_cast<unsigned char>(ch))) : ch;
    upper = false;
  }
  const std::vector<std::pair<fs::path, const char*>> files = {
      {"CMakeLists.txt", kCMake}, {fs::path("src") / (name + ".cpp"), kSource},
      {fs::path("tests") / (name + "_test.cpp"), kTest}, {"recipe.toml", kRecipe}, {"README.md", kReadme}};
  for (const auto& [rel, text] : files) {
    fs::create_directories((root / rel).parent_path());
    std::ofstream out(root / rel);
    out << fill(text, name, cls);
    if (!out) throw std::runtime_error("cannot write " + (root / rel).string());
    std::printf("wrote %s\n", (root / rel).c_str());
  }
  std::printf("next: cd %s && cmake -S . -B build -G Ninja && cmake --build build && ctest --test-dir build\n",
              root.c_str());
  return 0;
}

}  // namespace tk
