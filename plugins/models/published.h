#pragma once
// The GPT's shape, and the checkpoints other people publish for it: a Hugging Face GPT-2 or Llama
// folder, and llm.c's GPT-2 .bin. Each is read into trainkit's parameter names and layout (GPT-2's
// Conv1D weights transposed, Llama's q/k/v and gate/up projections joined), with the shape its
// configuration states.
#include <torch/types.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <tk/tensor_io.h>

namespace tk::models {

/// What the built-in GPT is built from.
struct GptShape {
  int64_t vocab = 0;  // tokens it predicts: the data's vocabulary
  int64_t rows = 0;   // rows of the token table and head: vocab, or more when the table is padded
  int64_t context = 0, width = 0, heads = 0, layers = 0;
  int64_t kv_heads = 0;   // key and value heads: heads, or fewer (grouped-query attention)
  int64_t mlp_width = 0;  // the MLP's hidden width
  double dropout = 0.0;
  std::string mlp = "gelu";  // "gelu", "gelu_tanh" (GPT-2's tanh approximation) or "swiglu"
  bool bias = true;          // biases in the linear layers and LayerNorms
  bool rotary = false;       // rotary position embedding on queries and keys instead of learned positions
  double rotary_base = 10000.0;
  bool rms_norm = false;  // RMSNorm (a scale, no bias, no centering) instead of LayerNorm
  double norm_eps = 1e-5;
  bool tied = true;  // the head is the token table

  int64_t head_dim() const { return width / heads; }
  /// The parameters a model of this shape holds.
  double parameters() const;
  /// Forward FLOPs per token at sequences of t positions (a multiply-add is 2).
  double forward_flops(double t) const;
};

/// A published checkpoint, read.
struct Published {
  std::string format;  // "Hugging Face GPT-2", "Hugging Face Llama", "nanoGPT", "llm.c GPT-2"
  std::string source;  // the folder or file it was read from
  GptShape shape;      // vocab and rows as the checkpoint holds them; dropout 0
  NamedTensors tensors;  // by trainkit's names, in the checkpoint's dtypes
  std::map<std::string, std::string> origin;  // trainkit's name -> the file and tensor(s) it came from
  NamedTensors raw;  // by the checkpoint's names, where reading the shape read them too (nanoGPT's pickle)
};

/// What is wrong with a shape (a width the heads do not divide, ...): "" when nothing.
std::string shape_problem(const GptShape& s);

/// The shape of the checkpoint at `where`, from its configuration alone: a Hugging Face folder
/// (config.json, with model.safetensors or the shards model.safetensors.index.json names) of
/// model_type gpt2 or llama, nanoGPT's ckpt.pt (its model_args), or llm.c's .bin (its header, and
/// its size checked). Configuration
/// fields trainkit cannot honour are refused in one Error, a line each, naming the file and field.
Published read_published_shape(const std::filesystem::path& where);

/// Reads the tensors of a checkpoint whose shape read_published_shape read, into trainkit's names;
/// tensors it has no place for, pieces that do not stack, and a tied head that is not the table
/// are refused in one Error, a line each, naming the file and the tensor.
void read_published_tensors(Published& p);

/// Fills `params` (trainkit's names) from `from`, checking every tensor: one line each for a
/// parameter the checkpoint lacks, a tensor of another shape, and a tensor that is not floating
/// point; throws them together. Values are converted to the parameters' dtype.
void load_published(const Published& from, const std::vector<std::pair<std::string, at::Tensor>>& params);

/// The formats write_published writes.
std::vector<std::string> published_formats();

/// Writes a GPT of shape `s` whose parameters are `params` (trainkit's names) as `format`:
/// "huggingface", a folder (config.json, model.safetensors or, past `max_file_bytes`, shards and
/// model.safetensors.index.json) of model_type gpt2 or llama, whichever the shape is; "llmc",
/// llm.c's GPT-2 .bin (version 3, float32; a table not padded yet is padded to a multiple of 128
/// rows, as llm.c pads it). A shape
/// the format cannot hold is refused, naming what differs.
void write_published(const GptShape& s, const NamedTensors& params, const std::string& format,
                     const std::filesystem::path& where, int64_t max_file_bytes);

}  // namespace tk::models
