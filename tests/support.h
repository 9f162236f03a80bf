#pragma once
// Helpers shared by the test suites: recipes, in-process probes and tensor comparisons.
#include <tk/doctest.h>
#include <tk/loader.h>
#include <tk/trainer.h>
#include <torch/types.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

/// Two lists of overrides, one after the other.
inline std::vector<std::string> operator+(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

/// Ends a test case that cannot run here, saying why. Such a case is named "... (may skip)" and
/// runs in a ctest entry of its own (tk_skippable_cases in tests/CMakeLists.txt), which ctest then
/// reports as skipped, not passed.
#define TK_SKIP_IF(condition, why)                                  \
  do {                                                              \
    if (condition) {                                                \
      std::printf("SKIPPED: %s\n", std::string(why).c_str());       \
      std::fflush(stdout);                                          \
      return;                                                       \
    }                                                               \
  } while (0)

namespace tkt {

using tk::testing::kTinyRecipe;
using Capture = tk::testing::Capture;

/// Recipe from text plus `--set`-style overrides.
inline tk::Recipe recipe(const std::vector<std::string>& overrides = {}, const char* text = kTinyRecipe) {
  auto r = tk::Recipe::from_string(text, "test.toml");
  for (const auto& o : overrides) r.apply_override(o);
  return r;
}

/// A fresh, empty temporary folder path for one test (unique per process and name).
inline std::filesystem::path temp_dir(const std::string& name) {
  auto d = std::filesystem::temp_directory_path() / ("tk-test-" + std::to_string(getpid()) + "-" + name);
  std::filesystem::remove_all(d);
  return d;
}

/// Values of `key` in every line of a metrics.jsonl (NaN where absent or null).
inline std::vector<double> metric(const std::filesystem::path& file, const std::string& key) {
  std::ifstream in(file);
  std::vector<double> out;
  const std::string pat = "\"" + key + "\": ";
  for (std::string line; std::getline(in, line);) {
    auto pos = line.find(pat);
    if (pos == std::string::npos || line.compare(pos + pat.size(), 4, "null") == 0) {
      out.push_back(std::nan(""));
      continue;
    }
    out.push_back(std::stod(line.substr(pos + pat.size())));
  }
  return out;
}
inline std::vector<bool> skipped(const std::filesystem::path& file) {
  std::ifstream in(file);
  std::vector<bool> out;
  for (std::string line; std::getline(in, line);) out.push_back(line.find("\"skipped\": ") != std::string::npos);
  return out;
}

/// Trainer options for in-memory runs that find the project's and the fixture plugins.
inline tk::TrainerOptions quiet() {
  tk::TrainerOptions o;
  o.write_outputs = false;
  o.progress = tk::ProgressMode::None;
  o.plugin_dirs = std::vector<std::filesystem::path>{TK_PLUGIN_DIR, TK_TEST_PLUGIN_DIR};
  return o;
}

/// trainkit's own components (models, data sets, optimizers, ...), loaded once per process.
inline const tk::Registry& standard_registry() {
  static tk::Registry* registry = [] {
    auto* r = new tk::Registry();  // lives as long as the process: its libraries stay loaded
    tk::PluginLoader loader({TK_PLUGIN_DIR});
    for (const auto& name : tk::PluginLoader::standard_libraries()) loader.load(loader.find(name), *r);
    return r;
  }();
  return *registry;
}

/// All parameters (or their gradients) of a model as one flat float64 vector.
inline torch::Tensor flat_params(torch::nn::Module& m) {
  std::vector<torch::Tensor> parts;
  for (const auto& p : m.parameters()) parts.push_back(p.detach().reshape({-1}).to(torch::kDouble));
  return torch::cat(parts);
}
inline torch::Tensor flat_grads(torch::nn::Module& m) {
  std::vector<torch::Tensor> parts;
  for (const auto& p : m.parameters())
    parts.push_back(p.grad().defined() ? p.grad().detach().reshape({-1}).to(torch::kDouble)
                                       : torch::zeros({p.numel()}, torch::kDouble));
  return torch::cat(parts);
}

/// How closely two results computed two ways must agree, as in torch.allclose: element by
/// element |a - b| <= rtol |b| + atol, where atol is `scale_atol` times the largest |b| (so that
/// an element near zero is judged against the size of the tensor, and a tensor of small values
/// as strictly as one of large values).
struct Tol {
  double rtol;
  double scale_atol;
};
/// Tolerances fitted to the dtype the results were computed in: float64 agrees to about 1e-12
/// whatever the order of summation; float32 to about 1e-6 per operation, a few hundred operations
/// deep; bf16 and fp16 to their 8 and 11 bits of mantissa.
inline Tol tol_for(torch::ScalarType t) {
  switch (t) {
    case torch::kDouble: return {1e-10, 1e-12};
    case torch::kFloat: return {1e-4, 1e-5};
    case torch::kHalf: return {5e-3, 1e-3};
    case torch::kBFloat16: return {4e-2, 1e-2};
    default: return {0.0, 0.0};
  }
}
/// How far `a` is from `b` as a multiple of what `tol` allows: at most 1 when they agree, 0 when
/// identical, infinite when `b` is all zeros and `a` is not, NaN when either holds a NaN.
inline double excess(const torch::Tensor& a, const torch::Tensor& b, Tol tol) {
  REQUIRE(a.sizes() == b.sizes());
  const torch::Tensor x = a.detach().to(torch::kDouble), y = b.detach().to(torch::kDouble);
  const torch::Tensor diff = (x - y).abs();
  const double scale = y.abs().max().item<double>();
  if (!(scale > 0)) return diff.max().item<double>() == 0.0 ? 0.0 : INFINITY;
  return (diff / (tol.rtol * y.abs() + tol.scale_atol * scale)).max().item<double>();
}
/// max |a - b| / max |b|: how far apart two results are, relative to their size (for checks that
/// they differ).
inline double distance(const torch::Tensor& a, const torch::Tensor& b) {
  REQUIRE(a.sizes() == b.sizes());
  const torch::Tensor x = a.detach().to(torch::kDouble), y = b.detach().to(torch::kDouble);
  return (x - y).abs().max().item<double>() / y.abs().max().item<double>();
}

/// Sets an environment variable for the life of the guard, then puts back what was there.
class EnvGuard {
 public:
  EnvGuard(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    setenv(name, value.c_str(), 1);
  }
  ~EnvGuard() {
    if (old_) setenv(name_, old_->c_str(), 1);
    else unsetenv(name_);
  }
  EnvGuard(const EnvGuard&) = delete;
  EnvGuard& operator=(const EnvGuard&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

/// Writes `documents` documents of very different lengths (1 to 40 letters), separated by "\n%\n",
/// to `file`: text whose batches carry padding.
inline void write_documents(const std::filesystem::path& file, int documents) {
  std::string text;
  for (int i = 0; i < documents; ++i) {
    if (i) text += "\n%\n";
    for (int j = 0; j <= (i * 7) % 40; ++j) text.push_back(static_cast<char>('a' + (i * j + j) % 26));
  }
  std::ofstream(file, std::ios::binary) << text;
}

/// A token shard in llm.c's format: 256 int32 of header (magic, version, count), then the tokens
/// as uint16 (version 1) or uint32 (version 2), little-endian; `count` and `magic` may lie.
inline void write_shard(const std::filesystem::path& file, const std::vector<int64_t>& tokens, int32_t version = 1, int64_t count = -1,
                 int32_t magic = 20240520) {
  std::vector<int32_t> head(256, 0);
  head[0] = magic;
  head[1] = version;
  head[2] = static_cast<int32_t>(count < 0 ? static_cast<int64_t>(tokens.size()) : count);
  std::ofstream out(file, std::ios::binary);
  out.write(reinterpret_cast<const char*>(head.data()), 1024);
  for (int64_t t : tokens) {
    if (version == 1) {
      const uint16_t v = static_cast<uint16_t>(t);
      out.write(reinterpret_cast<const char*>(&v), 2);
    } else {
      const uint32_t v = static_cast<uint32_t>(t);
      out.write(reinterpret_cast<const char*>(&v), 4);
    }
  }
}

/// Table-driven cases: one doctest case per row of `Table` (an array of rows with a `name`, a string
/// literal), each running `Check(row)`, so that each row is a case of its own (its own ctest entry,
/// its own --test-case filter) and a new case of the same shape is one more row. Use TKT_TABLE_CASES
/// inside the TEST_SUITE the cases belong to.
template <const auto& Table, auto Check, size_t I>
void table_row() {
  Check(Table[I]);
}
template <const auto& Table, auto Check, size_t... I>
int register_table(const doctest::detail::TestSuite& suite, const char* file, unsigned line, std::index_sequence<I...>) {
  (doctest::detail::regTest(doctest::detail::TestCase(&table_row<Table, Check, I>, file, line, suite) * Table[I].name), ...);
  return 0;
}
#define TKT_TABLE_CASES(table, check)                                                                      \
  static const int DOCTEST_ANONYMOUS(tkt_table_) = tkt::register_table<table, check>(                      \
      doctest_detail_test_suite_ns::getCurrentTestSuite(), __FILE__, __LINE__,                             \
      std::make_index_sequence<std::size(table)>{})

}  // namespace tkt
