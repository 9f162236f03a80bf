// The loop: training without plugins, event order and tracing, failures, vetoes, outputs.
#include <c10/core/CPUAllocator.h>
#include <tk/tensor_io.h>

#include <sys/stat.h>

#include <cmath>
#include <fstream>
#include <map>
#include <sstream>

#include "support.h"

namespace fs = std::filesystem;
using tk::Event;

namespace {

std::vector<std::string> lines_of(const fs::path& file) {
  std::ifstream in(file);
  std::vector<std::string> out;
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

std::string with_plugins(const std::string& plugins) { return std::string(tkt::kTinyRecipe) + plugins; }



}  // namespace

TEST_SUITE("trainer") {
  TEST_CASE("without plugins the loop trains with a window of one") {
    auto r = tkt::recipe({"run.steps=0", "run.epochs=8"});
    tk::Trainer t(r, tkt::quiet());
    CHECK(t.plan().accumulation() == 1);
    auto res = t.fit();
    CHECK(res.steps == 256);
    CHECK(res.micro_steps == 256);
    REQUIRE(res.window_losses.size() == 256);
    auto mean = [&](size_t from) {
      double s = 0;
      for (size_t i = from; i < from + 32; ++i) s += res.window_losses[i];
      return s / 32;
    };
    CHECK(mean(224) < 0.6 * mean(0));
  }

  TEST_CASE("the trace of a run with several plugins follows contracts and the documented event order") {
    // Listed clip, accumulation, sync; dispatched sync -> accumulation -> clip.
    auto text = with_plugins(R"(
[[plugins]]
name = "fake_clip"
[[plugins]]
name = "grad_accum"
[[plugins]]
name = "fake_sync"
)");
    auto r = tkt::recipe({"run.steps=1", "run.trace=true", "batch.accumulation=2"}, text.c_str());
    tk::Trainer t(r, tkt::quiet());
    CHECK(t.plugin_order() == std::vector<std::string>{"fake_sync", "grad_accum", "fake_clip"});
    t.fit();
    std::vector<std::string> got;
    for (const auto& e : t.trace())
      got.push_back(e.plugin + "@" + tk::to_string(e.event) + ":" + std::to_string(e.step) + "/" +
                    std::to_string(e.micro_step));
    // In dispatch order; an event that closes a region (loss, step_end, epoch_end, fit_end) in reverse.
    auto both = [](const char* ev, const char* at) {
      return std::vector<std::string>{std::string("fake_sync@") + ev + ":" + at, std::string("fake_clip@") + ev + ":" + at};
    };
    auto reversed = [](const char* ev, const char* at) {
      return std::vector<std::string>{std::string("fake_clip@") + ev + ":" + at, std::string("fake_sync@") + ev + ":" + at};
    };
    std::vector<std::string> expect;
    for (auto part : {both("fit_start", "0/0"), both("epoch_start", "0/0"), both("micro_batch", "0/0"),
                      reversed("loss", "0/0"), both("backward", "0/1"), both("micro_batch", "0/1"),
                      reversed("loss", "0/1"), both("backward", "0/2")})
      expect.insert(expect.end(), part.begin(), part.end());
    expect.insert(expect.end(), {"fake_sync@boundary:0/2", "grad_accum@boundary:0/2", "fake_clip@boundary:0/2"});
    for (auto part : {reversed("step_end", "1/2"), reversed("epoch_end", "1/2"), reversed("fit_end", "1/2")})
      expect.insert(expect.end(), part.begin(), part.end());
    CHECK(got == expect);
  }

  TEST_CASE("validation events wrap a validation pass") {
    auto text = with_plugins("[[plugins]]\nname = \"probe\"\n");
    auto r = tkt::recipe({"run.steps=4", "run.trace=true", "run.validate_every=2", "data.validation_samples=32"},
                         text.c_str());
    tk::Trainer t(r, tkt::quiet());
    auto res = t.fit();
    CHECK(res.validation_losses.size() == 2);
    int starts = 0, ends = 0;
    for (const auto& e : t.trace()) {
      starts += e.event == Event::ValidationStart;
      ends += e.event == Event::ValidationEnd;
    }
    CHECK(starts == 2);
    CHECK(ends == 2);
  }

  TEST_CASE("two plugins that provide the same thing are refused at load, naming both") {
    auto text = with_plugins("[[plugins]]\nname = \"fake_clip\"\n[[plugins]]\nname = \"fake_clip2\"\n");
    auto r = tkt::recipe({}, text.c_str());
    tk::Trainer t(r, tkt::quiet());
    CHECK_THROWS_WITH(t.describe(), "plugins 'fake_clip' and 'fake_clip2' both provide 'grads.clipped'; a run can "
                                    "have only one of them");
    auto cyc = with_plugins("[[plugins]]\nname = \"cycle_a\"\n[[plugins]]\nname = \"cycle_b\"\n");
    auto r2 = tkt::recipe({}, cyc.c_str());
    tk::Trainer t2(r2, tkt::quiet());
    CHECK_THROWS_WITH(t2.describe(), doctest::Contains("plugins 'cycle_a' and 'cycle_b' each need to run after the other"));
  }

  TEST_CASE("a plugin that throws stops the run with plugin, event and step; outputs so far are kept") {
    const fs::path out = tkt::temp_dir("throw");
    auto text = with_plugins("[[plugins]]\nname = \"probe\"\nthrow_at_step = 2\nthrow_in = \"backward\"\n");
    auto r = tkt::recipe({"run.output=\"" + out.string() + "\""}, text.c_str());
    auto opts = tkt::quiet();
    opts.write_outputs = true;
    tk::Trainer t(r, opts);
    // Its file named, the step numbered as the records number it (the third), the micro-batch in it.
    CHECK_THROWS_WITH_AS(t.fit(),
                         doctest::Contains("tk_probe.so) failed in event backward in step 3, micro-batch 1 of 1: injected failure"),
                         tk::PluginRuntimeError);
    CHECK(lines_of(out / "metrics.jsonl").size() == 2);
    CHECK(fs::exists(out / "recipe.toml"));
    fs::remove_all(out);
    // Each event's place: step_end comes once its step is counted (the probe's 0-based step 2 is
    // then the end of the second step).
    for (const auto& [event, where] : std::vector<std::pair<std::string, std::string>>{
             {"micro_batch", "in step 3, micro-batch 1 of 1"}, {"loss", "in step 3, micro-batch 1 of 1"},
             {"boundary", "in step 3"}, {"step_end", "in step 2"}}) {
      CAPTURE(event);
      tk::Trainer each(tkt::recipe({}, with_plugins("[[plugins]]\nname = \"probe\"\nthrow_at_step = 2\nthrow_in = \"" +
                                                    event + "\"\n").c_str()),
                       tkt::quiet());
      CHECK_THROWS_WITH_AS(each.fit(), doctest::Contains((") failed in event " + event + " " + where + ": injected failure").c_str()),
                           tk::PluginRuntimeError);
    }
  }

  TEST_CASE("on_failure is told once, however the failure leaves the Trainer: in training, or planning from plan() and fit()") {
    int told = 0;
    auto opts = tkt::quiet();
    opts.on_failure = [&] { ++told; };
    // Planning refuses (micro_batch "auto" on the CPU without a memory budget), from plan() first.
    tk::Trainer unplanned(tkt::recipe({"batch.micro_batch=\"auto\""}), opts);
    CHECK_THROWS_AS(unplanned.plan(), tk::RecipeError);
    CHECK(told == 1);
    CHECK_THROWS(unplanned.fit());  // "the run could not be planned: ..."
    CHECK(told == 1);
    // A plugin that throws in training.
    told = 0;
    auto text = with_plugins("[[plugins]]\nname = \"probe\"\nthrow_at_step = 2\nthrow_in = \"backward\"\n");
    tk::Trainer failing(tkt::recipe({}, text.c_str()), opts);
    CHECK_THROWS_AS(failing.fit(), tk::PluginRuntimeError);
    CHECK(told == 1);
  }

  TEST_CASE("a veto skips the optimizer step and is counted") {
    auto one = tkt::recipe({"run.steps=1"});
    tk::Trainer reference(one, tkt::quiet());
    reference.fit();

    auto text = with_plugins("[[plugins]]\nname = \"probe\"\nveto_at_step = 1\n");
    auto two = tkt::recipe({"run.steps=2"}, text.c_str());
    tk::Trainer vetoed(two, tkt::quiet());
    auto res = vetoed.fit();
    CHECK(res.skipped_steps == 1);
    CHECK(res.steps == 2);
    CHECK(torch::equal(tkt::flat_params(vetoed.model()), tkt::flat_params(reference.model())));
  }

  TEST_CASE("BatchNorm with accumulation is warned about") {
    auto text = with_plugins("[[plugins]]\nname = \"grad_accum\"\n");
    auto r = tkt::recipe({"model.batchnorm=true", "batch.accumulation=4"}, text.c_str());
    tk::Trainer t(r, tkt::quiet());
    t.describe();
    REQUIRE(t.warnings().size() == 1);
    CHECK(t.warnings()[0].find("the model has BatchNorm and accumulates 4 micro-batches per step: its statistics are "
                               "computed per micro-batch of 8 examples, not per window of 32") == 0);
    auto r1 = tkt::recipe({"model.batchnorm=true"});
    tk::Trainer t1(r1, tkt::quiet());
    t1.describe();
    CHECK(t1.warnings().empty());
  }

  TEST_CASE("an epoch that ends in a short micro-batch, which a window of several holds under a mean loss, is warned of") {
    // 250 examples in micro-batches of 8: 31 of 8 and one of 2, the 32nd.
    const std::string accum = with_plugins("[[plugins]]\nname = \"grad_accum\"\n");
    auto warned = [&](std::vector<std::string> sets) {
      sets.push_back("data.samples=250");
      tk::Trainer t(tkt::recipe(sets, accum.c_str()), tkt::quiet());
      t.describe();
      for (const auto& w : t.warnings())
        if (w.rfind("each epoch ends in a micro-batch of 2 examples, not 8, and a mean loss", 0) == 0) return true;
      return false;
    };
    CHECK(warned({"batch.accumulation=4", "run.steps=8"}));  // the last window: 3 of 8 and the one of 2
    CHECK(warned({"batch.accumulation=3", "run.steps=11"}));  // the last window, 2 micro-batches, taken as a step
    CHECK(warned({"batch.accumulation=3", "run.steps=11", "batch.last_window=\"carry\""}));
    CHECK_FALSE(warned({"batch.accumulation=3", "run.steps=11", "batch.last_window=\"drop\""}));  // that window is dropped
    CHECK_FALSE(warned({"batch.accumulation=4", "run.steps=8", "data.drop_last=true"}));
    CHECK_FALSE(warned({"batch.accumulation=4", "run.steps=7"}));  // the run ends before the epoch does
    CHECK_FALSE(warned({"batch.accumulation=1", "run.steps=40"}));  // a step of it alone is its own mean
    CHECK_FALSE(warned({"batch.accumulation=4", "run.steps=8", "loss.reduction=\"sum\"",
                        "plugins.0.normalize=\"samples\""}));
  }

  TEST_CASE("a micro-batch larger than the data set is said to be all of it") {
    tk::Trainer t(tkt::recipe({"batch.micro_batch=300"}), tkt::quiet());
    t.describe();
    REQUIRE(t.warnings().size() == 1);
    CHECK(t.warnings()[0] == "micro_batch 300 is more than the data set's 256 examples: each micro-batch is all of "
                             "them, 256 examples, not the 300 the plan counts");
    CHECK(t.fit().micro_steps == 6);  // one a step, of all 256 examples
    tk::Trainer whole(tkt::recipe({"batch.micro_batch=256"}), tkt::quiet());
    whole.describe();
    CHECK(whole.warnings().empty());
  }

  TEST_CASE("a run writes its resolved recipe, one metrics record per step, weights and trace") {
    const fs::path out = tkt::temp_dir("outputs");
    auto text = with_plugins("[[plugins]]\nname = \"grad_accum\"\nsteps = 3\n");
    auto r = tkt::recipe({"run.output=\"" + out.string() + "\"", "run.steps=5", "run.trace=true",
                          "data.validation_samples=16"},
                         text.c_str());
    auto opts = tkt::quiet();
    opts.write_outputs = true;
    tk::Trainer t(r, opts);
    auto res = t.fit();
    auto metrics = lines_of(out / "metrics.jsonl");
    REQUIRE(metrics.size() == 5);
    CHECK(metrics[0].find("{\"step\": 1, \"epoch\": 0, \"loss\": ") == 0);
    CHECK(metrics[4].find("\"samples\": 120, \"tokens\": 120") != std::string::npos);
    CHECK(metrics[4].find("\"validation_loss\": ") != std::string::npos);
    CHECK(metrics[4].find("\"validation_accuracy\": ") != std::string::npos);
    CHECK(metrics[2].find("\"accum_divisor\": 3") != std::string::npos);

    auto saved = tk::load_tensor_dict(out / "weights.pt");
    auto params = t.model().named_parameters();
    REQUIRE(saved.size() == params.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      CHECK(saved[i].first == params[i].key());
      CHECK(torch::equal(saved[i].second, params[i].value()));
    }

    auto recipe_text = lines_of(out / "recipe.toml");
    // grad_accum's deprecated steps = 3 is written where it moved: [batch] accumulation.
    CHECK(std::find(recipe_text.begin(), recipe_text.end(), "accumulation = 3") != recipe_text.end());
    CHECK(std::count(recipe_text.begin(), recipe_text.end(), "steps = 5") == 1);  // [run] steps alone
    CHECK(std::find(recipe_text.begin(), recipe_text.end(), "steps = 3") == recipe_text.end());
    CHECK(lines_of(out / "trace.jsonl").size() == t.trace().size());
    CHECK(res.output_dir == out);
    fs::remove_all(out);
  }

  TEST_CASE("[model] init starts from weights.safetensors or weights.pt by name; what does not fit is refused or listed") {
    const fs::path out = tkt::temp_dir("init-source");
    auto opts = tkt::quiet();
    opts.write_outputs = true;
    tk::Trainer trained(tkt::recipe({"run.output=\"" + out.string() + "\""}), opts);
    trained.fit();
    // The two files hold the same tensors (tk::load_safetensors reads what tk::save_safetensors wrote).
    const auto st = tk::load_safetensors(out / "weights.safetensors"), pt = tk::load_tensor_dict(out / "weights.pt");
    REQUIRE(st.size() == pt.size());
    for (size_t i = 0; i < st.size(); ++i) {
      CHECK(st[i].first == pt[i].first);
      CHECK(torch::equal(st[i].second, pt[i].second));
    }
    for (const char* file : {"weights.safetensors", "weights.pt"}) {
      CAPTURE(file);
      tk::Trainer t(tkt::recipe({"model.init=\"" + (out / file).string() + "\""}), tkt::quiet());
      t.describe();
      for (const auto& p : trained.model().named_parameters())
        CHECK(torch::equal(t.model().named_parameters()[p.key()], p.value()));
    }
    // Another model: a hidden layer of 8, not 16.
    const std::string init = "model.init=\"" + (out / "weights.safetensors").string() + "\"";
    const std::string misfit = (out / "weights.safetensors").string() +
                               " does not fit model 'mlp'; other shapes: 'head.weight' ([4, 16] there, [4, 8] here)";
    CHECK_THROWS_WITH(tk::Trainer(tkt::recipe({init, "model.hidden=[8]"}), tkt::quiet()).describe(),
                      doctest::Contains(misfit.c_str()));
    tk::Trainer partial(tkt::recipe({init, "model.hidden=[16, 16]", "model.init_partial=true"}), tkt::quiet());
    partial.describe();
    CHECK(torch::equal(partial.model().named_parameters()["layers.0.weight"],
                       trained.model().named_parameters()["layers.0.weight"]));
    bool listed = false;
    for (const auto& w : partial.warnings())
      listed = listed || (w.find("init: loaded 4 tensors of") == 0 && w.find("; it lacks 'layers.1.weight'") != std::string::npos);
    CHECK(listed);
    // A checkpoint's model.pt with the parameters its ranks kept beside it (ZeRO stage 3): whole.
    {
      const fs::path ck = out / "sharded-checkpoint";
      fs::create_directories(ck);
      auto p = trained.model().named_parameters();
      tk::save_tensor_dict(ck / "model.pt", {{"layers.0.weight", p["layers.0.weight"]}});
      tk::save_tensor_dict(ck / "model-share-0.pt", {{"layers.0.bias", p["layers.0.bias"]}});
      tk::save_tensor_dict(ck / "model-share-1.pt", {{"head.weight", p["head.weight"]}, {"head.bias", p["head.bias"]}});
      std::ofstream(ck / "run.json") << R"({"format": 2, "world_size": 2, "model_shares": 2, "recipe": {}})";
      const std::string from = "model.init=\"" + (ck / "model.pt").string() + "\"";
      tk::Trainer whole(tkt::recipe({from}), tkt::quiet());
      whole.describe();
      for (const auto& q : trained.model().named_parameters())
        CHECK(torch::equal(whole.model().named_parameters()[q.key()], q.value()));
      tk::save_tensor_dict(ck / "model-share-1.pt", {{"head.weight", p["head.weight"]}, {"layers.0.bias", p["layers.0.bias"]}});
      CHECK_THROWS_WITH(tk::Trainer(tkt::recipe({from}), tkt::quiet()).describe(),
                        doctest::Contains("model-share-1.pt: tensor 'layers.0.bias' is also in model.pt or an earlier share"));
      fs::remove(ck / "model-share-1.pt");
      const std::string missing = "model-share-1.pt is missing: " + (ck / "run.json").string() +
                                  " says 2 ranks wrote a share of the parameters beside model.pt";
      CHECK_THROWS_WITH(tk::Trainer(tkt::recipe({from}), tkt::quiet()).describe(), doctest::Contains(missing.c_str()));
    }
    std::ofstream(out / "junk.safetensors") << "not a safetensors file";
    CHECK_THROWS_WITH(tk::Trainer(tkt::recipe({"model.init=\"" + (out / "junk.safetensors").string() + "\""}), tkt::quiet())
                          .describe(),
                      doctest::Contains("junk.safetensors: not a safetensors file"));
    // A header whose tensors share bytes, or whose shape overflows, is refused naming the tensor; a
    // FIFO is refused before it is opened (it would wait for a writer).
    auto hand_made = [&](const char* name, const std::string& header, size_t data) {
      std::ofstream f(out / name, std::ios::binary);
      const uint64_t n = header.size();
      f.write(reinterpret_cast<const char*>(&n), 8);
      f << header << std::string(data, '\0');
      return out / name;
    };
    CHECK_THROWS_WITH(tk::load_safetensors(hand_made("overlap.safetensors",
                                                     R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                                                     R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                                                     12)),
                      doctest::Contains("tensor 'b': its bytes [4, 12) overlap those of tensor 'w' [0, 8)"));
    CHECK_THROWS_WITH(tk::load_safetensors(hand_made("huge.safetensors",
                                                     R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296],)"
                                                     R"( "data_offsets": [0, 0]}})", 0)),
                      doctest::Contains("tensor 'w': its shape [4294967296, 4294967296] holds more bytes than any file can"));
    const auto empty = tk::load_safetensors(hand_made("empty.safetensors",
                                                      R"({"w": {"dtype": "F32", "shape": [4096, 0],)"
                                                      R"( "data_offsets": [0, 0]}})", 0));
    CHECK(empty.at(0).second.sizes() == at::IntArrayRef({4096, 0}));
    // A NaN in the file is named at its tensor, not left to surface as a non-finite loss.
    auto poisoned = tk::load_safetensors(out / "weights.safetensors");
    poisoned.at(1).second.view(-1)[3] = std::nan("");
    tk::save_safetensors(out / "nan.safetensors", poisoned);
    const std::string nan_named = "nan.safetensors: tensor '" + poisoned.at(1).first + "' holds NaN or infinite values (1 of";
    CHECK_THROWS_WITH(tk::Trainer(tkt::recipe({"model.init=\"" + (out / "nan.safetensors").string() + "\""}), tkt::quiet())
                          .describe(),
                      doctest::Contains(nan_named.c_str()));
    REQUIRE(::mkfifo((out / "fifo.safetensors").c_str(), 0600) == 0);
    CHECK_THROWS_WITH(tk::Trainer(tkt::recipe({"model.init=\"" + (out / "fifo.safetensors").string() + "\""}), tkt::quiet())
                          .describe(),
                      doctest::Contains("fifo.safetensors is not a regular file"));
    fs::remove_all(out);
  }

  TEST_CASE("[model] trainable and freeze choose the parameters that train by name pattern; one that matches nothing is refused") {
    tk::Trainer untrained(tkt::recipe(), tkt::quiet());
    untrained.describe();  // the same seed: the same initial weights
    std::map<std::string, at::Tensor> start;
    for (const auto& p : untrained.model().named_parameters()) start[p.key()] = p.value().detach().clone();
    tk::Trainer frozen(tkt::recipe({"model.freeze=[\"layers.0.*\"]"}), tkt::quiet());
    frozen.fit();
    int moved = 0;
    for (const auto& p : frozen.model().named_parameters()) {
      CAPTURE(p.key());
      const bool first = p.key().rfind("layers.0.", 0) == 0;
      CHECK(p.value().requires_grad() == !first);
      CHECK(torch::equal(p.value(), start.at(p.key())) == first);
      moved += !first;
    }
    CHECK(moved >= 2);
    tk::Trainer only(tkt::recipe({"model.trainable=[\"head.*\"]", "model.freeze=[\"head.bias\"]"}), tkt::quiet());
    only.describe();
    for (const auto& p : only.model().named_parameters()) CHECK(p.value().requires_grad() == (p.key() == "head.weight"));
    CHECK_THROWS_WITH(tk::Trainer(tkt::recipe({"model.freeze=[\"layer.0.*\"]"}), tkt::quiet()).describe(),
                      doctest::Contains("'layer.0.*' matches no parameter of model 'mlp' (it has 'head.weight', 'head.bias', 'layers.0.weight'"));
    CHECK_THROWS_WITH(tk::Trainer(tkt::recipe({"model.trainable=[\"nothing\"]"}), tkt::quiet()).describe(),
                      doctest::Contains("model.trainable"));
    CHECK_THROWS_WITH(tk::Trainer(tkt::recipe({"model.freeze=[\"*\"]"}), tkt::quiet()).describe(),
                      doctest::Contains("every parameter has requires_grad = false"));
  }

  TEST_CASE("a run resumes with the other exact optimizer step form, bit-identical") {
    // The tiny recipe's SGD with momentum: its buffers are in the checkpoint.
    const std::vector<std::string> sets = {"data.samples=80", "run.steps=6", "optimizer.implementation=\"per_tensor\""};
    auto opts = tkt::quiet();
    opts.write_outputs = true;
    const fs::path one_dir = tkt::temp_dir("form-one"), dir = tkt::temp_dir("form-two");
    tk::Trainer one(tkt::recipe(sets + std::vector<std::string>{"run.output=\"" + one_dir.string() + "\""}), opts);
    one.fit();
    const std::vector<std::string> out = {"run.output=\"" + dir.string() + "\"", "run.checkpoint_every=3"};
    tk::Trainer first(tkt::recipe(sets + out, with_plugins("[[plugins]]\nname = \"probe\"\nthrow_at_step = 4\n").c_str()),
                      opts);
    CHECK_THROWS_AS(first.fit(), tk::PluginRuntimeError);
    auto resume = opts;
    resume.resume = "latest";
    resume.allow_changes = {"plugins"};  // only the probe: the step form may change freely
    auto foreach = sets;
    foreach.back() = "optimizer.implementation=\"foreach\"";
    tk::Trainer second(tkt::recipe(foreach + out), resume);
    CHECK(second.fit().steps == 6);
    CHECK(torch::equal(tkt::flat_params(second.model()), tkt::flat_params(one.model())));
    fs::remove_all(dir);
    fs::remove_all(one_dir);
  }

  TEST_CASE("a resume refused for want of a checkpoint leaves no folder it made; one that was there stays") {
    auto opts = tkt::quiet();
    opts.write_outputs = true;
    opts.resume = "latest";
    const fs::path base = tkt::temp_dir("resume-none"), dir = base / "runs" / "x";
    const auto recipe = tkt::recipe({"run.output=\"" + dir.string() + "\""});
    tk::Trainer t(recipe, opts);
    CHECK_THROWS_WITH(t.fit(), doctest::Contains("no checkpoint at"));
    CHECK_FALSE(fs::exists(base));
    fs::create_directories(dir);
    tk::Trainer there(recipe, opts);
    CHECK_THROWS_WITH(there.fit(), doctest::Contains("no checkpoint at"));
    CHECK(fs::exists(dir / ".tk-lock"));
    fs::remove_all(base);
  }

  TEST_CASE("a run resumed from a checkpoint is bit-identical to an uninterrupted one") {
    // 80 examples in micro-batches of 8, windows of 3: 3, 3, 3, 1 per epoch; 10 steps span 3 epochs,
    // and the checkpoint at step 5 sits inside epoch 2, after a short last window.
    const std::string accum = "[[plugins]]\nname = \"grad_accum\"\n";
    const std::vector<std::string> sets = {"data.samples=80", "run.steps=10", "optimizer.name=sgd", "batch.accumulation=3"};
    auto opts = tkt::quiet();
    opts.write_outputs = true;

    const fs::path one_dir = tkt::temp_dir("resume-one");
    auto r1 = tkt::recipe(sets + std::vector<std::string>{"run.output=\"" + one_dir.string() + "\""},
                          with_plugins(accum).c_str());
    tk::Trainer one(r1, opts);
    one.fit();

    const fs::path dir = tkt::temp_dir("resume-two");
    auto out = std::vector<std::string>{"run.output=\"" + dir.string() + "\"", "run.checkpoint_every=5",
                                        "run.checkpoint_keep=1"};
    auto r2 = tkt::recipe(sets + out, with_plugins(accum + "[[plugins]]\nname = \"probe\"\nthrow_at_step = 7\n").c_str());
    tk::Trainer first(r2, opts);
    CHECK_THROWS_AS(first.fit(), tk::PluginRuntimeError);
    CHECK(lines_of(dir / "metrics.jsonl").size() == 7);
    CHECK(fs::exists(dir / "checkpoints/step-00000005/model.pt"));

    auto r3 = tkt::recipe(sets + out, with_plugins(accum).c_str());
    auto resume = opts;
    resume.resume = "latest";
    resume.allow_changes = {"plugins"};  // without the probe that made it fail
    tk::Trainer second(r3, resume);
    auto res = second.fit();
    CHECK(res.steps == 10);
    CHECK(torch::equal(tkt::flat_params(second.model()), tkt::flat_params(one.model())));
    // The records after the checkpoint were replaced, not duplicated; one checkpoint is kept.
    auto steps = tkt::metric(dir / "metrics.jsonl", "step");
    CHECK(steps == std::vector<double>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
    CHECK(tkt::metric(dir / "metrics.jsonl", "loss") == tkt::metric(one_dir / "metrics.jsonl", "loss"));
    int kept = 0;
    for (const auto& e : fs::directory_iterator(dir / "checkpoints")) kept += e.is_directory();
    CHECK(kept == 1);
    CHECK(second.warnings().size() == 1);  // the probe's state in the checkpoint is not loaded
    fs::remove_all(dir);
    fs::remove_all(one_dir);
  }

  TEST_CASE("each step's record has its throughput, its model FLOPs and, against a given peak, its MFU") {
    const fs::path dir = tkt::temp_dir("mfu");
    auto opts = tkt::quiet();
    opts.write_outputs = true;
    tk::Trainer t(tkt::recipe({"run.output=\"" + dir.string() + "\"", "run.peak_gflops=50"}), opts);
    const auto res = t.fit();
    const fs::path m = dir / "metrics.jsonl";
    const auto gflop = tkt::metric(m, "model_gflop"), rate = tkt::metric(m, "gflops"), mfu = tkt::metric(m, "mfu"),
               examples = tkt::metric(m, "effective_batch"), eps = tkt::metric(m, "examples_per_s");
    REQUIRE(gflop.size() == static_cast<size_t>(res.steps));
    // The tiny recipe's MLP on 4 features: its count for each step's examples.
    auto x = torch::zeros({1, t.model().parameters().front().size(1)});
    const double per_example = tk::train_flops_of(t.model(), x.sizes());
    REQUIRE(per_example > 0);
    for (size_t i = 0; i < gflop.size(); ++i) {
      CAPTURE(i);
      CHECK(gflop[i] == doctest::Approx(examples[i] * per_example / 1e9));
      CHECK(rate[i] > 0.0);
      CHECK(mfu[i] == doctest::Approx(rate[i] / 50.0));
      // Both rates over the same step time.
      CHECK(eps[i] / examples[i] == doctest::Approx(rate[i] / gflop[i]).epsilon(1e-6));
    }
    CHECK_THROWS_WITH(tk::Trainer(tkt::recipe({"run.peak_gflops=-1"}), tkt::quiet()),
                      doctest::Contains("run.peak_gflops: must be >= 0"));
    fs::remove_all(dir);
  }

  TEST_CASE("run.allocator: the CPU block cache serves a step's large tensors again, changes no number, and is gone after fit") {
    // Checks, at each step's end, which allocator LibTorch's CPU tensors come from and whether a
    // 1 MiB tensor made after another was dropped gets that one's memory back.
    struct Looks : tk::Plugin {
      void on_step_end(tk::StepEndContext&) override {
        cached.push_back(c10::GetCPUAllocator() != c10::GetDefaultCPUAllocator());
        const void* first = at::empty({1 << 18}, at::kFloat).data_ptr();  // dropped at once
        reused.push_back(at::empty({1 << 18}, at::kFloat).data_ptr() == first);
      }
      std::vector<bool> cached, reused;
    };
    // Hidden layers of 512 x 512 doubles: 2 MiB weights and gradients, cached.
    const std::vector<std::string> wide = {"model.hidden=[512, 512]", "run.steps=4"};
    tk::testing::Parameters weights[2];
    for (int caching = 0; caching < 2; ++caching) {
      CAPTURE(caching);
      auto looks = std::make_shared<Looks>();
      auto overrides = wide;
      overrides.push_back(caching ? "run.allocator=\"caching\"" : "run.allocator=\"system\"");
      tk::Trainer t(tkt::recipe(overrides), tkt::quiet());
      t.add_plugin(looks, "looks");
      t.fit();
      CHECK(c10::GetCPUAllocator() == c10::GetDefaultCPUAllocator());  // put back when fit returns
      REQUIRE(looks->cached.size() == 4);
      for (size_t i = 0; i < 4; ++i) {
        CHECK(looks->cached[i] == (caching == 1));
        if (caching) CHECK(looks->reused[i]);
      }
      for (const auto& p : t.model().named_parameters()) weights[caching][p.key()] = p.value().detach().clone();
    }
    REQUIRE(weights[0].size() == weights[1].size());
    for (const auto& [name, w] : weights[0]) {
      CAPTURE(name);
      CHECK(at::equal(w, weights[1].at(name)));
    }
    CHECK_THROWS_WITH(tk::Trainer(tkt::recipe({"run.allocator=\"jemalloc\""}), tkt::quiet()),
                      doctest::Contains("run.allocator"));
  }

  TEST_CASE("without run.peak_gflops, mfu is against this machine's peak, timed once and read from its cache after") {
    const fs::path cache = tkt::temp_dir("peak-cache");
    const char* before = std::getenv("TK_CACHE_DIR");
    const std::string restore = before ? before : "";
    ::setenv("TK_CACHE_DIR", cache.c_str(), 1);
    auto train = [&](const std::string& name) {
      const fs::path dir = tkt::temp_dir(name);
      auto opts = tkt::quiet();
      opts.write_outputs = true;
      tk::Trainer(tkt::recipe({"run.output=\"" + dir.string() + "\"", "run.steps=2"}), opts).fit();
      return std::make_pair(tkt::metric(dir / "metrics.jsonl", "gflops"), tkt::metric(dir / "metrics.jsonl", "mfu"));
    };
    const auto [rate, mfu] = train("peak-1");
    const fs::path file = cache / "peak-gflops.json";
    REQUIRE(fs::exists(file));
    std::ifstream in(file);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    // One entry: this CPU at this thread count, in the tiny recipe's float64.
    CHECK(text.find(" | Double | LibTorch ") != std::string::npos);
    const auto colon = text.rfind(':');
    REQUIRE(colon != std::string::npos);
    const double peak = std::stod(text.substr(colon + 1));
    CHECK(peak > 0.0);
    REQUIRE(mfu.size() == 2);
    for (size_t i = 0; i < 2; ++i) CHECK(mfu[i] == doctest::Approx(rate[i] / peak).epsilon(1e-2));
    // The next run reads the figure kept: a changed one shows.
    std::ofstream(file) << text.substr(0, colon + 1) << " 12345.0\n}\n";
    const auto [rate2, mfu2] = train("peak-2");
    REQUIRE(mfu2.size() == 2);
    for (size_t i = 0; i < 2; ++i) CHECK(mfu2[i] == doctest::Approx(rate2[i] / 12345.0));
    if (before)
      ::setenv("TK_CACHE_DIR", restore.c_str(), 1);
    else
      ::unsetenv("TK_CACHE_DIR");
    fs::remove_all(cache);
  }

  TEST_CASE("max_time stops at the next boundary with a checkpoint and a validation of that step") {
    const fs::path dir = tkt::temp_dir("max-time");
    auto r = tkt::recipe({"run.output=\"" + dir.string() + "\"", "run.max_time=\"1ms\"", "run.steps=100000",
                          "data.validation_samples=32"});
    auto opts = tkt::quiet();
    opts.write_outputs = true;
    tk::Trainer t(r, opts);
    auto res = t.fit();
    CHECK(res.stopped == "max_time");
    CHECK(res.steps < 100000);
    REQUIRE(res.validation_losses.size() == 1);  // validate_every = 0: only at the end, which came early
    const auto validated = tkt::metric(dir / "metrics.jsonl", "validation_loss");
    REQUIRE(!validated.empty());
    REQUIRE(!std::isnan(validated.back()));  // on the last step's record
    CHECK(validated.back() == doctest::Approx(res.validation_losses[0]));
    CHECK(res.checkpoint == dir / ("checkpoints/step-" + std::string(8 - std::to_string(res.steps).size(), '0') +
                                   std::to_string(res.steps)));
    CHECK(t.warnings().empty());  // a constant learning rate: nothing was cut short
    // A schedule that time cut short is named, with the steps that fit the time at this pace.
    auto cosine = tkt::recipe({"run.max_time=\"1ms\"", "run.steps=100000", "schedule.name=\"warmup_cosine\"",
                               "schedule.warmup_steps=10"});
    tk::Trainer cut(cosine, tkt::quiet());
    const auto cut_res = cut.fit();
    REQUIRE(cut.warnings().size() == 1);
    CHECK(cut.warnings()[0].find("run.max_time stopped the run at step " + std::to_string(cut_res.steps) +
                                 " of run.steps = 100000: schedule 'warmup_cosine' had not ended") == 0);
    CHECK(cut.warnings()[0].find("steps fit in run.max_time; set run.steps to that") != std::string::npos);
    CHECK_THROWS_WITH(tk::Trainer(tkt::recipe({"run.max_time=\"ten minutes\""}), tkt::quiet()),
                      doctest::Contains("run.max_time: expected a duration like"));
    fs::remove_all(dir);
  }

  TEST_CASE("a tensor file with a mask trains on the counted tokens only") {
    const fs::path dir = tkt::temp_dir("tensor-file");
    fs::create_directories(dir);
    torch::manual_seed(7);
    auto x = torch::randn({40, 5, 3});
    auto y = torch::randint(0, 4, {40, 5});
    auto mask = torch::rand({40, 5}) > 0.3;
    tk::save_tensor_dict(dir / "data.pt", {{"x", x}, {"y", y}, {"keep", mask}});
    const std::string text = R"(
[model]
name = "mlp"
hidden = [8]
[data]
name = "tensors"
inputs = "x"
targets = "y"
mask = "keep"
[batch]
micro_batch = 8
[loss]
name = "cross_entropy"
reduction = "sum"
[optimizer]
name = "sgd"
[[plugins]]
name = "grad_accum"
steps = 2
normalize = "tokens"
)";
    auto r = tkt::recipe({"data.path=\"" + (dir / "data.pt").string() + "\"", "run.steps=3"}, text.c_str());
    tk::Trainer t(r, tkt::quiet());
    auto all = t.data().train->get(torch::arange(40));
    CHECK(all.tokens == mask.sum().item<int64_t>());
    CHECK(t.data().info.output_dim == 4);
    CHECK(t.fit().steps == 3);
    const torch::Tensor trained = tkt::flat_params(t.model());
    // The same run with other targets where the mask is off trains bit-identically; with one
    // counted target changed, it does not.
    auto train_with = [&](const torch::Tensor& targets) {
      tk::save_tensor_dict(dir / "data.pt", {{"x", x}, {"y", targets}, {"keep", mask}});
      tk::Trainer again(r, tkt::quiet());
      again.fit();
      return tkt::flat_params(again.model());
    };
    CHECK(torch::equal(train_with(torch::where(mask, y, (y + 1) % 4)), trained));
    auto one_counted = y.clone();
    const auto first = mask.reshape({-1}).nonzero()[0].item<int64_t>();
    one_counted.view({-1})[first] = (one_counted.view({-1})[first] + 1) % 4;
    CHECK_FALSE(torch::equal(train_with(one_counted), trained));
    tk::save_tensor_dict(dir / "data.pt", {{"x", x}, {"y", y}, {"keep", mask}});
    auto bad = tkt::recipe({"data.path=\"" + (dir / "data.pt").string() + "\"", "data.mask=\"m\""}, text.c_str());
    CHECK_THROWS_WITH(tk::Trainer(bad, tkt::quiet()), doctest::Contains("data.mask: the file has no tensor 'm'"));
    fs::remove_all(dir);
  }
}
