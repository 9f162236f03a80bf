#pragma once
// Files written by Python's torch.save (the zip format of PyTorch 1.6 and later), read without
// Python: the pickle's dicts (OrderedDict included, which LibTorch's own unpickler cannot build),
// lists, tuples, numbers, strings and tensors. Other Python objects are kept as opaque values
// naming their class, so that a checkpoint holding them (an optimizer's state, a config object)
// still gives up the tensors it holds.
#include <torch/types.h>

#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace tk::models {

/// A value of the pickle.
struct PyValue {
  enum class Kind { None, Bool, Int, Float, String, Tuple, List, Dict, Tensor, Object };
  Kind kind = Kind::None;
  bool b = false;
  int64_t i = 0;
  double f = 0.0;
  std::string s;  // a String's text; an Object's class ("module.name")
  std::shared_ptr<std::vector<PyValue>> items;                         // Tuple, List
  std::shared_ptr<std::vector<std::pair<PyValue, PyValue>>> entries;  // Dict, in order
  at::Tensor tensor;

  /// The Dict entry under the string `key`, or null.
  const PyValue* get(const std::string& key) const;
  /// "dict", "tensor", "int", ...: for messages.
  std::string type_name() const;
};

/// The object torch.save wrote to `file`. Refuses, naming the file, what is not such a file and a
/// pickle this reader cannot follow.
PyValue read_torch_save(const std::filesystem::path& file);

}  // namespace tk::models
