#pragma once
#include <string>

namespace tk {
/// Writes a plugin project called `name` into `dir` (which must not exist or be empty); returns
/// the exit code.
int scaffold(const std::string& name, const std::string& dir);
/// Where the plugin guide of this trainkit is: the installed plugins.md beside this tk-plugin
/// (<prefix>/share/doc/trainkit/plugins.md), or a pointer to docs/plugins.md of trainkit's source
/// when tk-plugin runs from a build tree.
std::string plugin_guide();
}  // namespace tk
