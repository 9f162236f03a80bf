#pragma once
/// A micro-batch, and the named tensors plugins and components save.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>

// What this header declares is libtrainkit's interface: exported (the library hides the rest).
#pragma GCC visibility push(default)

namespace tk {

/// One micro-batch. `samples` is its number of examples; `tokens` its number of target items that
/// count toward the loss (non-ignored positions; equal to `samples` for per-example targets).
struct Batch {
  at::Tensor input;
  at::Tensor target;
  int64_t samples = 0;
  int64_t tokens = 0;
};

/// Named tensors: what plugins save and restore (scalars as 0-dim tensors).
using StateDict = std::map<std::string, at::Tensor>;

}  // namespace tk

#pragma GCC visibility pop
