// Unit tests of ema, run in process with trainkit::testing: the average against a reference
// computed here from the weights of every step, vetoed steps, start_step, the weights file, and a
// stopped and resumed run.
#include <tk/tensor_io.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <tk/doctest.h>  // last: it settles the CHECK macros of LibTorch's logging

namespace fs = std::filesystem;
using tk::testing::Parameters;

namespace {

/// An instance of the plugin with options given as TOML, as a [[plugins]] entry would make it;
/// the test keeps it to read its state after the run.
std::shared_ptr<tk::Plugin> make_ema(const std::string& options) { return tk::testing::load_plugin(TK_PLUGIN_FILE, options); }

/// The average an instance holds, by parameter name.
Parameters average_of(const tk::Plugin& ema) {
  Parameters out;
  for (const auto& [key, t] : ema.state())
    if (key.rfind("avg.", 0) == 0) out.emplace(key.substr(4), t);
  return out;
}

/// A copy of a model's parameters.
Parameters parameters_of(tk::Model& model) {
  Parameters out;
  for (const auto& p : model.named_parameters()) out.emplace(p.key(), p.value().detach().clone());
  return out;
}

/// Records the weights at the start of the run and after every optimizer step.
class Recorder final : public tk::Plugin {
 public:
  void on_fit_start(tk::FitStartContext& ctx) override { snapshots.push_back(parameters_of(ctx.model())); }
  void on_step_end(tk::StepEndContext& ctx) override { snapshots.push_back(parameters_of(ctx.model())); }
  /// snapshots[0]: the initial weights; snapshots[k]: the weights after step k - 1 (0-based).
  std::vector<Parameters> snapshots;
};

/// The average computed independently of the plugin: it starts at snapshots[first], then takes in
/// every later snapshot except those whose index is in `skip`.
Parameters reference(const std::vector<Parameters>& snapshots, double decay, size_t first,
                     const std::set<size_t>& skip = {}) {
  Parameters avg = snapshots.at(first);
  for (size_t k = first + 1; k < snapshots.size(); ++k) {
    if (skip.count(k)) continue;
    for (auto& [name, a] : avg) a = a * decay + snapshots[k].at(name) * (1.0 - decay);
  }
  return avg;
}

/// The ema_updates metric of every step.
std::vector<double> updates_of(const tk::testing::RunResult& run) {
  std::vector<double> out;
  for (const auto& step : run.fit.step_metrics) out.push_back(step.at("ema_updates"));
  return out;
}

/// A fresh, empty temporary folder for one test.
fs::path temp_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("tk-ema-test-" + std::to_string(getpid()) + "-" + name);
  fs::remove_all(d);
  return d;
}

/// A tensor file read back by name.
Parameters read_weights(const fs::path& file) {
  Parameters out;
  for (auto& [name, t] : tk::load_tensor_dict(file)) out.emplace(name, t);
  return out;
}

}  // namespace

TEST_CASE("with decay 0 the average is exactly the final weights") {
  auto ema = make_ema("decay = 0.0");
  tk::testing::RunOptions opts;
  opts.plugins = {ema};
  const auto run = tk::testing::run(tk::testing::kTinyRecipe, opts);
  CHECK(run.fit.steps == 6);
  CHECK(tk::testing::identical(average_of(*ema), run.parameters));
}

TEST_CASE("the average is decay * average + (1 - decay) * weights after every step") {
  auto ema = make_ema("decay = 0.5");
  auto recorder = std::make_shared<Recorder>();
  tk::testing::RunOptions opts;
  opts.plugins = {ema, {recorder, "recorder"}};
  const auto run = tk::testing::run(tk::testing::kTinyRecipe, opts);
  REQUIRE(recorder->snapshots.size() == 7);
  const Parameters expected = reference(recorder->snapshots, 0.5, 0);
  CHECK(tk::testing::max_difference(average_of(*ema), expected) <= 1e-12);
  CHECK(tk::testing::max_difference(average_of(*ema), run.parameters) > 0.0);
  const std::vector<double> updates = {1, 2, 3, 4, 5, 6};
  CHECK(updates_of(run) == updates);
}

TEST_CASE("a vetoed step is not averaged") {
  auto ema = make_ema("decay = 0.5");
  auto recorder = std::make_shared<Recorder>();
  tk::testing::RunOptions opts;
  opts.plugins = {ema, {recorder, "recorder"}, {std::make_shared<tk::testing::VetoAt>(std::set<int64_t>{2}), "veto_at"}};
  const auto run = tk::testing::run(tk::testing::kTinyRecipe, opts);
  CHECK(run.fit.skipped_steps == 1);
  const std::vector<double> updates = {1, 2, 2, 3, 4, 5};
  CHECK(updates_of(run) == updates);
  REQUIRE(recorder->snapshots.size() == 7);
  const Parameters expected = reference(recorder->snapshots, 0.5, 0, {3});  // snapshot 3: after step 2
  CHECK(tk::testing::max_difference(average_of(*ema), expected) <= 1e-12);
}

TEST_CASE("before start_step the average follows the weights") {
  auto ema = make_ema("decay = 0.5\nstart_step = 3");
  auto recorder = std::make_shared<Recorder>();
  tk::testing::RunOptions opts;
  opts.plugins = {ema, {recorder, "recorder"}};
  const auto run = tk::testing::run(tk::testing::kTinyRecipe, opts);
  const std::vector<double> updates = {0, 0, 0, 1, 2, 3};
  CHECK(updates_of(run) == updates);
  REQUIRE(recorder->snapshots.size() == 7);
  const Parameters expected = reference(recorder->snapshots, 0.5, 3);  // from the weights after step 2
  CHECK(tk::testing::max_difference(average_of(*ema), expected) <= 1e-12);
}

TEST_CASE("a decay outside [0, 1) is refused at its recipe position") {
  for (const char* bad : {"decay = 1.0", "decay = -0.5"}) {
    CAPTURE(bad);
    tk::testing::RunOptions opts;
    opts.libraries = {{TK_PLUGIN_FILE, bad}};
    CHECK_THROWS_WITH_AS(tk::testing::run(tk::testing::kTinyRecipe, opts), doctest::Contains("plugins.ema.decay"),
                         tk::RecipeError);
  }
}

TEST_CASE("a file name that is no plain file name is refused when the plugin is made, before training") {
  for (const char* bad : {"file = \"sub/x.pt\"", "file = \"weights.pt\"", "file = \".hidden\""}) {
    CAPTURE(bad);
    CHECK_THROWS_WITH_AS(tk::testing::load_plugin(TK_PLUGIN_FILE, bad), doctest::Contains("plugins.ema.file"),
                         tk::RecipeError);
    const fs::path dir = temp_dir("badname");
    tk::testing::RunOptions opts;
    opts.libraries = {{TK_PLUGIN_FILE, bad}};
    opts.output = dir;
    CHECK_THROWS_AS(tk::testing::run(tk::testing::kTinyRecipe, opts), tk::RecipeError);
    CHECK_FALSE(fs::exists(dir / "metrics.jsonl"));  // nothing trained
    fs::remove_all(dir);
  }
  CHECK(tk::OutputFiles::name_error("average.pt").empty());
  CHECK(tk::OutputFiles::name_error("sub/x.pt").find("not a plain file name") != std::string::npos);
  auto ema = make_ema("file = \"average.pt\"");
  const fs::path dir = temp_dir("named");
  tk::testing::RunOptions opts;
  opts.plugins = {ema};
  opts.output = dir;
  tk::testing::run(tk::testing::kTinyRecipe, opts);
  CHECK(fs::exists(dir / "average.pt"));
  CHECK_FALSE(fs::exists(dir / "ema_weights.pt"));
  fs::remove_all(dir);
}

TEST_CASE("a completed run with outputs writes ema_weights.pt, named like the parameters") {
  const fs::path dir = temp_dir("weights");
  tk::testing::RunOptions opts;
  opts.libraries = {{TK_PLUGIN_FILE, "decay = 0.9"}};
  opts.output = dir;
  const auto run = tk::testing::run(tk::testing::kTinyRecipe, opts);
  const fs::path file = dir / "ema_weights.pt";
  REQUIRE(fs::exists(file));
  const tk::NamedTensors saved = tk::load_tensor_dict(file);
  CHECK(saved.size() == run.parameters.size());
  std::set<std::string> names;
  for (const auto& entry : saved) {
    const std::string& name = entry.first;
    CAPTURE(name);
    names.insert(name);
    auto it = run.parameters.find(name);
    REQUIRE(it != run.parameters.end());
    CHECK((entry.second.sizes() == it->second.sizes()));
    CHECK((entry.second.scalar_type() == it->second.scalar_type()));
  }
  CHECK(names.size() == saved.size());
  // The run lists it among the files it wrote.
  const auto& files = run.fit.files;
  CHECK(std::find(files.begin(), files.end(), "ema_weights.pt") != files.end());
  fs::remove_all(dir);
}

TEST_CASE("a resume of the finished run writes ema_weights.pt again when it is lost, and --overwrite deletes it") {
  const fs::path dir = temp_dir("again");
  tk::testing::RunOptions opts;
  opts.libraries = {{TK_PLUGIN_FILE, "decay = 0.9"}};
  opts.output = dir;
  tk::testing::run(tk::testing::kTinyRecipe, opts);
  const Parameters written = read_weights(dir / "ema_weights.pt");
  fs::remove(dir / "ema_weights.pt");
  tk::testing::RunOptions resume = opts;
  resume.resume = "latest";
  const auto again = tk::testing::run(tk::testing::kTinyRecipe, resume);
  CHECK(again.fit.already_complete);
  REQUIRE(fs::exists(dir / "ema_weights.pt"));
  CHECK(tk::testing::identical(read_weights(dir / "ema_weights.pt"), written));
  CHECK(again.fit.files == std::vector<std::string>{"ema_weights.pt"});
  // Nothing is missing: a second resume writes nothing.
  CHECK(tk::testing::run(tk::testing::kTinyRecipe, resume).fit.files.empty());
  // --overwrite starts the folder over: the old run's plugin file goes with it, though the new run
  // has no ema.
  tk::testing::RunOptions over;
  over.output = dir;
  over.overwrite = true;
  tk::testing::run(tk::testing::kTinyRecipe, over);
  CHECK_FALSE(fs::exists(dir / "ema_weights.pt"));
  CHECK(fs::exists(dir / "weights.pt"));
  fs::remove_all(dir);
}

TEST_CASE("the average survives a stop at a checkpoint and a resume") {
  const fs::path whole_dir = temp_dir("whole"), split_dir = temp_dir("split");
  tk::testing::RunOptions whole;
  whole.libraries = {{TK_PLUGIN_FILE, "decay = 0.7"}};
  whole.output = whole_dir;
  tk::testing::run(tk::testing::kTinyRecipe, whole);

  tk::testing::RunOptions first = whole;
  first.output = split_dir;
  int boundaries = 0;
  first.stop_requested = [&boundaries] { return ++boundaries == 3; };
  const auto stopped = tk::testing::run(tk::testing::kTinyRecipe, first);
  // The stop comes after the third optimizer step: that step is taken, recorded and checkpointed.
  CHECK(stopped.fit.status == tk::FitStatus::StoppedBySignal);
  CHECK(stopped.fit.stopped == "signal");
  CHECK(stopped.fit.steps == 3);
  CHECK(boundaries == 3);
  REQUIRE(stopped.fit.step_metrics.size() == 3);
  CHECK(stopped.fit.step_metrics.back().at("ema_updates") == 3.0);
  CHECK(stopped.fit.checkpoint.filename() == "step-00000003");
  CHECK_FALSE(fs::exists(split_dir / "ema_weights.pt"));  // written by completed runs only

  tk::testing::RunOptions second = first;
  second.stop_requested = nullptr;
  second.resume = "latest";
  const auto resumed = tk::testing::run(tk::testing::kTinyRecipe, second);
  CHECK(resumed.fit.status == tk::FitStatus::Completed);
  REQUIRE_FALSE(resumed.fit.step_metrics.empty());
  CHECK(resumed.fit.step_metrics.back().at("ema_updates") == 6.0);
  REQUIRE(fs::exists(split_dir / "ema_weights.pt"));
  CHECK(tk::testing::identical(read_weights(whole_dir / "ema_weights.pt"), read_weights(split_dir / "ema_weights.pt")));
  fs::remove_all(whole_dir);
  fs::remove_all(split_dir);
}

namespace {
/// Fails in write_files while `fail` is set: a run whose end goes wrong after its last checkpoint.
class FailingFiles final : public tk::Plugin {
 public:
  void write_files(tk::OutputFiles&) override {
    if (fail) throw std::runtime_error("the disk is gone");
  }
  bool fail = true;
};

std::string status_of(const fs::path& dir) {
  std::ifstream in(dir / "status.json");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto at = text.find("\"status\":\"");
  return at == std::string::npos ? text : text.substr(at + 10, text.find('"', at + 10) - at - 10);
}
}  // namespace

TEST_CASE("a run whose files failed at its end is completed by the resume that writes them") {
  const fs::path dir = temp_dir("failed-end");
  auto failing = std::make_shared<FailingFiles>();
  tk::testing::RunOptions opts;
  opts.libraries = {{TK_PLUGIN_FILE, "decay = 0.9"}};
  opts.plugins = {{failing, "failing_files"}};
  opts.output = dir;
  CHECK_THROWS_WITH(tk::testing::run(tk::testing::kTinyRecipe, opts), doctest::Contains("the disk is gone"));
  CHECK(status_of(dir) == "failed");
  failing->fail = false;
  fs::remove(dir / "ema_weights.pt");
  tk::testing::RunOptions resume = opts;
  resume.resume = "latest";
  const auto again = tk::testing::run(tk::testing::kTinyRecipe, resume);
  CHECK(again.fit.already_complete);
  CHECK(fs::exists(dir / "ema_weights.pt"));
  CHECK(status_of(dir) == "completed");
  fs::remove_all(dir);
}
