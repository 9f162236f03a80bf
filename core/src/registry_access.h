#pragma once
// What only the loader may do to a registry. Not installed.
#include <memory>
#include <string>

#include "tk/registry.h"

namespace tk::detail {

struct RegistryAccess {
  /// Sets the origin recorded for what is registered next (the loader calls it around a library's
  /// registration function); `keep` keeps that library loaded.
  static void set_origin(Registry& r, std::string file, std::shared_ptr<const void> keep);
};

}  // namespace tk::detail
