#include "tk/tensor_io.h"

#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <cstring>
#include <fstream>
#include <iterator>

#include "tk/error.h"
#include "tk/output.h"

namespace tk {

std::string save_tensor_dict(const NamedTensors& tensors) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  for (const auto& [name, t] : tensors) dict.insert(name, t.detach().cpu().contiguous());

  std::vector<char> pickled;
  // The last argument turns off TorchScript's type tags (restore_type_tag), which a
  // weights_only torch.load refuses.
  torch::jit::Pickler pickler([&](const char* buf, size_t n) { pickled.insert(pickled.end(), buf, buf + n); },
                              nullptr, nullptr, nullptr, nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(c10::IValue(dict));
  pickler.stop();

  std::string out;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t n) -> size_t {
    out.append(static_cast<const char*>(data), n);
    return n;
  });
  torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(), pickler.tensorData(), writer);
  writer.writeEndOfFile();
  return out;
}

void save_tensor_dict(const std::filesystem::path& file, const NamedTensors& tensors) {
  write_atomic(file, save_tensor_dict(tensors));
}

NamedTensors load_tensor_dict(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw Error("cannot read '" + file.string() + "'");
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  c10::IValue v;
  try {
    v = torch::jit::pickle_load(bytes);
  } catch (const std::exception& e) {
    // LibTorch's unpickler reports some foreign objects (an OrderedDict) as its own internal bug.
    const std::string why = message_of(e);
    std::string reason = ": " + why;
    if (why.find("INTERNAL ASSERT") != std::string::npos) reason = ": it holds objects other than a dict of tensors";
    // Python pickles a dict of one entry with SETITEM, which LibTorch's unpickler lacks.
    if (why.find("Unknown opcode") != std::string::npos)
      reason = ": its pickle has an opcode LibTorch cannot read (" + why +
               "; Python writes a dict of a single tensor that way: save two or more)";
    throw Error(file.string() + ": not a tensor file written by torch.save or trainkit (a plain dict of name -> tensor)" +
                reason);
  }
  if (!v.isGenericDict()) throw Error(file.string() + ": expected a dict of tensors, got " + v.tagKind());
  NamedTensors out;
  for (const auto& item : v.toGenericDict()) {
    if (!item.key().isString() || !item.value().isTensor())
      throw Error(file.string() + ": expected a dict of name -> tensor, found an entry of " + item.key().tagKind() +
                  " -> " + item.value().tagKind());
    out.emplace_back(item.key().toStringRef(), item.value().toTensor());
  }
  return out;
}

}  // namespace tk
