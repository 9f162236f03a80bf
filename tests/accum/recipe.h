#pragma once
// The recipe both accumulation suites start from: an MLP on 256 synthetic examples in float64,
// micro-batches of 8, 5 SGD steps.
#include <sstream>
#include <string>

inline const char* const kAccumRecipe = R"(
[run]
seed = 11
steps = 5
dtype = "float64"

[model]
name = "mlp"
hidden = [24, 16]
activation = "tanh"

[data]
name = "synthetic-classification"
samples = 256
validation_samples = 0
features = 10
classes = 5

[batch]
micro_batch = 8

[optimizer]
name = "sgd"
lr = 0.1
)";

/// `base` with grad_accum listed and the window given as TOML lines in the form of the plugin's
/// old options: the batch's shape goes to [batch] (steps is [batch] accumulation), the rest
/// (normalize) stays the plugin's.
inline std::string with_grad_accum(const std::string& lines, std::string base = kAccumRecipe) {
  std::string batch, plugin, line;
  std::istringstream in(lines);
  while (std::getline(in, line)) {
    if (line.rfind("normalize", 0) == 0)
      plugin += line + "\n";
    else if (line.rfind("steps", 0) == 0)
      batch += "accumulation" + line.substr(5) + "\n";
    else if (!line.empty())
      batch += line + "\n";
  }
  const auto at = base.find("[batch]\n");
  if (at == std::string::npos)
    base += "\n[batch]\n" + batch;
  else
    base.insert(at + 8, batch);
  return base + "\n[[plugins]]\nname = \"grad_accum\"\n" + plugin;
}
