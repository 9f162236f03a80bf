#pragma once
#include <string>

namespace tk {
/// Writes a plugin project called `name` into `dir` (which must not exist or be empty); returns
/// the exit code.
int scaffold(const std::string& name, const std::string& dir);
}  // namespace tk
