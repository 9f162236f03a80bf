#pragma once
// What the tools that use a trained model share (tk-sample, tk-export): a run's output folder or a
// recipe, its model built as it was trained, and its weights loaded by name.
#include <torch/torch.h>
#include <tk/recipe.h>
#include <tk/tensor_io.h>
#include <tk/trainer.h>

#include <filesystem>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>

namespace tk {

/// A run's output folder (its recipe.toml and weights.safetensors), or a recipe file, whose model
/// starts from the weights the recipe names ([model] pretrained or init): no file to load.
struct RunOrRecipe {
  /// `path` as given on the command line; `weights`: the file to load instead ("": the run's).
  RunOrRecipe(const std::filesystem::path& path, const std::string& weights_given)
      : from_recipe(std::filesystem::is_regular_file(path)),
        dir(from_recipe ? path.parent_path() : path),
        recipe(Recipe::from_file(from_recipe ? path : dir / "recipe.toml")),
        weights(!weights_given.empty() ? std::filesystem::path(weights_given)
                : from_recipe          ? std::filesystem::path()
                                       : dir / "weights.safetensors") {}
  bool from_recipe;
  std::filesystem::path dir;
  Recipe recipe;
  std::filesystem::path weights;  // "" for a recipe given without --weights
};

/// A run's model built from its recipe (and run.device = `device`), planned as it was trained.
inline std::unique_ptr<Trainer> build_model(Recipe recipe, const std::string& device) {
  const std::string device_set = "run.device=\"" + device + "\"";
  recipe.apply_override(device_set);
  TrainerOptions topts;
  topts.write_outputs = false;
  topts.progress = ProgressMode::None;
  try {
    auto trainer = std::make_unique<Trainer>(recipe, topts);
    trainer->describe();  // builds and plans the run: the model as trained, after every plugin's setup
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
