#pragma once
/// Tensor files that Python reads with a plain `torch.load` (weights_only included).
#include <torch/types.h>

#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

// What this header declares is libtrainkit's interface: exported (the library hides the rest).
#pragma GCC visibility push(default)

namespace tk {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

/// Bytes of a name -> tensor dict in torch.save's zip format, without TorchScript type tags, so
/// that `torch.load(f)` reads it as a plain dict, also under `weights_only=True`.
std::string save_tensor_dict(const NamedTensors& tensors);
/// Writes save_tensor_dict() to `file` atomically.
void save_tensor_dict(const std::filesystem::path& file, const NamedTensors& tensors);
/// Reads a file written by save_tensor_dict() or by Python's torch.save of a dict of tensors.
NamedTensors load_tensor_dict(const std::filesystem::path& file);

/// The text entries of a safetensors file's "__metadata__".
using Metadata = std::map<std::string, std::string>;

/// Bytes of `tensors` in the safetensors format of the Hugging Face ecosystem: an 8-byte
/// little-endian header length, a JSON header (each name's dtype, shape and data_offsets, and
/// "__metadata__": "format": "pt" and `metadata`), padded with spaces to 8 bytes, then each
/// tensor's raw little-endian data.
std::string save_safetensors(const NamedTensors& tensors, const Metadata& metadata = {});
/// Writes save_safetensors() to `file` atomically.
void save_safetensors(const std::filesystem::path& file, const NamedTensors& tensors, const Metadata& metadata = {});
/// The "__metadata__" of a safetensors file, read from its header alone (empty when it has none);
/// a file that is not one is refused, naming it.
Metadata load_safetensors_metadata(const std::filesystem::path& file);
/// Reads a safetensors file, refusing (naming the file and the entry) a header that is not JSON,
/// an unknown dtype, and data offsets that do not match the shape or lie outside the file.
NamedTensors load_safetensors(const std::filesystem::path& file);

/// A model's weights by name, as `[model] init` reads them, from `path`: a .safetensors file; a
/// tensor dict (weights.pt); a checkpoint's model.pt, its folder, or a checkpoints folder (its
/// latest complete checkpoint, as --resume takes it), with the shares of the parameters that the
/// ranks of a sharded run wrote beside model.pt (its run.json's `model_shares`): the whole model,
/// read without a world. Refuses (RunRefused) a share missing, a name two files hold, a folder
/// with no complete checkpoint and a checkpoint never completed.
NamedTensors load_model_weights(const std::filesystem::path& path);

/// How many of `t`'s values are NaN or infinite (0 for a tensor that is not floating point): what
/// refuses weights that would surface as a non-finite loss, blamed on the learning rate.
int64_t nonfinite_count(const torch::Tensor& t);

}  // namespace tk

#pragma GCC visibility pop
