// Real workloads: Fashion-MNIST's IDX files, text for language modelling, the CNN, the GPT and
// TorchScript models.
#include <torch/csrc/autograd/function.h>
#include <tk/tensor_io.h>
#include <zlib.h>

#include <chrono>
#include <fstream>
#include <set>
#include <thread>

#include "support.h"

namespace fs = std::filesystem;

namespace {

template <class Fn>
const tk::Component<Fn>& component(const std::vector<tk::Component<Fn>>& list, const std::string& name) {
  auto c = tk::find_component(list, name);
  REQUIRE(c != nullptr);
  return *c;
}

tk::DataSplits make_data(const std::string& name, const std::string& options) {
  const auto& c = component(tkt::standard_registry().data(), name);
  return c.make(tk::parse_options(options, c.specs, "data"), 1);
}

tk::ModelPtr make_model(const std::string& name, const std::string& options, const tk::DataInfo& info) {
  const auto& c = component(tkt::standard_registry().models(), name);
  return c.make(tk::parse_options(options, c.specs, "model"), info);
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& name, const std::string& options,
                                                        std::vector<torch::Tensor> params) {
  const auto& c = component(tkt::standard_registry().optimizers(), name);
  return c.make(tk::parse_options(options, c.specs, "optimizer"), std::move(params));
}

/// Next-token data of a vocabulary of 11 in sequences of 8: what the GPT tests build models for.
tk::DataInfo tokens_11x8() {
  tk::DataInfo info;
  info.vocab = info.input_dim = info.output_dim = 11;
  info.input_shape = {8};
  info.next_token = true;
  return info;
}

std::string toml_string(const fs::path& p) { return "\"" + p.string() + "\""; }


void write_file(const fs::path& file, const std::string& bytes, bool gzip) {
  if (gzip) {
    gzFile f = gzopen(file.c_str(), "wb");
    REQUIRE(f != nullptr);
    REQUIRE(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())) == static_cast<int>(bytes.size()));
    gzclose(f);
  } else {
    std::ofstream(file, std::ios::binary) << bytes;
  }
}

/// An IDX file of unsigned bytes: magic 00 00 08 <rank>, big-endian dimensions, the data.
std::string idx(const std::vector<int>& dims, const std::vector<uint8_t>& data) {
  std::string s{'\0', '\0', '\x08', static_cast<char>(dims.size())};
  for (int d : dims)
    for (int shift : {24, 16, 8, 0}) s.push_back(static_cast<char>((d >> shift) & 0xff));
  s.append(data.begin(), data.end());
  return s;
}

/// A Fashion-MNIST folder of `n` training and `nv` test images of 4 x 4 pixels; pixel (0, 0) of
/// image i is i and its label i % 10. Images gzip-compressed, labels not.
fs::path fake_fashion(const std::string& name, int n, int nv) {
  const fs::path dir = tkt::temp_dir(name);
  fs::create_directories(dir);
  for (auto [prefix, count] : {std::pair<std::string, int>{"train", n}, {"t10k", nv}}) {
    std::vector<uint8_t> pixels(static_cast<size_t>(count) * 16, 255), labels;
    for (int i = 0; i < count; ++i) {
      pixels[static_cast<size_t>(i) * 16] = static_cast<uint8_t>(i);
      labels.push_back(static_cast<uint8_t>(i % 10));
    }
    write_file(dir / (prefix + "-images-idx3-ubyte.gz"), idx({count, 4, 4}, pixels), true);
    write_file(dir / (prefix + "-labels-idx1-ubyte"), idx({count}, labels), false);
  }
  return dir;
}

const char* kGptRecipe = R"(
[run]
seed = 5
steps = 3
dtype = "float64"

[model]
name = "gpt"
layers = 2
width = 16
heads = 2

[data]
name = "text"
seq_len = 12
document_separator = "\n%\n"
validation_fraction = 0.0

[loss]
name = "cross_entropy"

[optimizer]
name = "adamw"
lr = 0.01
)";

/// A corpus of documents of very different lengths (1 to 40 bytes), so batches carry padding.
fs::path fake_corpus(const std::string& name) {
  const fs::path dir = tkt::temp_dir(name);
  fs::create_directories(dir);
  tkt::write_documents(dir / "corpus.txt", 60);
  return dir;
}

}  // namespace

TEST_SUITE("workloads") {
  TEST_CASE("Fashion-MNIST IDX files are read gzip-compressed or not, scaled, and the test set validates") {
    const fs::path dir = fake_fashion("idx", 30, 12);
    auto d = make_data("fashion-mnist", "dir = " + toml_string(dir) + "\nnormalize = false");
    REQUIRE(d.train->size() == 30);
    REQUIRE(d.validation);
    CHECK(d.validation->size() == 12);
    CHECK(d.info.input_shape == std::vector<int64_t>{1, 4, 4});
    CHECK(d.info.output_dim == 10);
    auto b = d.train->get(torch::tensor({0, 7, 29}, torch::kLong));
    CHECK(b.input.sizes() == torch::IntArrayRef{3, 1, 4, 4});
    CHECK(b.input[1][0][0][0].item<double>() == doctest::Approx(7.0 / 255.0));
    CHECK(b.input[1][0][3][3].item<double>() == doctest::Approx(1.0));
    CHECK(torch::equal(b.target, torch::tensor({0, 7, 9}, torch::kLong)));
    CHECK(b.tokens == 3);

    auto n = make_data("fashion-mnist", "dir = " + toml_string(dir) + "\ntrain_samples = 10\nvalidation_samples = 0");
    CHECK(n.train->size() == 10);
    CHECK_FALSE(n.validation);
    auto scaled = n.train->get(torch::tensor({0}, torch::kLong)).input;
    CHECK(scaled[0][0][3][3].item<double>() == doctest::Approx((1.0 - 0.2860) / 0.3530));
    fs::remove_all(dir);
  }

  TEST_CASE("Fashion-MNIST problems are named: missing package, wrong file, truncated data, label count") {
    CHECK_THROWS_WITH(make_data("fashion-mnist", "dir = \"/nonexistent/fmnist\""),
                      doctest::Contains("no train-images-idx3-ubyte or train-images-idx3-ubyte.gz in "
                                        "/nonexistent/fmnist; Debian's dataset-fashion-mnist package"));
    const fs::path dir = fake_fashion("idx-bad", 5, 5);
    const fs::path images = dir / "train-images-idx3-ubyte.gz";
    write_file(images, "not an idx file", true);
    CHECK_THROWS_WITH(make_data("fashion-mnist", "dir = " + toml_string(dir)),
                      doctest::Contains((images.string() + ": not an IDX file").c_str()));
    write_file(images, idx({5, 4, 4}, std::vector<uint8_t>(70, 1)), true);
    CHECK_THROWS_WITH(make_data("fashion-mnist", "dir = " + toml_string(dir)),
                      doctest::Contains("truncated: the header promises 80 bytes of data, found 70"));
    write_file(images, idx({6, 4, 4}, std::vector<uint8_t>(96, 1)), true);
    CHECK_THROWS_WITH(make_data("fashion-mnist", "dir = " + toml_string(dir)),
                      doctest::Contains("train-labels-idx1-ubyte: expected 6 labels (one per image"));
    fs::remove_all(dir);
  }

  TEST_CASE("the Fashion-MNIST Debian ships has 60000 balanced training images and 10000 test images (may skip)") {
    const fs::path dir = "/usr/share/datasets/fashion-mnist";
    TK_SKIP_IF(!fs::exists(dir), dir.string() + " is missing (package dataset-fashion-mnist; tools/setup.sh installs it)");
    auto d = make_data("fashion-mnist", "");
    REQUIRE(d.train->size() == 60000);
    REQUIRE(d.validation->size() == 10000);
    auto all = d.train->get(torch::arange(60000));
    CHECK(torch::equal(torch::bincount(all.target), torch::full({10}, 6000, torch::kLong)));
    CHECK(all.input.mean().item<double>() == doctest::Approx(0.0).epsilon(0.01));
    CHECK(all.input.std().item<double>() == doctest::Approx(1.0).epsilon(0.01));
  }

  TEST_CASE("a TensorDataset's batch counts the target items that are not ignore_index") {
    const auto x = torch::zeros({3, 2});
    const tk::TensorDataset padded(x, torch::tensor({5, 6, -100, 7, -100, -100}, torch::kLong).reshape({3, 2}));
    CHECK(padded.get(torch::tensor({0, 1, 2}, torch::kLong)).tokens == 3);
    CHECK(padded.get(torch::tensor({0}, torch::kLong)).tokens == 2);
    CHECK(padded.get(torch::tensor({2, 2}, torch::kLong)).tokens == 0);
    const tk::TensorDataset other_pad(x, torch::tensor({{1, 0}, {0, 0}, {2, 3}}, torch::kLong), /*ignore_index=*/0);
    CHECK(other_pad.get(torch::tensor({0, 1, 2}, torch::kLong)).tokens == 3);
    const tk::TensorDataset labels(x, torch::tensor({4, 0, 9}, torch::kLong));  // none ignored: every item counts
    CHECK(labels.get(torch::tensor({2, 0}, torch::kLong)).tokens == 2);
    const tk::TensorDataset reals(x, torch::full({3, 4}, -100.0));  // regression targets: one item per example
    CHECK(reals.get(torch::tensor({1, 2}, torch::kLong)).tokens == 2);
  }

  TEST_CASE("text is cut into next-token examples; documents start their own and are padded") {
    const fs::path dir = tkt::temp_dir("text");
    fs::create_directories(dir);
    std::ofstream(dir / "a.txt", std::ios::binary) << "abcdefghij";
    auto d = make_data("text", "path = " + toml_string(dir / "a.txt") + "\nseq_len = 4\nvalidation_fraction = 0.0");
    REQUIRE(d.train->size() == 3);
    CHECK_FALSE(d.validation);
    CHECK(d.info.vocab == 256);
    CHECK(d.info.next_token);
    auto b = d.train->get(torch::arange(3));
    auto ids = [](const std::string& s, int pad) {
      std::vector<int64_t> v(s.begin(), s.end());
      v.resize(4, pad);
      return torch::tensor(v, torch::kLong);
    };
    CHECK(torch::equal(b.input, torch::stack({ids("abcd", 0), ids("efgh", 0), ids("i", 0)})));
    CHECK(torch::equal(b.target, torch::stack({ids("bcde", -100), ids("fghi", -100), ids("j", -100)})));
    CHECK(b.tokens == 9);

    std::ofstream(dir / "docs.txt", std::ios::binary) << "ab\n%\ncdef\n%\ng\n%\nxyz\n%\nuvw";
    auto docs = make_data("text", "path = " + toml_string(dir / "docs.txt") +
                                      "\nseq_len = 4\ndocument_separator = \"\\n%\\n\"\nvalidation_fraction = 0.4");
    REQUIRE(docs.train->size() == 2);  // "ab", "cdef"; "g" has no next token
    REQUIRE(docs.validation->size() == 2);  // "xyz", "uvw"
    auto t = docs.train->get(torch::arange(2));
    CHECK(torch::equal(t.input, torch::stack({ids("a", 0), ids("cde", 0)})));
    CHECK(torch::equal(t.target, torch::stack({ids("b", -100), ids("def", -100)})));
    CHECK(t.tokens == 4);
    // Unigram baseline: train targets b, d, e, f; validation targets y, z, v, w, all unseen:
    // add-one smoothing gives each 1 / (4 + 256).
    CHECK(docs.info.baseline_loss == doctest::Approx(std::log(260.0)).epsilon(1e-12));
    fs::remove_all(dir);
  }

  TEST_CASE("token shards: sequences and shifted targets across shards, the vocabulary from the data, errors named") {
    const fs::path dir = tkt::temp_dir("tokens");
    fs::create_directories(dir);
    std::vector<int64_t> a, b, v;
    for (int64_t i = 0; i < 25; ++i) a.push_back((i * 7) % 50);     // 25 tokens: 3 sequences of 8
    for (int64_t i = 0; i < 10; ++i) b.push_back(60000 + i);         // 10 tokens: 1 sequence, ids above 2^15
    for (int64_t i = 0; i < 9; ++i) v.push_back(i);
    tkt::write_shard(dir / "train_000.bin", a);
    tkt::write_shard(dir / "train_001.bin", b);
    tkt::write_shard(dir / "val_000.bin", v);
    const std::string files = "train = " + toml_string(dir / "train_*.bin") + "\nvalidation = " +
                              toml_string(dir / "val_000.bin") + "\nseq_len = 8\n";
    auto d = make_data("tokens", files);
    REQUIRE(d.train->size() == 4);
    REQUIRE(d.validation->size() == 1);
    CHECK(d.info.vocab == 60010);  // the largest id + 1
    CHECK(d.info.next_token);
    CHECK(d.info.baseline_name == "unigram");
    auto batch = d.train->get(torch::tensor({3, 0, 2}, torch::kLong));
    auto span = [](const std::vector<int64_t>& t, int64_t from) {
      return torch::tensor(std::vector<int64_t>(t.begin() + from, t.begin() + from + 8), torch::kLong);
    };
    CHECK(torch::equal(batch.input, torch::stack({span(b, 0), span(a, 0), span(a, 16)})));
    CHECK(torch::equal(batch.target, torch::stack({span(b, 1), span(a, 1), span(a, 17)})));
    CHECK(batch.samples == 3);
    CHECK(batch.tokens == 24);
    // Version 2 holds uint32 ids.
    tkt::write_shard(dir / "wide.bin", {70000, 1, 2, 99999, 5}, 2);
    auto wide = make_data("tokens", "train = " + toml_string(dir / "wide.bin") + "\nseq_len = 4\n");
    CHECK(wide.info.vocab == 100000);
    CHECK(torch::equal(wide.train->get(torch::tensor({0}, torch::kLong)).target,
                       torch::tensor({{1, 2, 99999, 5}}, torch::kLong)));

    // Each malformed shard is refused before training, naming the file and what is wrong.
    auto refused = [&](const std::string& options, const std::string& what) {
      CAPTURE(options);
      CHECK_THROWS_WITH(make_data("tokens", options), doctest::Contains(what.c_str()));
    };
    tkt::write_shard(dir / "magic.bin", a, 1, -1, 12345);
    refused("train = " + toml_string(dir / "magic.bin"), "magic.bin: not a token shard (magic 12345, expected 20240520)");
    tkt::write_shard(dir / "version.bin", a, 3);
    refused("train = " + toml_string(dir / "version.bin"), "version.bin: token shard version 3 (expected 1");
    tkt::write_shard(dir / "count.bin", a, 1, 30);
    refused("train = " + toml_string(dir / "count.bin"),
            "count.bin: the header says 30 tokens of 2 bytes (1084 bytes with the header), the file has 1074 bytes");
    refused(files + "vocab = 1000", "train_001.bin: token 60009 is beyond the vocabulary of 1000");
    // An id no vocabulary has is refused before anything is counted or allocated for it.
    tkt::write_shard(dir / "huge_id.bin", {1, 2, 2147483648, 3, 4}, 2);
    refused("train = " + toml_string(dir / "huge_id.bin") + "\nseq_len = 2",
            "huge_id.bin: token 2147483648 (at token 2) is beyond 16777216, the largest vocabulary");
    refused(files + "vocab = 100000000", "vocab: is 100000000, beyond 16777216, the largest vocabulary");
    refused("train = " + toml_string(dir / "nothing_*.bin"), "matches no file");
    refused("train = " + toml_string(dir / "absent.bin"), "absent.bin: no such file");
    tkt::write_shard(dir / "short.bin", {1, 2, 3});
    refused("train = " + toml_string(dir / "short.bin") + "\nseq_len = 8",
            "short.bin: 3 tokens, fewer than one sequence of seq_len 8 needs (9)");
    refused("seq_len = 8", "train: give the training shards");

    // The GPT takes its vocabulary from the shards and trains on them.
    const std::string recipe = std::string("[run]\nseed = 1\nsteps = 4\n[model]\nname = \"gpt\"\nlayers = 1\n"
                                           "heads = 2\nwidth = 16\n[data]\nname = \"tokens\"\n") +
                               files + "[batch]\nmicro_batch = 2\n[optimizer]\nname = \"adamw\"\nlr = 0.01\n";
    tk::Trainer t(tkt::recipe({}, recipe.c_str()), tkt::quiet());
    auto r = t.fit();
    CHECK(r.window_losses.size() == 4);
    CHECK(t.model().named_parameters()["wte.weight"].size(0) == 60010);

    // A shard that changes under the run is an error naming it before its mapping is read (cut
    // short, the mapping would end the process with SIGBUS; rewritten, it would give other tokens).
    tkt::write_shard(dir / "cut.bin", a);
    auto cut = make_data("tokens", "train = " + toml_string(dir / "cut.bin") + "\nseq_len = 8\n");
    fs::resize_file(dir / "cut.bin", 1024 + 2 * 10);
    CHECK_THROWS_WITH(cut.train->get(torch::tensor({2}, torch::kLong)),
                      doctest::Contains("cut.bin: the shard changed while the run reads it (1074 bytes when the run "
                                        "opened it, 1044 now)"));
    tkt::write_shard(dir / "again.bin", a);
    auto again = make_data("tokens", "train = " + toml_string(dir / "again.bin") + "\nseq_len = 8\n");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // a later modification time
    tkt::write_shard(dir / "again.bin", std::vector<int64_t>(a.size(), 1));
    CHECK_THROWS_WITH(again.train->get(torch::tensor({0}, torch::kLong)), doctest::Contains("rewritten in place"));
    fs::remove_all(dir);
  }

  TEST_CASE("character-level text numbers UTF-8 characters; invalid UTF-8 is refused at its byte") {
    const fs::path dir = tkt::temp_dir("chars");
    fs::create_directories(dir);
    std::ofstream(dir / "u.txt", std::ios::binary) << "h\xc3\xa9llo \xe2\x82\xac";  // "héllo €"
    auto d = make_data("text", "path = " + toml_string(dir / "u.txt") + "\nlevel = \"char\"\nseq_len = 8\n"
                                                                       "validation_fraction = 0.0");
    CHECK(d.info.vocab == 6);  // ' ' h l o é €, numbered in code-point order
    auto b = d.train->get(torch::arange(1));
    CHECK(torch::equal(b.input[0].slice(0, 0, 6), torch::tensor({1, 4, 2, 2, 3, 0}, torch::kLong)));
    CHECK(b.target[0][5].item<int64_t>() == 5);
    std::ofstream(dir / "bad.txt", std::ios::binary) << "ab\xff" "cd";
    CHECK_THROWS_WITH(make_data("text", "path = " + toml_string(dir / "bad.txt") + "\nlevel = \"char\""),
                      doctest::Contains("bad.txt: not valid UTF-8 at byte 2 (use data.level = \"byte\")"));
    CHECK_THROWS_WITH(make_data("text", "path = \"/nonexistent.txt\""), doctest::Contains("no such file: /nonexistent.txt"));
    fs::remove_all(dir);
  }

  TEST_CASE("the GPT is causal, sized by its options, and ties its head on request") {
    const tk::DataInfo info = tokens_11x8();
    torch::manual_seed(0);
    auto tied = make_model("gpt", "layers = 2\nwidth = 16\nheads = 4", info);
    auto untied = make_model("gpt", "layers = 2\nwidth = 16\nheads = 4\ntied_head = false", info);
    auto count = [](tk::Model& m) {
      int64_t n = 0;
      for (const auto& p : m.parameters()) n += p.numel();
      return n;
    };
    // Embeddings 11*16 + 8*16; per block: 2 LayerNorms 4*16, qkv 16*48+48, proj 16*16+16,
    // fc 16*64+64, proj 64*16+16; final LayerNorm 2*16; untied head 16*11.
    const int64_t block = 4 * 16 + 16 * 48 + 48 + 16 * 16 + 16 + 16 * 64 + 64 + 64 * 16 + 16;
    CHECK(count(*tied) == 11 * 16 + 8 * 16 + 2 * block + 2 * 16);
    CHECK(count(*untied) == count(*tied) + 16 * 11);
    CHECK(tied->named_parameters().find("head.weight") == nullptr);
    CHECK(untied->named_parameters().find("head.weight") != nullptr);
    CHECK(tied->named_parameters().find("blocks.1.attn.qkv.weight") != nullptr);

    tied->eval();
    auto x = torch::randint(0, 11, {2, 8}, torch::kLong);
    auto y = tied->forward(x);
    CHECK(y.sizes() == torch::IntArrayRef{2, 8, 11});
    auto x2 = x.clone();
    x2.index_put_({torch::indexing::Slice(), 5}, (x.select(1, 5) + 1) % 11);
    auto y2 = tied->forward(x2);
    CHECK(torch::allclose(y.slice(1, 0, 5), y2.slice(1, 0, 5), 1e-6, 1e-6));  // the past does not see the future
    CHECK_FALSE(torch::allclose(y.slice(1, 5), y2.slice(1, 5), 1e-6, 1e-6));

    CHECK_THROWS_WITH(make_model("gpt", "width = 18\nheads = 4", info),
                      doctest::Contains("width 18 is not divisible by 4 heads"));
    CHECK_THROWS_WITH(make_model("gpt", "context = 4", info),
                      doctest::Contains("shorter than the data's sequences of 8"));
    CHECK_THROWS_WITH(tied->forward(torch::zeros({1, 9}, torch::kLong)),
                      doctest::Contains("sequences of 9 positions exceed its context of 8"));
    CHECK_THROWS_WITH(make_model("mlp", "", info), doctest::Contains("model 'mlp' takes real-valued inputs"));
    tk::DataInfo features;
    features.input_dim = 5;
    features.output_dim = 3;
    features.input_shape = {5};
    CHECK_THROWS_WITH(make_model("gpt", "", features),
                      doctest::Contains("model 'gpt' needs token-id sequences (e.g. data 'text'), but the data "
                                        "gives features [5]"));
    CHECK_THROWS_WITH(make_model("cnn", "", features),
                      doctest::Contains("model 'cnn' needs image inputs [channels, height, width]"));
  }

  /// The GPT's forward written out by hand in float64, with rotary positions as one rotation
  /// matrix per position (not the model's split halves) and RMSNorm as its formula.
  torch::Tensor reference_gpt(tk::Model& m, const torch::Tensor& idx, int64_t layers, int64_t heads, double base) {
    auto p = [&](const std::string& n) { return m.named_parameters()[n]; };
    auto rms = [](const torch::Tensor& x, const torch::Tensor& w) {
      return x / torch::sqrt((x * x).mean(-1, true) + 1e-6) * w;
    };
    const int64_t b = idx.size(0), t = idx.size(1), c = p("wte.weight").size(1), d = c / heads;
    auto rot = torch::zeros({t, d, d}, torch::kDouble);  // rot[pos] @ feature vector
    for (int64_t pos = 0; pos < t; ++pos)
      for (int64_t i = 0; i < d / 2; ++i) {
        const double a = static_cast<double>(pos) * std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(d));
        rot[pos][i][i] = std::cos(a);
        rot[pos][i][i + d / 2] = -std::sin(a);
        rot[pos][i + d / 2][i] = std::sin(a);
        rot[pos][i + d / 2][i + d / 2] = std::cos(a);
      }
    auto mask = torch::ones({t, t}, torch::kBool).triu(1);
    auto x = p("wte.weight").index_select(0, idx.flatten()).view({b, t, c});
    for (int64_t l = 0; l < layers; ++l) {
      const std::string k = "blocks." + std::to_string(l) + ".";
      auto h = rms(x, p(k + "ln1.weight"));
      auto qkv = at::linear(h, p(k + "attn.qkv.weight"), p(k + "attn.qkv.bias"))
                     .view({b, t, 3, heads, d}).permute({2, 0, 3, 1, 4});
      auto q = torch::einsum("tij,bhtj->bhti", {rot, qkv[0]}), kk = torch::einsum("tij,bhtj->bhti", {rot, qkv[1]});
      auto s = torch::matmul(q, kk.transpose(-2, -1)) / std::sqrt(static_cast<double>(d));
      auto y = torch::matmul(torch::softmax(s.masked_fill(mask, -INFINITY), -1), qkv[2]).transpose(1, 2).reshape({b, t, c});
      x = x + at::linear(y, p(k + "attn.proj.weight"), p(k + "attn.proj.bias"));
      auto f = torch::gelu(at::linear(rms(x, p(k + "ln2.weight")), p(k + "fc.weight"), p(k + "fc.bias")));
      x = x + at::linear(f, p(k + "proj.weight"), p(k + "proj.bias"));
    }
    return torch::matmul(rms(x, p("ln_f.weight")), p("wte.weight").t());
  }

  TEST_CASE("the built-in models count their training FLOPs as a hand count of their products does") {
    const tk::DataInfo info = tokens_11x8();
    auto gpt = make_model("gpt", "layers = 2\nwidth = 16\nheads = 4", info);
    // Per token, forward, per block: qkv 2*16*48, attention projection 2*16*16, MLP 2*16*64 +
    // 2*64*16; scores 2*8*16 and weighted values 2*8*16 over the 8 positions. Head 2*16*11.
    // Training is forward and a backward of twice its products.
    const double block = 2 * 16 * 48 + 2 * 16 * 16 + 2 * 16 * 64 + 2 * 64 * 16 + 2 * 8 * 16 + 2 * 8 * 16;
    const double per_token = 2 * block + 2 * 16 * 11;
    CHECK(tk::train_flops_of(*gpt, {3, 8}) == doctest::Approx(3 * 3 * 8 * per_token).epsilon(1e-12));
    // Rotary positions and RMSNorm add only elementwise work, which is not counted.
    auto modern = make_model("gpt", "layers = 2\nwidth = 16\nheads = 4\nposition = \"rotary\"\nnorm = \"rmsnorm\"", info);
    CHECK(tk::train_flops_of(*modern, {3, 8}) == tk::train_flops_of(*gpt, {3, 8}));

    tk::DataInfo features;
    features.input_dim = 5;
    features.output_dim = 3;
    features.input_shape = {5};
    auto mlp = make_model("mlp", "hidden = [7, 4]", features);
    CHECK(tk::train_flops_of(*mlp, {10, 5}) == 3 * 2 * 10 * (5 * 7 + 7 * 4 + 4 * 3));

    tk::DataInfo images;
    images.input_dim = 1 * 8 * 8;
    images.output_dim = 10;
    images.input_shape = {1, 8, 8};
    auto cnn = make_model("cnn", "channels = [4, 6]\nkernel = 3\nhidden = 16", images);
    // conv 1: 3*3*1*4 MACs at 8x8; conv 2: 3*3*4*6 at 4x4; fc 6*2*2 -> 16; head 16 -> 10.
    const double macs = 9 * 1 * 4 * 64 + 9 * 4 * 6 * 16 + 6 * 2 * 2 * 16 + 16 * 10;
    CHECK(tk::train_flops_of(*cnn, {2, 1, 8, 8}) == 3 * 2 * 2 * macs);
  }

  TEST_CASE("a tied head's table gets the untied head's gradient plus the embedding's, to the bit") {
    // The tied table's gradient comes back from the lookup as sparse rows that autograd adds into
    // the head's dense gradient; untied, the embedding's dense backward and the head's are apart.
    const tk::DataInfo info = tokens_11x8();
    torch::manual_seed(4);
    auto tied = make_model("gpt", "layers = 1\nwidth = 16\nheads = 2\ntied_head = true", info);
    auto untied = make_model("gpt", "layers = 1\nwidth = 16\nheads = 2\ntied_head = false", info);
    tied->to(torch::kDouble);
    untied->to(torch::kDouble);
    {
      torch::NoGradGuard no_grad;
      for (const auto& p : tied->named_parameters()) untied->named_parameters()[p.key()].copy_(p.value());
      untied->named_parameters()["head.weight"].copy_(tied->named_parameters()["wte.weight"]);
    }
    // Tokens repeat within and across sequences, and some of the 11 never come.
    const auto idx = torch::tensor({0, 3, 3, 5, 0, 9, 3, 1, 5, 5, 0, 2, 3, 9, 9, 1}, torch::kLong).view({2, 8});
    const auto weights = torch::randn({2, 8, 11}, torch::kDouble);
    const auto out = tied->forward(idx);
    // The tied table's lookup is the sparse-rows one: a node of its own in the graph.
    std::vector<torch::autograd::Node*> todo = {out.grad_fn().get()};
    std::set<torch::autograd::Node*> seen;
    bool lookup = false;
    while (!todo.empty()) {
      torch::autograd::Node* n = todo.back();
      todo.pop_back();
      if (!n || !seen.insert(n).second) continue;
      lookup |= n->name().find("TiedLookup") != std::string::npos;
      for (const auto& e : n->next_edges()) todo.push_back(e.function.get());
    }
    CHECK(lookup);
    (out * weights).sum().backward();
    (untied->forward(idx) * weights).sum().backward();
    const auto got = tied->named_parameters()["wte.weight"].grad();
    REQUIRE(got.defined());
    CHECK_FALSE(got.is_sparse());  // the table's gradient is dense, as the optimizer needs it
    const auto want = untied->named_parameters()["head.weight"].grad() + untied->named_parameters()["wte.weight"].grad();
    CHECK(torch::equal(got, want));
    for (const auto& p : tied->named_parameters()) {
      CAPTURE(p.key());
      if (p.key() != "wte.weight") CHECK(torch::equal(p.value().grad(), untied->named_parameters()[p.key()].grad()));
    }
  }

  TEST_CASE("the GPT's rotary positions and RMSNorm equal the formulas written out by hand") {
    const tk::DataInfo info = tokens_11x8();
    torch::manual_seed(0);
    auto m = make_model("gpt", "layers = 2\nwidth = 16\nheads = 2\nposition = \"rotary\"\nrotary_base = 100.0\nnorm = \"rmsnorm\"", info);
    // No position embedding, and RMSNorm has no bias: 11*16 + 2 * (2*16 + 12*16*16 + 9*16) + 16.
    int64_t n = 0;
    for (const auto& p : m->parameters()) n += p.numel();
    CHECK(n == 11 * 16 + 2 * (2 * 16 + 12 * 16 * 16 + 9 * 16) + 16);
    CHECK(m->named_parameters().find("wpe.weight") == nullptr);
    CHECK(m->named_parameters().find("blocks.0.ln1.bias") == nullptr);
    CHECK(m->named_parameters().find("blocks.0.ln1.weight") != nullptr);
    m->to(torch::kDouble);
    {
      torch::NoGradGuard no_grad;  // norms that are not all ones, so their scale is seen
      for (auto& p : m->named_parameters())
        if (p.key().find("ln") != std::string::npos) p.value().uniform_(0.5, 1.5);
    }
    m->eval();
    auto idx = torch::randint(0, 11, {3, 8}, torch::kLong);
    auto want = reference_gpt(*m, idx, 2, 2, 100.0);
    auto got = m->forward(idx);
    CHECK(torch::allclose(got, want, 1e-10, 1e-10));
    // Shorter sequences take their own angles; a float32 copy agrees to float32's precision.
    CHECK(torch::allclose(m->forward(idx.slice(1, 0, 5)), want.slice(1, 0, 5), 1e-10, 1e-10));
    m->to(torch::kFloat);
    CHECK(torch::allclose(m->forward(idx).to(torch::kDouble), want, 1e-4, 1e-4));

    // Each option alone is a different model from the default one, and trains (gradients reach
    // every parameter).
    for (const char* opts : {"position = \"rotary\"", "norm = \"rmsnorm\""}) {
      CAPTURE(opts);
      auto one = make_model("gpt", std::string("layers = 1\nwidth = 16\nheads = 4\n") + opts, info);
      auto loss = one->forward(idx).square().mean();
      loss.backward();
      for (const auto& p : one->named_parameters()) {
        CAPTURE(p.key());
        CHECK(p.value().grad().defined());
      }
    }
    CHECK_THROWS_WITH(make_model("gpt", "width = 12\nheads = 4\nposition = \"rotary\"", info),
                      doctest::Contains("each head has 3 (width / heads must be even)"));
    CHECK_THROWS_WITH(make_model("gpt", "position = \"alibi\"", info), doctest::Contains("learned"));
    CHECK_THROWS_WITH(make_model("gpt", "position = \"rotary\"\nrotary_base = 1.0", info),
                      doctest::Contains("rotary_base"));
  }

  /// Three parameters of `dtype` (the same values for every call with the same seed).
  std::vector<torch::Tensor> optimizer_params(torch::ScalarType dtype) {
    torch::manual_seed(3);
    std::vector<torch::Tensor> ps;
    for (auto shape : {std::vector<int64_t>{5, 3}, {7}, {2, 2, 2}})
      ps.push_back(torch::randn(shape, torch::TensorOptions().dtype(dtype)).requires_grad_());
    return ps;
  }

  /// Gives each set of parameters the same seeded gradients of step `step`; parameter 1 has none at
  /// steps 1 and 4 (an unused parameter: its state and step count fall behind the others').
  void give_grads(const std::vector<std::vector<torch::Tensor>*>& sets, int step) {
    auto gen = at::detail::createCPUGenerator(100 + step);
    const auto& first = *sets.front();
    for (size_t i = 0; i < first.size(); ++i) {
      const bool none = i == 1 && (step == 1 || step == 4);
      auto g = at::normal(0.0, 1.0, first[i].sizes(), gen, first[i].options().requires_grad(false));
      for (auto* set : sets) (*set)[i].mutable_grad() = none ? torch::Tensor() : g.clone();
    }
  }

  void check_same(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b, double tol) {
    for (size_t i = 0; i < a.size(); ++i) {
      CAPTURE(i);
      if (tol == 0.0) CHECK(torch::equal(a[i], b[i]));
      else CHECK(torch::allclose(a[i], b[i], tol, tol));
    }
  }

  TEST_CASE("foreach optimizers take LibTorch's per-tensor steps bit for bit and resume from its state") {
    const std::vector<std::pair<std::string, std::string>> cases = {
        {"adamw", "lr = 0.01\nweight_decay = 0.1"}, {"adamw", "amsgrad = true"},
        {"adam", "lr = 0.01\nweight_decay = 0.01"}, {"adam", "amsgrad = true"},
        {"sgd", "momentum = 0.9\nweight_decay = 0.01"}, {"sgd", "momentum = 0.9\nnesterov = true"},
        {"sgd", "momentum = 0.9\ndampening = 0.5"}, {"sgd", "lr = 0.1"}};
    for (const auto& [name, opts] : cases)
      for (auto dtype : {torch::kFloat, torch::kDouble}) {
        CAPTURE(name);
        CAPTURE(opts);
        CAPTURE(dtype);
        auto a = optimizer_params(dtype), b = optimizer_params(dtype);
        auto per_tensor = make_optimizer(name, opts + "\nimplementation = \"per_tensor\"", a);
        auto foreach = make_optimizer(name, opts + "\nimplementation = \"foreach\"", b);
        CHECK(typeid(*per_tensor) != typeid(*foreach));  // the foreach form is its own step
        // "auto" on CPU parameters is LibTorch's own step, AdamW's one-pass step for AdamW.
        const auto automatic = make_optimizer(name, opts, optimizer_params(dtype));
        if (name == "adamw") CHECK(typeid(*automatic) != typeid(*per_tensor));
        else CHECK(typeid(*automatic) == typeid(*per_tensor));
        std::vector<torch::Tensor> c;
        std::unique_ptr<torch::optim::Optimizer> resumed;
        for (int step = 0; step < 6; ++step) {
          if (step == 3) {
            // LibTorch's state, saved and loaded into the foreach form over a copy of the parameters.
            torch::serialize::OutputArchive out;
            per_tensor->save(out);
            std::ostringstream bytes;
            out.save_to(bytes);
            for (const auto& p : a) c.push_back(p.detach().clone().requires_grad_());
            resumed = make_optimizer(name, opts + "\nimplementation = \"foreach\"", c);
            torch::serialize::InputArchive in;
            std::istringstream from(bytes.str());
            in.load_from(from);
            resumed->load(in);
          }
          std::vector<std::vector<torch::Tensor>*> sets = {&a, &b};
          if (resumed) sets.push_back(&c);
          give_grads(sets, step);
          per_tensor->step();
          foreach->step();
          if (resumed) resumed->step();
          check_same(a, b, 0.0);
          if (resumed) check_same(a, c, 0.0);
        }
        // The parameters moved: the comparison is not of untouched tensors.
        CHECK_FALSE(torch::equal(a[0], optimizer_params(dtype)[0]));
      }
  }

  TEST_CASE("the fused AdamW runs on CPU and CUDA: elsewhere it is refused, naming the device") {
    std::vector<torch::Tensor> meta = {torch::empty({4}, torch::TensorOptions().device(torch::kMeta)).requires_grad_()};
    CHECK_THROWS_WITH(make_optimizer("adamw", "implementation = \"fused\"", meta),
                      doctest::Contains("\"fused\" runs on CPU and CUDA, not on meta"));
  }

  TEST_CASE("the fused AdamW agrees with the per-tensor step to rounding, with AMSGrad, in any layout") {
    for (const std::string opts : {"lr = 0.01\nweight_decay = 0.1", "lr = 0.02\namsgrad = true\nweight_decay = 0"})
      for (auto [dtype, tol] : {std::pair{torch::kFloat, 1e-6}, std::pair{torch::kDouble, 1e-14}}) {
        CAPTURE(opts);
        CAPTURE(dtype);
        auto a = optimizer_params(dtype), b = optimizer_params(dtype);
        // A transposed parameter is not contiguous: the one-pass loop leaves it to LibTorch's operations.
        for (auto* set : {&a, &b}) set->push_back(torch::randn({3, 4}, torch::dtype(dtype)).t().detach().requires_grad_());
        b.back().data().copy_(a.back().data());
        auto per_tensor = make_optimizer("adamw", opts + "\nimplementation = \"per_tensor\"", a);
        auto fused = make_optimizer("adamw", opts + "\nimplementation = \"fused\"", b);
        const auto automatic = make_optimizer("adamw", opts, optimizer_params(dtype));
        CHECK(typeid(*fused) == typeid(*automatic));  // auto, on the CPU
        for (int step = 0; step < 6; ++step) {
          give_grads({&a, &b}, step);
          per_tensor->step();
          fused->step();
          check_same(a, b, tol);
        }
        CHECK_FALSE(torch::equal(a[0], optimizer_params(dtype)[0]));
      }
  }

  TEST_CASE("the fused AdamW steps an element alike wherever it lies: a parameter split in two steps as the whole") {
    // 100003 elements: the loop runs in chunks on threads, vectorized with a scalar tail; the two
    // halves put every element at another offset of its chunk and its vector.
    torch::manual_seed(5);
    const auto whole = torch::randn({100003}, torch::kFloat);
    std::vector<torch::Tensor> one = {whole.clone().requires_grad_()};
    std::vector<torch::Tensor> two = {whole.slice(0, 0, 50001).clone().requires_grad_(),
                                      whole.slice(0, 50001).clone().requires_grad_()};
    const std::string opts = "lr = 0.01\nweight_decay = 0.1\nimplementation = \"fused\"";
    auto a = make_optimizer("adamw", opts, one), b = make_optimizer("adamw", opts, two);
    for (int step = 0; step < 4; ++step) {
      const auto g = torch::randn({100003}, torch::kFloat);
      one[0].mutable_grad() = g.clone();
      two[0].mutable_grad() = g.slice(0, 0, 50001).clone();
      two[1].mutable_grad() = g.slice(0, 50001).clone();
      a->step();
      b->step();
    }
    CHECK(torch::equal(one[0], torch::cat({two[0], two[1]})));
    CHECK_FALSE(torch::equal(one[0], whole));
  }

  TEST_CASE("the CNN maps images to class scores") {
    tk::DataInfo info;
    info.input_dim = 28 * 28;
    info.output_dim = 10;
    info.input_shape = {1, 28, 28};
    auto m = make_model("cnn", "channels = [4, 8]\nhidden = 16\nbatchnorm = true", info);
    CHECK(m->forward(torch::randn({3, 1, 28, 28})).sizes() == torch::IntArrayRef{3, 10});
    CHECK(tk::has_batchnorm(*m));
    CHECK_THROWS_WITH(make_model("cnn", "channels = [4, 4, 4, 4, 4, 4]", info),
                      doctest::Contains("6 stages halve a 28x28 image to nothing"));
    CHECK_THROWS_WITH(make_model("cnn", "kernel = 4", info), doctest::Contains("must be odd"));
  }

  TEST_CASE("GPT on padded documents: 4 x 2 accumulated by tokens is the step of one batch of 8") {
    const fs::path dir = fake_corpus("gpt-accum");
    const std::string path = "data.path=\"" + (dir / "corpus.txt").string() + "\"";
    const std::string accum = std::string(kGptRecipe) + "[[plugins]]\nname = \"grad_accum\"\nsteps = 4\n";
    auto run = [&](const std::string& text, const std::vector<std::string>& sets) {
      auto r = tkt::recipe(std::vector<std::string>{path} + sets, text.c_str());
      tk::Trainer t(r, tkt::quiet());
      auto res = t.fit();
      return std::make_pair(tkt::flat_params(t.model()), res.window_losses);
    };
    auto [big, big_losses] = run(kGptRecipe, {"batch.micro_batch=8"});
    auto [acc, acc_losses] = run(accum, {"batch.micro_batch=2", "loss.reduction=\"sum\"",
                                         "plugins.grad_accum.normalize=\"tokens\""});
    CHECK(tkt::excess(acc, big, tkt::tol_for(torch::kDouble)) <= 1.0);
    REQUIRE(acc_losses.size() == 3);
    for (size_t i = 0; i < 3; ++i) CHECK(acc_losses[i] == doctest::Approx(big_losses[i]).epsilon(1e-10));
    // The mean of per-micro-batch means weighs the padded micro-batches wrongly: visibly different.
    auto [means, means_losses] = run(accum, {"batch.micro_batch=2"});
    CHECK(tkt::distance(means, big) > 1e-4);
    fs::remove_all(dir);
  }

  TEST_CASE("the GPT with dropout, interrupted and resumed, is bit-identical to an uninterrupted run") {
    // Dropout draws from the random generator: the checkpoint must carry its state.
    const fs::path dir = fake_corpus("gpt-resume");
    const std::string text = std::string(kGptRecipe) + "[[plugins]]\nname = \"grad_accum\"\nsteps = 2\n";
    const std::vector<std::string> sets = {"data.path=\"" + (dir / "corpus.txt").string() + "\"", "model.dropout=0.2",
                                           "run.steps=6", "batch.micro_batch=4"};
    auto opts = tkt::quiet();
    opts.write_outputs = true;
    auto r1 = tkt::recipe(sets + std::vector<std::string>{"run.output=\"" + (dir / "one").string() + "\""}, text.c_str());
    tk::Trainer one(r1, opts);
    one.fit();

    const std::vector<std::string> out = {"run.output=\"" + (dir / "two").string() + "\"", "run.checkpoint_every=3"};
    auto r2 = tkt::recipe(sets + out, (text + "[[plugins]]\nname = \"probe\"\nthrow_at_step = 5\n").c_str());
    tk::Trainer first(r2, opts);
    CHECK_THROWS_AS(first.fit(), tk::PluginRuntimeError);
    auto resume = opts;
    resume.resume = "latest";
    resume.allow_changes = {"plugins"};  // without the probe that made it fail
    auto r3 = tkt::recipe(sets + out, text.c_str());
    tk::Trainer second(r3, resume);
    CHECK(second.fit().steps == 6);
    CHECK(torch::equal(tkt::flat_params(second.model()), tkt::flat_params(one.model())));
    CHECK(tkt::metric(dir / "two/metrics.jsonl", "loss") == tkt::metric(dir / "one/metrics.jsonl", "loss"));
    fs::remove_all(dir);
  }

  TEST_CASE("a language model's validation reports perplexity, and its data its unigram baseline") {
    const fs::path dir = fake_corpus("gpt-ppl");
    const fs::path out = dir / "run";
    auto r = tkt::recipe({"data.path=\"" + (dir / "corpus.txt").string() + "\"", "data.validation_fraction=0.25",
                          "run.output=\"" + out.string() + "\"", "run.validate_every=2", "run.steps=4"},
                         kGptRecipe);
    auto opts = tkt::quiet();
    opts.write_outputs = true;
    tk::Trainer t(r, opts);
    CHECK(t.describe().find("unigram baseline loss") != std::string::npos);
    t.fit();
    auto loss = tkt::metric(out / "metrics.jsonl", "validation_loss");
    auto ppl = tkt::metric(out / "metrics.jsonl", "validation_perplexity");
    REQUIRE(ppl.size() == 4);
    CHECK(std::isnan(ppl[0]));
    CHECK(ppl[1] == doctest::Approx(std::exp(loss[1])).epsilon(1e-9));
    CHECK(ppl[3] == doctest::Approx(std::exp(loss[3])).epsilon(1e-9));
    CHECK(ppl[3] < ppl[1]);
    fs::remove_all(dir);
  }

  TEST_CASE("token ids prepared in Python train the GPT through the tensors data set") {
    const fs::path dir = tkt::temp_dir("token-tensors");
    fs::create_directories(dir);
    auto stream = torch::randint(0, 20, {40 * 7}, torch::kLong);
    auto rows = stream.view({40, 7});
    tk::save_tensor_dict(dir / "tokens.pt", {{"inputs", rows.slice(1, 0, 6).contiguous()},
                                             {"targets", rows.slice(1, 1, 7).contiguous()},
                                             {"float_inputs", rows.slice(1, 0, 6).to(torch::kFloat)}});
    std::string text = kGptRecipe;
    text.replace(text.find("name = \"text\""), 13, "name = \"tensors\"\ntoken_inputs = true");
    text.replace(text.find("seq_len = 12\ndocument_separator = \"\\n%\\n\"\n"), 42, "");
    auto r = tkt::recipe({"data.path=\"" + (dir / "tokens.pt").string() + "\"", "batch.micro_batch=8"}, text.c_str());
    tk::Trainer t(r, tkt::quiet());
    CHECK(t.data().info.vocab == 20);
    CHECK(t.data().info.next_token);
    CHECK(t.data().info.input_shape == std::vector<int64_t>{6});
    CHECK(t.fit().steps == 3);
    auto bad = tkt::recipe({"data.path=\"" + (dir / "tokens.pt").string() + "\"", "data.inputs=\"float_inputs\""},
                           text.c_str());
    CHECK_THROWS_WITH(tk::Trainer(bad, tkt::quiet()),
                      doctest::Contains("data.token_inputs: needs inputs of non-negative integer token ids [N, T], got Float [40, 6]"));
    fs::remove_all(dir);
  }

  TEST_CASE("float64 data keeps its precision through the tensors data set into a float64 run") {
    const fs::path dir = tkt::temp_dir("float64-tensors");
    fs::create_directories(dir);
    // Values float32 cannot hold: rounding them would show in every bit below the 24th.
    auto x = (torch::randn({48, 5}, torch::kDouble) * (1.0 + 1e-12)).contiguous();
    auto y = (torch::randn({48, 2}, torch::kDouble) / 3.0).contiguous();
    auto ints = torch::randint(0, 1 << 30, {48, 5}, torch::kLong);
    REQUIRE(!torch::equal(x.to(torch::kFloat).to(torch::kDouble), x));
    tk::save_tensor_dict(dir / "data.pt", {{"inputs", x}, {"targets", y}, {"ints", ints}});
    const std::string text = R"(
[run]
dtype = "float64"
steps = 2
[model]
name = "mlp"
hidden = [4]
[data]
name = "tensors"
validation_fraction = 0.0
shuffle = false
[batch]
micro_batch = 48
[optimizer]
name = "sgd"
)";
    auto r = tkt::recipe({"data.path=\"" + (dir / "data.pt").string() + "\""}, text.c_str());
    tk::Trainer t(r, tkt::quiet());
    auto all = t.data().train->get(torch::arange(48));
    CHECK((all.input.scalar_type() == torch::kDouble));
    CHECK(torch::equal(all.input, x));
    CHECK(torch::equal(all.target, y));
    // What the model sees in the first step is the data itself.
    struct Inputs final : tk::Plugin {
      std::vector<torch::Tensor> seen;
      void on_micro_batch(tk::MicroBatchContext& ctx) override { seen.push_back(ctx.batch()->input.clone()); }
    };
    auto c = std::make_shared<Inputs>();
    t.add_plugin(c, "inputs");
    t.fit();
    REQUIRE(!c->seen.empty());
    CHECK(torch::equal(c->seen.front(), x));
    // Integer features wider than float32's 24-bit mantissa become float64, exactly.
    auto wide = tkt::recipe({"data.path=\"" + (dir / "data.pt").string() + "\"", "data.inputs=\"ints\""}, text.c_str());
    tk::Trainer tw(wide, tkt::quiet());
    CHECK(torch::equal(tw.data().train->get(torch::arange(48)).input, ints.to(torch::kDouble)));
    fs::remove_all(dir);
  }

  TEST_CASE("a TorchScript model file that is missing or not TorchScript is refused, naming it") {
    const fs::path dir = tkt::temp_dir("torchscript");
    fs::create_directories(dir);
    std::ofstream(dir / "junk.pt") << "junk";
    const char* text = R"(
[model]
torchscript = "set below"
[data]
name = "synthetic-classification"
[optimizer]
name = "sgd"
)";
    for (auto [file, expect] : {std::pair<std::string, std::string>{(dir / "none.pt").string(), "no such file"},
                                {(dir / "junk.pt").string(), "junk.pt is not a TorchScript module this LibTorch"}}) {
      auto r = tkt::recipe({"model.torchscript=\"" + file + "\""}, text);
      CHECK_THROWS_WITH(tk::Trainer(r, tkt::quiet()), doctest::Contains("model.torchscript: "));
      CHECK_THROWS_WITH(tk::Trainer(r, tkt::quiet()), doctest::Contains(expect.c_str()));
    }
    fs::remove_all(dir);
  }
}
