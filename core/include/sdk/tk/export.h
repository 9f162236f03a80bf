#pragma once
/// Models that write their weights in other programs' formats, for tk-export.
#include <filesystem>
#include <string>
#include <vector>

#include "tk/model.h"

// What this header declares is libtrainkit's interface: exported (the library hides the rest).
#pragma GCC visibility push(default)

namespace tk {

/// A model that writes its weights in other programs' formats (tk-export): the built-in gpt writes
/// a Hugging Face folder ("huggingface") and llm.c's checkpoint ("llmc"). Implement it next to
/// tk::Model.
class ModelWithExport {
 public:
  /// The formats it can write.
  virtual std::vector<std::string> export_formats() const = 0;
  /// Writes its current weights in `format` to `where` (a folder, or a file for a one-file
  /// format), files of at most `max_file_bytes` where the format shards; throws tk::Error for a
  /// format, or a shape, the format cannot hold, saying why.
  virtual void export_weights(const std::string& format, const std::filesystem::path& where,
                              int64_t max_file_bytes) const = 0;

 protected:
  ModelWithExport() = default;
  ModelWithExport(const ModelWithExport&) = default;
  ModelWithExport& operator=(const ModelWithExport&) = default;
  virtual ~ModelWithExport();
};

/// `model` as a ModelWithExport, or null when it writes no other format.
const ModelWithExport* export_of(const Model& model);

}  // namespace tk

#pragma GCC visibility pop
