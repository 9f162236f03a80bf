// The plugin API's guarantees: the layout signature covers Plugin's virtual table; options are
// declared once, bound to members and refused when malformed; calls made in a hook they do not
// belong to are refused naming plugin, hook and call; a base hook called from an override changes
// nothing; a plugin's files are its own.
#include <tk/abi.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>

#include "support.h"

namespace fs = std::filesystem;

namespace {

/// The virtual-table slot a pointer to a virtual member function names (Itanium C++ ABI: on
/// x86-64 the pointer holds 1 + the slot's byte offset; on AArch64 the offset, with the virtual
/// bit in the adjustment).
template <class M>
std::ptrdiff_t slot_of(M member) {
  struct Rep {
    std::uintptr_t ptr;
    std::ptrdiff_t adj;
  };
  static_assert(sizeof(M) == sizeof(Rep), "a pointer to member function of the Itanium ABI");
  Rep r{};
  std::memcpy(&r, &member, sizeof r);
#if defined(__aarch64__)
  REQUIRE((r.adj & 1) == 1);
  return static_cast<std::ptrdiff_t>(r.ptr / sizeof(void*));
#else
  REQUIRE((r.ptr & 1) == 1);
  return static_cast<std::ptrdiff_t>((r.ptr - 1) / sizeof(void*));
#endif
}

/// Plugin with one virtual function more: its slot is the first after Plugin's own.
struct OneMore : tk::Plugin {
  virtual void sentinel() {}
};

/// Overrides on_micro_batch and calls the base hook from it, as a habit from other frameworks.
class CallsBase final : public tk::Plugin {
 public:
  void on_micro_batch(tk::MicroBatchContext& ctx) override {
    ++calls;
    tk::Plugin::on_micro_batch(ctx);
  }
  int calls = 0;
};

/// A plugin class with a subclass that overrides one hook more.
struct BaseCounts : tk::Plugin {
  void on_boundary(tk::BoundaryContext&) override { ++boundaries; }
  int boundaries = 0;
};
struct DerivedCounts final : BaseCounts {
  void on_micro_batch(tk::MicroBatchContext&) override { ++micro_batches; }
  int micro_batches = 0;
};

/// Gives a metric, a veto flag or an on_fit_end failure, as its option says.
class Gives final : public tk::Plugin {
 public:
  void bind(tk::OptionBinder& o) override {
    o.add("what", what_, "what to give",
          {"core_key", "empty_tensor", "two_elements", "fit_end_throws", "fit_end", "norm", "norm_tensor", "state_throws",
           "validation_norm", "norm_first", "norm_later", "norm_everywhere"});
  }
  void on_boundary(tk::BoundaryContext& ctx) override {
    if (what_ == "core_key") ctx.metric("loss", 1.0);
    ++boundaries_;
    if (what_ == "norm" || what_ == "norm_everywhere") ctx.metric("norm", 1.0);
    if ((what_ == "norm_first" && boundaries_ == 1) || (what_ == "norm_later" && boundaries_ > 1))
      ctx.metric("norm", 1.0);
    if (what_ == "norm_tensor") ctx.metric("norm", torch::ones({}));
    if (what_ == "empty_tensor") ctx.metric("x", torch::zeros({0}));
    if (what_ == "two_elements") ctx.veto_step_if(torch::zeros({2}), "no");
  }
  void on_validation_end(tk::ValidationEndContext& ctx) override {
    if (what_ == "validation_norm" || what_ == "norm_everywhere") ctx.metric("norm", 2.0);
  }
  void on_fit_end(tk::FitEndContext&) override {
    ++fit_ends;
    if (what_ == "fit_end_throws") throw std::runtime_error("cleanup failed");
  }
  tk::StateDict state() const override {
    if (what_ == "state_throws") throw std::runtime_error("no state");
    return {};
  }
  int fit_ends = 0;

 private:
  std::string what_ = "fit_end";
  int boundaries_ = 0;
};

/// Options bound to members, with where each was set.
class Bound final : public tk::Plugin {
 public:
  enum class Mode { Fast, Exact };
  void bind(tk::OptionBinder& o) override {
    o.add("steps", steps, "steps");
    o.add("rate", rate, "a rate");
    o.add("label", label, "a label");
    o.path("file", file, "a file");
    o.add("sizes", sizes, "sizes");
    o.choice("mode", mode, "how", {{"fast", Mode::Fast}, {"exact", Mode::Exact}});
  }
  void init() override {
    if (steps < 0) fail_option(steps, "must be >= 0");
    given = option_given(rate);
  }
  int64_t steps = 3;
  double rate = 0.5;
  std::string label = "x", file;
  std::vector<int64_t> sizes = {1, 2};
  Mode mode = Mode::Exact;
  bool given = false;
};

/// A plugin whose options are declared wrong, as `kind` says.
class Malformed final : public tk::Plugin {
 public:
  explicit Malformed(int kind) : kind_(kind) {}
  void bind(tk::OptionBinder& o) override {
    if (kind_ == 0) o.add("a", a_, "first").add("a", b_, "again");
    if (kind_ == 1) o.add("name", a_, "reserved");
    if (kind_ == 2) o.add("a", a_, "");
    if (kind_ == 3) o.add("s", s_, "one of two", {"x", "y"});
    if (kind_ == 4) o.add("a", a_, "first").add("b", a_, "the same member");
  }

 private:
  int kind_;
  int64_t a_ = 0, b_ = 0;
  std::string s_ = "z";
};

/// Writes a file of the name its option gives.
class Writes final : public tk::Plugin {
 public:
  void bind(tk::OptionBinder& o) override { o.add("file", file_, "the file to write"); }
  void write_files(tk::OutputFiles& files) override { files.write_text(file_, "hello\n"); }

 private:
  std::string file_ = "mine.txt";
};

std::string fit_error(tk::Trainer& t) {
  try {
    t.fit();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_SUITE("plugin API") {
  TEST_CASE("the layout signature covers Plugin's virtual table: the list matches the class, slot by slot") {
    // Slots 0 and 1 hold the destructors; then every virtual function, in declaration order.
    std::ptrdiff_t expected = 2;
#define TK_CHECK_SLOT(R, N, A, Q)                    \
  {                                                  \
    CAPTURE(#N);                                     \
    CHECK(slot_of(&tk::Plugin::N) == expected);      \
    ++expected;                                      \
  }
    TK_PLUGIN_VIRTUALS(TK_CHECK_SLOT)
#undef TK_CHECK_SLOT
    // Nothing follows: a virtual function added to Plugin without the list would sit here.
    CHECK(slot_of(&OneMore::sentinel) == expected);
    // The text the signature hashes names every hook.
    CHECK(std::string(tk::abi::kPluginVirtuals).find("void write_files(OutputFiles&) ;") != std::string::npos);
  }

  TEST_CASE("a base hook called from an override changes nothing: the plugin keeps its event") {
    auto p = std::make_shared<CallsBase>();
    tk::Trainer t(tkt::recipe(), tkt::quiet());
    t.add_plugin(p, "calls_base");
    const auto r = t.fit();
    CHECK(p->calls == r.micro_steps);
    CHECK(p->handles(tk::Event::MicroBatch));
    CHECK_FALSE(p->handles(tk::Event::Boundary));
  }

  TEST_CASE("options are declared once, bound to members, and located where they were set") {
    auto p = tk::testing::prepare(std::make_shared<Bound>(), "bound",
                                  "steps = 7\nrate = 2\nlabel = \"y\"\nsizes = [4]\nmode = \"fast\"\nfile = \"a/b.txt\"");
    CHECK(p->steps == 7);
    CHECK(p->rate == 2.0);
    CHECK(p->label == "y");
    CHECK(p->sizes == std::vector<int64_t>{4});
    CHECK(p->mode == Bound::Mode::Fast);
    CHECK(fs::path(p->file).is_absolute());
    CHECK(p->given);
    // Defaults are the members' values when bind() runs.
    auto d = tk::testing::prepare(std::make_shared<Bound>(), "bound");
    CHECK(d->steps == 3);
    CHECK(d->mode == Bound::Mode::Exact);
    CHECK_FALSE(d->given);
    CHECK(d->options().get_string("mode") == "exact");
    // A bad value is refused at the option's place; a word that is not one of the choices too.
    CHECK_THROWS_WITH(tk::testing::prepare(std::make_shared<Bound>(), "bound", "steps = -1"),
                      doctest::Contains("plugins.bound.steps: must be >= 0"));
    CHECK_THROWS_WITH(tk::testing::prepare(std::make_shared<Bound>(), "bound", "mode = \"slow\""),
                      doctest::Contains("expected one of fast, exact, got \"slow\""));
    // A second preparation, or a plugin given as tk::Plugin, is refused.
    CHECK_THROWS_WITH(tk::prepare_plugin(*p, "again", "", tk::detail::hooks_of<Bound>()),
                      doctest::Contains("is prepared already"));
    tk::Trainer t(tkt::recipe(), tkt::quiet());
    CHECK_THROWS_WITH(t.add_plugin(std::shared_ptr<tk::Plugin>(std::make_shared<Bound>()), "bound"),
                      doctest::Contains("give it as a std::shared_ptr of its own class"));
  }

  TEST_CASE("malformed option declarations are refused before anything runs") {
    const std::vector<std::string> messages = {"option 'a' is declared twice",
                                               "option 'name' is reserved",
                                               "option 'a' has no doc",
                                               "its default \"z\" is not one of its choices",
                                               "is bound to a member another option is bound to"};
    for (int kind = 0; kind < 5; ++kind) {
      CAPTURE(kind);
      CHECK_THROWS_WITH(tk::testing::prepare(std::make_shared<Malformed>(kind), "malformed"),
                        doctest::Contains(messages[static_cast<size_t>(kind)].c_str()));
    }
  }

  TEST_CASE("a plugin writes its own files only: not the core's, not outside the folder") {
    for (const std::string bad : {"metrics.jsonl", "../escape.txt", "sub/file.txt", ".hidden", "weights.pt"}) {
      CAPTURE(bad);
      const fs::path dir = tkt::temp_dir("bad-file");
      auto opts = tkt::quiet();
      opts.write_outputs = true;
      tk::Trainer t(tkt::recipe({"run.output=\"" + dir.string() + "\""}), opts);
      t.add_plugin(std::make_shared<Writes>(), "writes", "file = " + tk::to_toml(bad));
      CHECK(fit_error(t).find("plugin 'writes' (in-process) failed in write_files: the file name '" + bad + "'") == 0);
      CHECK_FALSE(fs::exists(dir.parent_path() / "escape.txt"));
      fs::remove_all(dir);
    }
    const fs::path dir = tkt::temp_dir("good-file");
    auto opts = tkt::quiet();
    opts.write_outputs = true;
    tk::Trainer t(tkt::recipe({"run.output=\"" + dir.string() + "\""}), opts);
    t.add_plugin(std::make_shared<Writes>(), "writes");
    const auto r = t.fit();
    CHECK(r.files == std::vector<std::string>{"recipe.toml", "metrics.jsonl", "weights.pt", "weights.safetensors", "mine.txt"});
    CHECK(fs::exists(dir / "mine.txt"));
    fs::remove_all(dir);
  }

  TEST_CASE("a plugin loaded by path goes by its file's name: --set and --allow-change plugins.<name>.key reach it") {
    const fs::path dir = tkt::temp_dir("by-path");
    const fs::path probe = fs::path(TK_TEST_PLUGIN_DIR) / "tk_probe.so";
    tk::testing::RunOptions first;
    first.libraries = {{probe, "veto_at_step = 90"}};
    first.overrides = {"plugins.probe.veto_at_step=99"};
    first.output = dir;
    int boundaries = 0;
    first.stop_requested = [&boundaries] { return ++boundaries == 3; };
    const auto stopped = tk::testing::run(tk::testing::kTinyRecipe, first);
    REQUIRE(stopped.fit.status == tk::FitStatus::StoppedBySignal);
    std::ifstream recipe(dir / "recipe.toml");
    const std::string text((std::istreambuf_iterator<char>(recipe)), std::istreambuf_iterator<char>());
    CHECK(text.find("veto_at_step = 99") != std::string::npos);
    // The same entry with another value: refused, naming the key by the plugin's name ...
    tk::testing::RunOptions again = first;
    again.overrides = {"plugins.probe.veto_at_step=98"};
    again.stop_requested = nullptr;
    again.resume = "latest";
    CHECK_THROWS_WITH(tk::testing::run(tk::testing::kTinyRecipe, again),
                      doctest::Contains("plugins.probe.veto_at_step: 99 -> 98"));
    // ... and allowed by that name.
    again.allow_changes = {"plugins.probe.veto_at_step"};
    CHECK(tk::testing::run(tk::testing::kTinyRecipe, again).fit.status == tk::FitStatus::Completed);
    fs::remove_all(dir);
  }

  TEST_CASE("the contract catches a plugin that drops its restored state, and reports a skipped check as skipped") {
    tk::testing::ContractOptions c;
    c.check_neutral = false;
    const auto results = tk::testing::check_contract(fs::path(TK_TEST_PLUGIN_DIR) / "tk_forgetful.so", c);
    std::map<std::string, tk::testing::CheckResult> by_name;
    for (const auto& r : results) by_name[r.name] = r;
    const auto& resume = by_name.at("a run stopped at a checkpoint and resumed equals an uninterrupted one, its state included");
    CHECK_FALSE(resume.passed);
    CHECK(resume.detail == "state entry 'seen' differs at the end of the resumed run");
    CHECK_FALSE(by_name.at("round-trips its state into a fresh instance").passed);
    const auto& neutral = by_name.at("leaves a run bit-identical with neutral options");
    CHECK(neutral.skipped);
    CHECK_FALSE(neutral.passed);
    // The well-behaved probe passes them all.
    for (const auto& r : tk::testing::check_contract(fs::path(TK_TEST_PLUGIN_DIR) / "tk_probe.so")) {
      CAPTURE(r.name);
      CAPTURE(r.detail);
      CHECK(r.passed);
    }
  }

  TEST_CASE("a plugin given as a base class of its own is called for every event its class may override") {
    std::shared_ptr<BaseCounts> p = std::make_shared<DerivedCounts>();
    tk::Trainer t(tkt::recipe(), tkt::quiet());
    t.add_plugin(p, "derived");
    const auto r = t.fit();
    CHECK(static_cast<DerivedCounts&>(*p).micro_batches == r.micro_steps);
    CHECK(p->boundaries == r.steps);
    // Given as its own class, it is called for what it overrides only.
    auto exact = std::make_shared<BaseCounts>();
    tk::Trainer t2(tkt::recipe(), tkt::quiet());
    t2.add_plugin(exact, "base");
    t2.fit();
    CHECK(exact->handles(tk::Event::Boundary));
    CHECK_FALSE(exact->handles(tk::Event::MicroBatch));
  }

  TEST_CASE("a parameter registered under two names is listed once, under its first name") {
    torch::nn::Module m;
    const at::Tensor tied = m.register_parameter("embedding", at::zeros({3, 2}));
    m.register_parameter("bias", at::zeros({2}));
    m.register_parameter("head", tied);
    REQUIRE(m.parameters().size() == 3);  // what a plugin must not sum twice
    const auto named = tk::distinct_parameters(m);
    REQUIRE(named.size() == 2);
    CHECK(named[0].first == "embedding");
    CHECK(named[0].second.is_same(tied));
    CHECK(named[1].first == "bias");
    const auto tensors = tk::distinct_tensors(m.parameters());
    REQUIRE(tensors.size() == 2);
    CHECK(tensors[0].is_same(tied));
    CHECK(tensors[1].is_same(named[1].second));
    // A view of the same memory is another tensor: listed.
    CHECK(tk::distinct_tensors({tied, tied.view({-1}), tied}).size() == 2);
  }

  TEST_CASE("a metric may not take a key of the core's, and a device value is one element") {
    const std::vector<std::pair<std::string, std::string>> cases = {
        {"core_key", "called ctx.metric(\"loss\"): that key is the core's own in each record"},
        {"empty_tensor", "called ctx.metric(name, tensor) with a tensor of 0 elements; it takes a 1-element tensor"},
        {"two_elements", "called ctx.veto_step_if() with a tensor of 2 elements; it takes a 1-element tensor"},
    };
    for (const auto& [what, message] : cases) {
      CAPTURE(what);
      tk::Trainer t(tkt::recipe(), tkt::quiet());
      t.add_plugin(std::make_shared<Gives>(), "gives", "what = \"" + what + "\"");
      CHECK(fit_error(t).find("plugin 'gives' " + message) != std::string::npos);
    }
  }

  TEST_CASE("two plugins may not report one metric: a record holds one value a key") {
    for (const std::string second : {"norm", "norm_tensor"}) {
      CAPTURE(second);
      tk::Trainer t(tkt::recipe(), tkt::quiet());
      t.add_plugin(std::make_shared<Gives>(), "a", "what = \"norm\"");
      t.add_plugin(std::make_shared<Gives>(), "b", "what = \"" + second + "\"");
      CHECK(fit_error(t).find("plugin 'b' (in-process) failed in event boundary in step 1: plugins 'a' and 'b' both "
                              "report metric 'norm'; a record holds one value a key") == 0);
    }
    // Nor in different steps: the records' column would hold both plugins' values.
    tk::Trainer later(tkt::recipe(), tkt::quiet());
    later.add_plugin(std::make_shared<Gives>(), "a", "what = \"norm_first\"");
    later.add_plugin(std::make_shared<Gives>(), "b", "what = \"norm_later\"");
    CHECK(fit_error(later).find("plugin 'b' (in-process) failed in event boundary in step 2: plugins 'a' and 'b' both "
                                "report metric 'norm', 'a' earlier in the run: the records' column 'norm' would hold "
                                "the values of both") == 0);
    // Validation's metrics go into the record of the step validated: not another plugin's key,
    tk::Trainer v(tkt::recipe({"data.validation_samples=16"}), tkt::quiet());
    v.add_plugin(std::make_shared<Gives>(), "a", "what = \"norm\"");
    v.add_plugin(std::make_shared<Gives>(), "b", "what = \"validation_norm\"");
    CHECK(fit_error(v).find("plugin 'b' (in-process) failed in event validation_end after step 6: plugins 'a' and 'b' "
                            "both report metric 'norm', 'a' earlier in the run") == 0);
    // nor a key the step's record holds (one value a key).
    tk::Trainer w(tkt::recipe({"data.validation_samples=16"}), tkt::quiet());
    w.add_plugin(std::make_shared<Gives>(), "a", "what = \"norm_everywhere\"");
    CHECK(fit_error(w).find("plugin 'a' reports metric 'norm' at validation, which the record of step 6 holds already "
                            "(plugin 'a' reported it in the step)") == 0);
    // One plugin reporting it again in a step replaces its value.
    tk::Trainer t(tkt::recipe(), tkt::quiet());
    t.add_plugin(std::make_shared<Gives>(), "a", "what = \"norm\"");
    const auto r = t.fit();
    REQUIRE(r.step_metrics.size() == 6);
    CHECK(r.step_metrics.back().at("norm") == 1.0);
  }

  TEST_CASE("a plugin whose state() throws as a checkpoint is written is named, with the checkpoint's step") {
    const fs::path out = tkt::temp_dir("state-throws");
    tk::Trainer t(tkt::recipe({"run.output=\"" + out.string() + "\"", "run.checkpoint_every=2"}), [] {
      auto o = tkt::quiet();
      o.write_outputs = true;
      return o;
    }());
    t.add_plugin(std::make_shared<Gives>(), "keeps", "what = \"state_throws\"");
    CHECK(fit_error(t).find("plugin 'keeps' (in-process) failed in state, for the checkpoint of step 2: no state") == 0);
    fs::remove_all(out);
  }

  TEST_CASE("every plugin's on_fit_end runs when another's fails, and the first failure is the run's") {
    auto first = std::make_shared<Gives>(), second = std::make_shared<Gives>();
    tk::Trainer t(tkt::recipe(), tkt::quiet());
    t.add_plugin(first, "first", "what = \"fit_end_throws\"");
    t.add_plugin(second, "second");
    CHECK(fit_error(t).find("plugin 'first' (in-process) failed in event fit_end after step 6: cleanup failed") == 0);
    CHECK(first->fit_ends == 1);
    CHECK(second->fit_ends == 1);
    // A plugin whose on_fit_start was never reached (an earlier one threw there) gets no on_fit_end.
    struct StartThrows final : tk::Plugin {
      void on_fit_start(tk::FitStartContext&) override { throw std::runtime_error("no start"); }
    };
    struct Starts final : tk::Plugin {
      void on_fit_start(tk::FitStartContext&) override { ++starts; }
      void on_fit_end(tk::FitEndContext&) override { ++ends; }
      int starts = 0, ends = 0;
    };
    auto later = std::make_shared<Starts>();
    tk::Trainer t2(tkt::recipe(), tkt::quiet());
    t2.add_plugin(std::make_shared<StartThrows>(), "start_throws");
    t2.add_plugin(later, "later");
    CHECK(fit_error(t2).find("plugin 'start_throws' (in-process) failed in event fit_start before the first step") == 0);
    CHECK(later->starts == 0);
    CHECK(later->ends == 0);
  }

  TEST_CASE("--overwrite deletes the plain files files.json names for plugins, never a folder, a core name or outside") {
    const fs::path dir = tkt::temp_dir("manifest"), outside = dir.parent_path() / (dir.filename().string() + "-outside.txt");
    auto opts = tkt::quiet();
    opts.write_outputs = true;
    {
      tk::Trainer t(tkt::recipe({"run.output=\"" + dir.string() + "\""}), opts);
      t.add_plugin(std::make_shared<Writes>(), "writes");
      t.fit();
    }
    REQUIRE(fs::exists(dir / "mine.txt"));
    // A hand-edited (or damaged) list: names that are no plugin's file must never be deleted.
    std::ofstream(dir / "files.json") << R"({"core": ["recipe.toml", "metrics.jsonl", "status.json", "weights.pt",
                                                     "weights.safetensors", "checkpoints", "../x"],
                                            "plugins": {"writes": ["mine.txt", "..", "", ".", "keep", "recipe.toml",
                                          "../)" << outside.filename().string() << R"("], "other": "not a list"}})";
    fs::create_directories(dir / "keep");
    std::ofstream(dir / "keep" / "data.txt") << "mine\n";
    std::ofstream(outside) << "not trainkit's\n";
    opts.overwrite = true;
    tk::Trainer again(tkt::recipe({"run.output=\"" + dir.string() + "\""}), opts);
    again.fit();
    CHECK_FALSE(fs::exists(dir / "mine.txt"));
    CHECK(fs::exists(dir / "keep" / "data.txt"));
    CHECK(fs::exists(outside));
    CHECK(fs::exists(dir / "metrics.jsonl"));
    std::ifstream manifest(dir / "files.json");
    const std::string listed((std::istreambuf_iterator<char>(manifest)), std::istreambuf_iterator<char>());
    CHECK(listed.find("mine.txt") == std::string::npos);  // the new run wrote none
    CHECK(listed.find("\"metrics.jsonl\"") != std::string::npos);
    fs::remove_all(dir);
    fs::remove(outside);
  }
}
