// Errors for people (tk/error.h): a recipe position, an error's message without LibTorch's stack.
#include "tk/error.h"

#include <c10/util/Exception.h>

namespace tk {

std::string SourceLoc::str() const {
  std::string s = file.empty() ? "<unknown>" : file;
  if (line > 0) s += ":" + std::to_string(line);
  if (line > 0 && column > 0) s += ":" + std::to_string(column);
  return s;
}

RecipeError::RecipeError(const SourceLoc& where, const std::string& what)
    : Error(where.str() + ": " + what), where_(where) {}

std::string message_of(const std::exception& e) {
  const auto* torch_error = dynamic_cast<const c10::Error*>(&e);
  std::string text = torch_error ? torch_error->what_without_backtrace() : e.what();
  // The TorchScript interpreter prints the script's stack, then the error on its last line.
  if (text.find("Traceback of TorchScript") != std::string::npos) {
    while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
    const auto nl = text.rfind('\n');
    if (nl != std::string::npos) text.erase(0, nl + 1);
  }
  // LibTorch appends where it was raised and, in what(), the frames of its stack.
  for (const char* marker : {"Exception raised from ", "\nframe #"}) {
    const auto at = text.find(marker);
    if (at != std::string::npos) text.erase(at);
  }
  if (torch_error) {
    const auto nl = text.find('\n');
    if (nl != std::string::npos) text.erase(nl);
  }
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  return text;
}

std::string join(const std::string* begin, const std::string* end, const char* sep) {
  std::string out;
  for (auto it = begin; it != end; ++it) {
    if (it != begin) out += sep;
    out += *it;
  }
  return out;
}

}  // namespace tk
