#pragma once
/// The interface of data sets, built-in or a user's, and the in-memory data set most of them use.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tk/batch.h"

// What this header declares is libtrainkit's interface: exported (the library hides the rest).
#pragma GCC visibility push(default)

namespace tk {

/// What a data set tells the model and loss it feeds.
struct DataInfo {
  int64_t input_dim = 0;   ///< features per example (or per position, for sequences)
  int64_t output_dim = 0;  ///< classes, or regression targets
  bool classification = true;
  std::optional<int64_t> ignore_index;  ///< target value of items that do not count, if any
  std::vector<int64_t> input_shape;     ///< shape of one example's input (images: {C, H, W}; text: {T})
  int64_t vocab = 0;        ///< > 0 when inputs are token ids in [0, vocab)
  bool next_token = false;  ///< targets are the inputs shifted by one (language modelling): perplexity applies
  std::string baseline_name;  ///< a reference the validation loss is shown against ("unigram"), if any
  double baseline_loss = 0.0; ///< that reference's validation loss
  std::string default_loss;   ///< the loss a recipe without a [loss] section gets ("" : it must name one)
  /// What the files behind the examples are, for the run's identity: "" for a data set its options
  /// say everything of (the synthetic ones); for one read from files, each split's
  /// files_fingerprint() ("train: 3 files, ..."). A resume on other files is refused, naming
  /// `data` (`--allow-change data` lets it through), and so are ranks that read other files.
  std::string fingerprint;

  /// "image [1, 28, 28]", "tokens [128] of 256", "features [32]": for error messages.
  std::string describe() const;
};

/// An in-memory data set indexed by example.
class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  /// The examples at `indices` (a 1-D int64 tensor) as one batch.
  virtual Batch get(const at::Tensor& indices) const = 0;
};
using DatasetPtr = std::shared_ptr<Dataset>;

/// A data set made of whole tensors: inputs [N, ...], targets [N, ...]; `ignore_index` marks
/// target items that do not count (for token targets).
class TensorDataset : public Dataset {
 public:
  TensorDataset(at::Tensor inputs, at::Tensor targets, int64_t ignore_index = -100);
  int64_t size() const override { return inputs_.size(0); }
  Batch get(const at::Tensor& indices) const override;
  const at::Tensor& inputs() const noexcept { return inputs_; }
  const at::Tensor& targets() const noexcept { return targets_; }

 private:
  at::Tensor inputs_, targets_;
  int64_t ignore_index_;
  bool every_item_counts_ = true;  // no target is ignore_index (or the targets are reals)
};

/// A data set's training split, its optional validation split, and what it tells model and loss.
struct DataSplits {
  DatasetPtr train;
  DatasetPtr validation;  ///< may be null
  DataInfo info;
};

/// "3 files, 3145728 bytes, digest 5f1e2d3c4b5a6978": the files' names (without their folders), their
/// sizes and 16 blocks of 4 KiB read evenly through each (all of a file up to 64 KiB), hashed. Other
/// files, other sizes or other contents give another text, but a change confined to the bytes
/// between the blocks does not: it tells data sets apart, it does not checksum them. Each file must
/// be a regular one (tk::Error naming it otherwise).
std::string files_fingerprint(const std::vector<std::string>& files);

/// One pattern of a data set's file option and the files it names.
struct FileMatches {
  std::string pattern;                          ///< as given (resolved: see files_matching)
  std::vector<std::filesystem::path> files;     ///< sorted; empty when it names none
};
/// The files `spec` names: a file, a glob, or a list of them separated by commas (empty entries
/// skipped), pattern by pattern. `resolve`, when given, makes each pattern a path first (against
/// a recipe's folder, say).
std::vector<FileMatches> files_matching(const std::string& spec,
                                        const std::function<std::string(const std::string&)>& resolve = {});

/// The order examples are visited in an epoch: a pure function of (seed, epoch).
at::Tensor epoch_order(int64_t n, uint64_t seed, int64_t epoch, bool shuffle);

}  // namespace tk

#pragma GCC visibility pop
