#pragma once
/// Differences between LibTorch versions live here and only here.
#include <torch/version.h>

#define TK_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))
