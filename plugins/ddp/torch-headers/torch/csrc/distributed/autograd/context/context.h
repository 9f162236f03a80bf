// Used only where LibTorch's headers lack this file: Debian's libtorch-dev 1.13 installs c10d's
// reducer.hpp but not the distributed-autograd headers it includes. reducer.hpp names two types
// from here, both in members the ddp plugin never calls; they are declared as LibTorch declares
// them, so that the Reducer's layout and the symbols the plugin links against are LibTorch's own.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>

namespace torch::distributed::autograd {

class DistAutogradContext {
 public:
  using GradCallback = std::function<bool(at::Tensor&)>;
};

using ContextPtr = std::shared_ptr<DistAutogradContext>;

}  // namespace torch::distributed::autograd
