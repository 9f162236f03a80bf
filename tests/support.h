#pragma once
// Helpers shared by the test suites: recipes, in-process probes and tensor comparisons.
#include <tk/doctest.h>
#include <tk/trainer.h>
#include <torch/types.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

/// Two lists of overrides, one after the other.
inline std::vector<std::string> operator+(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

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

/// max |a - b| / (1 + max |b|): a relative distance that is robust near zero.
inline double rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  REQUIRE(a.sizes() == b.sizes());
  return (a - b).abs().max().item<double>() / (1.0 + b.abs().max().item<double>());
}

}  // namespace tkt
