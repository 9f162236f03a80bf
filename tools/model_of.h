#pragma once
// What the tools that use a trained model share (tk-sample, tk-export): a run's output folder or a
// recipe, its model built as it was trained, and its weights loaded by name.
#include <spdlog/spdlog.h>
#include <toml++/toml.h>
#include <torch/torch.h>
#include <tk/data.h>
#include <tk/recipe.h>
#include <tk/tensor_io.h>
#include <tk/trainer.h>

#include <filesystem>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace tk {

/// A run's output folder (its recipe.toml and weights.safetensors), or a recipe file, whose model
/// starts from the weights the recipe names ([model] pretrained or init): no file to load.
struct RunOrRecipe {
  /// `path` as given on the command line; `weights`: the file to load instead ("": the run's). A
  /// checkpoints folder's `latest` file stands for the checkpoint it names (as --resume latest).
  RunOrRecipe(const std::filesystem::path& path, const std::string& weights_given)
      : from_recipe(std::filesystem::is_regular_file(path)),
        dir(from_recipe ? path.parent_path() : path),
        recipe(Recipe::from_file(from_recipe ? path : dir / "recipe.toml")),
        weights(!weights_given.empty() ? std::filesystem::path(weights_given)
                : from_recipe          ? std::filesystem::path()
                                       : dir / "weights.safetensors") {
    namespace fs = std::filesystem;
    std::error_code ec;
    if (!weights_given.empty() && weights.filename() == "latest" && fs::is_regular_file(weights, ec))
      weights = weights.has_parent_path() ? weights.parent_path() : fs::path(".");  // a checkpoints folder's latest
    if (weights_given.empty() && !from_recipe && !fs::exists(weights, ec) && fs::exists(dir / "recipe.toml", ec))
      throw std::runtime_error(
          dir.string() + " has no weights.safetensors (a run writes it as it completes)" +
          (fs::is_regular_file(dir / "checkpoints" / "latest", ec)
               ? "; its checkpoints have weights: --weights " + (dir / "checkpoints").string() + " takes the latest"
               : ", nor a checkpoint"));
  }
  /// Where the model's weights come from, where they are not a file given: a file its recipe's
  /// [model] names (pretrained, init, a TorchScript module, ...), or "" where it names none (the
  /// model as initialized, untrained).
  std::string starts_from() const {
    const auto table = toml::parse_file(recipe.source());
    if (const toml::table* model = table["model"].as_table())
      for (const auto& [key, value] : *model)  // its name names a model kind, never a file
        if (const auto file = value.value<std::string>(); file && !file->empty() && key.str() != "name") {
          std::error_code ec;
          if (std::filesystem::is_regular_file(recipe.resolve_path(*file), ec) ||
              std::filesystem::is_directory(recipe.resolve_path(*file), ec))
            return "[model] " + std::string(key.str()) + " = \"" + *file + "\"";
        }
    return "";
  }
  /// A line for standard error where the model is untrained (a recipe that names no weights), or "".
  std::string untrained_note(const char* tool) const {
    if (!weights.empty() || !starts_from().empty()) return "";
    return std::string(tool) + ": note: " + recipe.source() + " names no weights (no file in [model]: pretrained, "
           "init, ...; nor --weights): its model is as initialized, untrained. A run's output folder holds its "
           "trained weights.\n";
  }
  bool from_recipe;
  std::filesystem::path dir;
  Recipe recipe;
  std::filesystem::path weights;  // "" for a recipe given without --weights
};

/// The recipe's [data] values the tools read ("" when unset), from one parse of its file.
struct DataKeys {
  std::string name, level, train, validation;
  std::string pretrained;  // [model]'s: a published checkpoint's folder may hold its tokenizer
};
inline DataKeys data_keys(const Recipe& recipe) {
  const auto table = toml::parse_file(recipe.source());
  const auto value = [&](const char* key) { return std::string(table["data"][key].value_or("")); };
  return {value("name"), value("level"), value("train"), value("validation"),
          std::string(table["model"]["pretrained"].value_or(""))};
}

/// The files each pattern of a [data] file option (a file, a glob, or a list of them) names, in
/// order; a pattern that names none gives no file, and `all_found` false.
inline std::vector<std::string> files_named(const Recipe& recipe, const std::string& spec, bool* all_found = nullptr) {
  std::vector<std::string> out;
  if (all_found) *all_found = true;
  for (const auto& m : files_matching(spec, [&](const std::string& p) { return recipe.resolve_path(p); })) {
    for (const auto& f : m.files) out.push_back(f.string());
    if (m.files.empty() && all_found) *all_found = false;
  }
  return out;
}

/// The tokenizer of a run whose data is token shards, as files: what tk-tokenize wrote beside its
/// shards, else what its pretrained checkpoint's folder holds: a SentencePiece tokenizer.model,
/// a tokenizer.json, or a BPE's vocab.json and merges.txt (in that order of preference); none
/// when neither place has one.
inline std::vector<std::filesystem::path> tokenizer_files(const Recipe& recipe) {
  namespace fs = std::filesystem;
  const auto in = [](const fs::path& dir) -> std::vector<fs::path> {
    std::error_code ec;
    if (dir.empty() || !fs::is_directory(dir, ec)) return {};
    for (const char* one : {"tokenizer.model", "tokenizer.json"})
      if (fs::is_regular_file(dir / one, ec)) return {dir / one};
    if (fs::is_regular_file(dir / "vocab.json", ec) && fs::is_regular_file(dir / "merges.txt", ec))
      return {dir / "vocab.json", dir / "merges.txt"};
    return {};
  };
  const DataKeys data = data_keys(recipe);
  if (data.name != "tokens") return {};
  const auto shards = files_named(recipe, data.train);
  if (auto beside = in(shards.empty() ? fs::path() : fs::path(shards.front()).parent_path()); !beside.empty()) return beside;
  return data.pretrained.empty() ? std::vector<fs::path>() : in(recipe.resolve_path(data.pretrained));
}

/// A run's model built from its recipe (and run.device = `device`), planned as it was trained.
inline std::unique_ptr<Trainer> build_model(Recipe recipe, const std::string& device) {
  const std::string device_set = "run.device=\"" + device + "\"";
  recipe.apply_override(device_set);
  TrainerOptions topts;
  topts.write_outputs = false;
  topts.progress = ProgressMode::None;
  try {
    auto trainer = std::make_unique<Trainer>(recipe, topts);
    // Builds and plans the run: the model as trained, after every plugin's setup. The plan's advice
    // is for training (bf16 on this CPU, the batch's shape), not for this tool; what concerns the
    // weights (init's) was said as the Trainer was made.
    const auto level = spdlog::get_level();
    spdlog::set_level(spdlog::level::err);
    try {
      trainer->describe();
    } catch (...) {
      spdlog::set_level(level);
      throw;
    }
    spdlog::set_level(level);
    return trainer;
  } catch (const std::exception& e) {
    // The device is this tool's --device, not a --set the user typed.
    std::string why = message_of(e);
    for (const std::string& said : {"--set " + device_set + ": run.device: ", "--set " + device_set + ": "})
      if (why.rfind(said, 0) == 0) throw std::runtime_error("--device " + device + ": " + why.substr(said.size()));
    throw std::runtime_error(why);
  }
}

/// Copies weights into the model by name (a .safetensors or .pt file, or a checkpoint: see
/// load_model_weights): every parameter must be there, in its shape; a tensor the model does not
/// have is refused.
inline void load_weights(Model& model, const std::filesystem::path& weights) {
  auto params = model.named_parameters();
  auto buffers = model.named_buffers();
  std::set<std::string> loaded;
  torch::NoGradGuard no_grad;
  for (const auto& [name, t] : load_model_weights(weights)) {
    at::Tensor* dst = params.find(name) ? params.find(name) : buffers.find(name);
    if (!dst) throw std::runtime_error(weights.string() + " holds '" + name + "', which the run's model does not have");
    if (dst->sizes() != t.sizes())
      throw std::runtime_error(weights.string() + ": '" + name + "' has shape " + c10::str(t.sizes()) +
                               ", the run's model's is " + c10::str(dst->sizes()));
    dst->copy_(t);
    loaded.insert(name);
  }
  for (const auto& p : params)
    if (!loaded.count(p.key()))
      throw std::runtime_error(weights.string() + " lacks parameter '" + p.key() + "' of the run's model");
}

}  // namespace tk
