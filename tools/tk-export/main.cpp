// tk-export: a model's weights in other programs' formats. Rebuilds a run's model from the
// recipe.toml its output folder holds and loads its weights.safetensors (or builds a recipe's model
// with the weights it starts from), then writes them as the model's export says: for the built-in
// GPT, a Hugging Face folder (GPT-2 or Llama, by its shape; with the run's tokenizer files) or
// llm.c's GPT-2 .bin.
#include <spdlog/spdlog.h>
#include <tk/export.h>

#include <cstdio>
#include <string>

#include "../cli_parse.h"
#include "../model_of.h"

namespace {

struct Options {
  std::string run, format, out, weights;
  int64_t max_shard_bytes = int64_t{5} << 30;
};

int export_model(const Options& o) {
  const tk::RunOrRecipe given(o.run, o.weights);
  std::fputs(given.untrained_note("tk-export").c_str(), stderr);
  spdlog::set_level(spdlog::level::warn);
  auto trainer = tk::build_model(given.recipe, "cpu");
  tk::Model& model = trainer->model();
  if (!given.weights.empty()) tk::load_weights(model, given.weights);
  const tk::ModelWithExport* exporter = tk::export_of(model);
  if (!exporter)
    throw std::runtime_error("the model of " + o.run + " writes no other format (the built-in gpt does)");
  std::string formats;
  bool known = false;
  for (const auto& f : exporter->export_formats()) {
    formats += (formats.empty() ? "" : ", ") + f;
    known = known || f == o.format;
  }
  if (!known) throw std::runtime_error("--format " + o.format + ": the model writes " + formats);
  try {
    exporter->export_weights(o.format, o.out, o.max_shard_bytes);
  } catch (const std::exception& e) {
    // Said again here: the exception's type lives in the plugin library, unloaded with the model.
    throw std::runtime_error(tk::message_of(e));
  }
  std::string with;
  if (o.format == "huggingface")  // the run's tokenizer beside the weights
    for (const auto& file : tk::tokenizer_files(given.recipe)) {
      std::error_code ec;
      std::filesystem::copy_file(file, std::filesystem::path(o.out) / file.filename(), ec);
      if (ec)
        throw std::runtime_error("the weights are in " + o.out + ", but the tokenizer's " + file.string() +
                                 " could not be copied beside them: " + ec.message());
      with += (with.empty() ? " with its tokenizer: " : ", ") + file.filename().string();
    }
  std::printf("tk-export: %s -> %s (%s)%s\n", (given.weights.empty() ? given.recipe.source() : given.weights.string()).c_str(),
              o.out.c_str(), o.format.c_str(), with.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tk-export: a model's weights in other programs' formats (a Hugging Face folder, llm.c's .bin)"};
  Options o;
  app.add_option("run", o.run, "the run's output folder (recipe.toml, weights.safetensors), or a recipe: its model "
                               "with the weights it starts from")->required()->check(CLI::ExistingPath);
  app.add_option("-f,--format", o.format, "huggingface: a folder of config.json and safetensors (GPT-2 or Llama, by "
                                          "the model's shape), with the run's tokenizer files; llmc: llm.c's GPT-2 "
                                          ".bin")->required();
  app.add_option("-o,--out", o.out, "the folder (huggingface) or file (llmc) to write")->required();
  app.add_option("--weights", o.weights,
                 "weights to load: a .safetensors or .pt file, or a checkpoint (its folder or model.pt; a sharded "
                 "run's shares merged) (default: RUN/weights.safetensors)");
  app.add_option("--max-shard-size", o.max_shard_bytes,
                 "largest safetensors file (\"5GB\", \"200MB\", bytes); a larger model is sharded, with an index")
      ->transform(CLI::AsSizeValue(false))
      ->check(CLI::PositiveNumber)
      ->default_str("5GB");
  if (auto rc = tk::parse_command_line(app, argc, argv, "tk-export")) return *rc;
  try {
    return export_model(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tk-export: %s\n", tk::message_of(e).c_str());
    return 1;
  }
}
