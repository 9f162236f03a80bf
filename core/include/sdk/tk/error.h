#pragma once
/// Errors trainkit reports to its users: each says what is wrong and where.
#include <stdexcept>
#include <string>

// What this header declares is libtrainkit's interface: exported (the library hides the rest).
#pragma GCC visibility push(default)

namespace tk {

/// A place in a recipe (or a `--set` override): file, line and column, 1-based; 0 when unknown.
struct SourceLoc {
  std::string file;
  int line = 0;
  int column = 0;

  /// "file:line:col", "file:line", or "file", whatever is known.
  std::string str() const;
};

/// Base of every error trainkit throws on purpose.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A recipe (or override) is wrong; the message starts with its file:line:column.
class RecipeError : public Error {
 public:
  RecipeError(const SourceLoc& where, const std::string& what);
  const SourceLoc& where() const noexcept { return where_; }

 private:
  SourceLoc where_;
};

/// A run was refused before it trained anything, and nothing it would have touched was changed:
/// its output folder is in use or holds another run, or the checkpoint it was to resume from is
/// missing or of a different run.
class RunRefused : public Error {
 public:
  using Error::Error;
};

/// A plugin could not be found, loaded or validated; the message names the file.
class PluginLoadError : public Error {
 public:
  using Error::Error;
};

/// A plugin failed while handling an event; the message names the plugin, the event and the step.
class PluginRuntimeError : public Error {
 public:
  using Error::Error;
};

/// The message of `e` for people: a LibTorch error (c10::Error, or an error whose text carries
/// one) as its first line, without the C++ stack trace; any other error as it is.
std::string message_of(const std::exception& e);

/// Joins names for messages: "a, b, c".
std::string join(const std::string* begin, const std::string* end, const char* sep = ", ");

}  // namespace tk

#pragma GCC visibility pop
