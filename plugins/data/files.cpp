// Data sets read from files: Fashion-MNIST (IDX, gzip-compressed or not) and byte- or
// character-level text for language modelling.
#include <zlib.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include "data_sets.h"

namespace fs = std::filesystem;

namespace tk::data {
namespace {

// ---------------------------------------------------------------- IDX files

struct IdxArray {
  std::vector<int64_t> dims;
  torch::Tensor data;  // uint8, shaped `dims`
};

/// Reads an IDX file of unsigned bytes; zlib reads gzip-compressed and plain files alike.
IdxArray read_idx(const fs::path& file) {
  std::unique_ptr<gzFile_s, int (*)(gzFile)> f(gzopen(file.c_str(), "rb"), gzclose);
  if (!f) throw Error(file.string() + ": cannot open");
  auto read = [&](void* into, size_t n) -> size_t {
    size_t got = 0;
    while (got < n) {
      const unsigned chunk = static_cast<unsigned>(std::min<size_t>(n - got, 1u << 30));
      const int r = gzread(f.get(), static_cast<char*>(into) + got, chunk);
      if (r < 0) {
        int code = 0;
        throw Error(file.string() + ": read error: " + gzerror(f.get(), &code));
      }
      if (r == 0) break;
      got += static_cast<size_t>(r);
    }
    return got;
  };
  unsigned char head[4];
  if (read(head, 4) != 4 || head[0] != 0 || head[1] != 0 || head[3] < 1 || head[3] > 4)
    throw Error(file.string() + ": not an IDX file (expected magic bytes 00 00 <type> <rank 1..4>)");
  if (head[2] != 0x08)
    throw Error(file.string() + ": IDX element type 0x" + c10::str(std::hex, int(head[2])) +
                " is not supported (expected 0x08, unsigned bytes)");
  IdxArray out;
  int64_t total = 1;
  for (int i = 0; i < head[3]; ++i) {
    unsigned char b[4];
    if (read(b, 4) != 4) throw Error(file.string() + ": truncated IDX header");
    out.dims.push_back((int64_t(b[0]) << 24) | (int64_t(b[1]) << 16) | (int64_t(b[2]) << 8) | int64_t(b[3]));
    total *= out.dims.back();
  }
  // What the header promises must be in the file (gzip packs at most ~1032 bytes into one) and
  // fit in memory; checked before allocating it.
  std::error_code ec;
  const double on_disk = static_cast<double>(fs::file_size(file, ec)), promised = static_cast<double>(total);
  const bool gz = gzdirect(f.get()) == 0;
  if (promised > (gz ? 1032.0 : 1.0) * on_disk)
    throw Error(file.string() + ": truncated or damaged: the header promises " + std::to_string(total) +
                " bytes of data (shape " + c10::str(out.dims) + "), more than the file's " +
                std::to_string(static_cast<int64_t>(on_disk)) + " bytes can hold");
  if (promised > machine_memory_bytes())
    throw Error(file.string() + ": the header promises " + format_bytes(promised) + " of data; this machine has " +
                format_bytes(machine_memory_bytes()));
  out.data = at::empty(out.dims, at::kByte);
  const size_t got = read(out.data.data_ptr<uint8_t>(), static_cast<size_t>(total));
  if (got != static_cast<size_t>(total))
    throw Error(file.string() + ": truncated: the header promises " + std::to_string(total) + " bytes of data, found " +
                std::to_string(got));
  return out;
}

/// `dir/name`, or `dir/name.gz`; a clear error naming both and the Debian package otherwise.
fs::path find_idx(const Options& o, const std::string& name) {
  const fs::path dir = o.get_path("dir");
  for (const fs::path& p : {dir / name, dir / (name + ".gz")})
    if (fs::is_regular_file(p)) return p;
  o.fail("dir", "no " + name + " or " + name + ".gz in " + dir.string() +
                    "; Debian's dataset-fashion-mnist package puts them in /usr/share/datasets/fashion-mnist "
                    "(apt-get install dataset-fashion-mnist, or bash tools/setup.sh)");
}

/// Images kept as bytes ([N, C, H, W] uint8) and scaled to floats a micro-batch at a time.
class ImageDataset : public Dataset {
 public:
  ImageDataset(torch::Tensor images, torch::Tensor labels, double mean, double stddev)
      : images_(std::move(images)), labels_(std::move(labels)), mean_(mean), std_(stddev) {}
  int64_t size() const override { return images_.size(0); }
  Batch get(const torch::Tensor& indices) const override {
    Batch b;
    b.input = images_.index_select(0, indices).to(at::kFloat).div_(255.0).sub_(mean_).div_(std_);
    b.target = labels_.index_select(0, indices);
    b.samples = b.tokens = indices.size(0);
    return b;
  }

 private:
  torch::Tensor images_, labels_;
  double mean_, std_;
};

/// One split's images and labels; their files are added to `files`.
std::pair<torch::Tensor, torch::Tensor> fashion_split(const Options& o, const std::string& prefix, int64_t limit,
                                                      std::vector<std::string>& files) {
  const fs::path images_file = find_idx(o, prefix + "-images-idx3-ubyte");
  const fs::path labels_file = find_idx(o, prefix + "-labels-idx1-ubyte");
  files.push_back(images_file.string());
  files.push_back(labels_file.string());
  IdxArray images = read_idx(images_file), labels = read_idx(labels_file);
  if (images.dims.size() != 3) throw Error(images_file.string() + ": expected images [N, H, W], got rank " +
                                           std::to_string(images.dims.size()));
  if (labels.dims.size() != 1 || labels.dims[0] != images.dims[0])
    throw Error(labels_file.string() + ": expected " + std::to_string(images.dims[0]) + " labels (one per image in " +
                images_file.filename().string() + "), got shape " + c10::str(labels.data.sizes()));
  const int64_t n = limit > 0 ? std::min(limit, images.dims[0]) : images.dims[0];
  auto y = labels.data.slice(0, 0, n).to(at::kLong);
  if (y.numel() && y.max().item<int64_t>() > 9)
    throw Error(labels_file.string() + ": labels must be 0..9, found " + std::to_string(y.max().item<int64_t>()));
  return {images.data.slice(0, 0, n).unsqueeze(1).contiguous(), y};
}

// ---------------------------------------------------------------- text

std::string read_text(const Options& o) {
  const std::string& path = o.get_path("path");
  if (path.empty()) o.fail("path", "needs a text file (e.g. /usr/share/games/fortunes/computers)");
  require_file(o, "path");
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  if (!in && !in.eof()) o.fail("path", "cannot read " + path);
  return s.str();
}

/// The text as code points; an error names the byte offset of invalid UTF-8.
std::vector<int64_t> utf8_code_points(const std::string& text, const std::string& path) {
  std::vector<int64_t> out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    int extra = c < 0x80 ? 0 : (c >> 5) == 0x6 ? 1 : (c >> 4) == 0xe ? 2 : (c >> 3) == 0x1e ? 3 : -1;
    if (extra < 0 || i + static_cast<size_t>(extra) >= text.size())
      throw Error(path + ": not valid UTF-8 at byte " + std::to_string(i) + " (use data.level = \"byte\")");
    int64_t cp = extra == 0 ? c : (c & (0x3f >> extra));
    for (int k = 1; k <= extra; ++k) {
      const auto d = static_cast<unsigned char>(text[i + static_cast<size_t>(k)]);
      if ((d >> 6) != 0x2) throw Error(path + ": not valid UTF-8 at byte " + std::to_string(i) + " (use data.level = \"byte\")");
      cp = (cp << 6) | (d & 0x3f);
    }
    out.push_back(cp);
    i += static_cast<size_t>(extra) + 1;
  }
  return out;
}

std::vector<std::string> split_documents(const std::string& text, const std::string& separator) {
  std::vector<std::string> docs;
  if (separator.empty()) return {text};
  size_t start = 0;
  for (size_t hit; (hit = text.find(separator, start)) != std::string::npos; start = hit + separator.size())
    docs.push_back(text.substr(start, hit - start));
  docs.push_back(text.substr(start));
  return docs;
}

/// Cuts token streams into examples of `t` positions: inputs x[i..i+t), targets x[i+1..i+t+1),
/// windows overlapping by one token; a stream's last, shorter example is padded (input 0, target
/// `ignore`). Streams of fewer than 2 tokens give nothing.
std::pair<torch::Tensor, torch::Tensor> sequences(const std::vector<std::vector<int64_t>>& streams, int64_t t,
                                                  int64_t ignore) {
  int64_t n = 0;
  for (const auto& s : streams)
    if (s.size() >= 2) n += (static_cast<int64_t>(s.size()) - 2) / t + 1;
  auto x = at::zeros({n, t}, at::kLong), y = at::full({n, t}, ignore, at::kLong);
  auto xa = x.accessor<int64_t, 2>(), ya = y.accessor<int64_t, 2>();
  int64_t row = 0;
  for (const auto& s : streams) {
    const auto len = static_cast<int64_t>(s.size());
    for (int64_t start = 0; start + 1 < len; start += t, ++row)
      for (int64_t j = 0; j < t && start + j + 1 < len; ++j) {
        xa[row][j] = s[static_cast<size_t>(start + j)];
        ya[row][j] = s[static_cast<size_t>(start + j + 1)];
      }
  }
  return {x, y};
}

/// Cross-entropy of the validation targets under the training targets' frequencies (add-one
/// smoothed): what a model that ignores the context can reach.
double unigram_loss(const torch::Tensor& train_y, const torch::Tensor& val_y, int64_t vocab, int64_t ignore) {
  auto counted = [&](const torch::Tensor& y) { return y.masked_select(y != ignore); };
  auto counts = at::bincount(counted(train_y), {}, vocab).to(at::kDouble) + 1.0;
  auto logp = (counts / counts.sum()).log();
  auto v = counted(val_y);
  return v.numel() ? -logp.index_select(0, v).mean().item<double>() : std::nan("");
}

}  // namespace

OptionSpecs fashion_mnist_specs() {
  return {opt_path("dir", "/usr/share/datasets/fashion-mnist",
                     "folder of the IDX files (train-/t10k-images-idx3-ubyte, -labels-idx1-ubyte; .gz or not)"),
          opt_int("train_samples", 0, "use the first N training images (0: all 60000)"),
          opt_int("validation_samples", -1, "validate on the first N test images (-1: all 10000; 0: none)"),
          opt_bool("normalize", true, "scale pixels to zero mean and unit variance (else to [0, 1])")};
}

DataSplits make_fashion_mnist(const Options& o, uint64_t) {
  if (o.get_int("train_samples") < 0) o.fail("train_samples", "must be >= 0");
  const bool norm = o.get_bool("normalize");
  // Mean and standard deviation of the 60000 training images' pixels, in [0, 1].
  const double mean = norm ? 0.2860 : 0.0, stddev = norm ? 0.3530 : 1.0;
  DataSplits d;
  std::vector<std::string> files;
  auto [x, y] = fashion_split(o, "train", o.get_int("train_samples"), files);
  d.train = std::make_shared<ImageDataset>(x, y, mean, stddev);
  const int64_t nv = o.get_int("validation_samples");
  if (nv != 0) {
    auto [vx, vy] = fashion_split(o, "t10k", nv, files);
    if (vx.sizes().slice(1) != x.sizes().slice(1))
      o.fail("dir", "the test images are " + c10::str(vx.sizes().slice(1)) + ", the training images " +
                        c10::str(x.sizes().slice(1)) + ": they must have one size");
    d.validation = std::make_shared<ImageDataset>(vx, vy, mean, stddev);
  }
  d.info.input_dim = x.size(2) * x.size(3);
  d.info.output_dim = 10;
  d.info.input_shape = {1, x.size(2), x.size(3)};
  d.info.fingerprint = "dir: " + files_fingerprint(files);
  return d;
}

OptionSpecs text_specs() {
  return {opt_path("path", "", "the text file"),
          opt_string("level", "byte", "tokens are bytes (vocabulary 256) or the file's UTF-8 characters",
                     {"byte", "char"}),
          opt_int("seq_len", 128, "positions per example"),
          opt_float("validation_fraction", 0.1, "fraction held out from the end (of the text, or of its documents)"),
          opt_string("document_separator", "",
                     "split the text into documents at this string (e.g. \"\\n%\\n\"); each document starts its own "
                     "examples and its last one is padded. \"\": one continuous text"),
          opt_int("ignore_index", -100, "target value of padded positions")};
}

DataSplits make_text(const Options& o, uint64_t) {
  const int64_t t = o.get_int("seq_len");
  if (t < 1) o.fail("seq_len", "must be >= 1, got " + std::to_string(t));
  const double frac = o.get_float("validation_fraction");
  if (frac < 0.0 || frac >= 1.0) o.fail("validation_fraction", "must be in [0, 1)");
  const int64_t ignore = o.get_int("ignore_index");
  if (ignore >= 0) o.fail("ignore_index", "must be negative (not a token id), got " + std::to_string(ignore));
  const std::string text = read_text(o);
  const bool chars = o.get_string("level") == "char";
  const std::string& path = o.get_path("path");

  // Tokenize each document; characters are numbered in code-point order over the whole file.
  std::vector<std::vector<int64_t>> docs;
  for (const auto& doc : split_documents(text, o.get_string("document_separator"))) {
    if (chars) {
      docs.push_back(utf8_code_points(doc, path));
    } else {
      docs.emplace_back();
      for (unsigned char c : doc) docs.back().push_back(c);
    }
  }
  int64_t vocab = 256;
  if (chars) {
    std::map<int64_t, int64_t> ids;
    for (const auto& d : docs)
      for (int64_t cp : d) ids.emplace(cp, 0);
    vocab = 0;
    for (auto& kv : ids) kv.second = vocab++;
    for (auto& d : docs)
      for (auto& cp : d) cp = ids[cp];
  }

  // Examples far longer than every document would be mostly padding (and a model of that context).
  size_t total = 0, longest = 0;
  for (const auto& d : docs) {
    total += d.size();
    longest = std::max(longest, d.size());
  }
  if (longest < 2)
    o.fail("path", path + " gives no training sequence: its longest document has " + std::to_string(longest) +
                       " tokens, and a sequence needs at least 2 (an input and the next one)");
  if (static_cast<double>(t) > 2.0 * static_cast<double>(longest) + 16.0)
    o.fail("seq_len", "is " + std::to_string(t) + ", more than twice the longest document of " + path + " (" +
                          std::to_string(longest) + " tokens): every example would be mostly padding");
  require_memory(o, "seq_len", 4.0 * 8.0 * static_cast<double>(docs.size() + total / static_cast<size_t>(t) + 1) * static_cast<double>(t + 1),
                 "sequences of " + std::to_string(t) + " tokens");

  // Hold out the end: of the text when it is one document, else whole documents.
  std::vector<std::vector<int64_t>> train, val;
  if (docs.size() == 1) {
    const auto& all = docs.front();
    const auto cut = static_cast<size_t>(std::floor((1.0 - frac) * static_cast<double>(all.size())));
    train.emplace_back(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(cut));
    val.emplace_back(all.begin() + static_cast<std::ptrdiff_t>(cut), all.end());
  } else {
    const auto cut = static_cast<size_t>(std::floor((1.0 - frac) * static_cast<double>(docs.size())));
    train.assign(docs.begin(), docs.begin() + static_cast<std::ptrdiff_t>(cut));
    val.assign(docs.begin() + static_cast<std::ptrdiff_t>(cut), docs.end());
  }
  auto [x, y] = sequences(train, t, ignore);
  if (x.size(0) == 0) o.fail("path", path + " gives no training sequence (needs at least 2 tokens)");
  DataSplits d;
  d.train = std::make_shared<TensorDataset>(x, y, ignore);
  auto [vx, vy] = sequences(val, t, ignore);
  if (frac > 0.0 && vx.size(0) == 0)
    o.fail("validation_fraction", "holds out no sequence of " + path + " (too little text or too few documents)");
  if (vx.size(0) > 0) d.validation = std::make_shared<TensorDataset>(vx, vy, ignore);
  d.info.input_dim = vocab;
  d.info.output_dim = vocab;
  d.info.vocab = vocab;
  d.info.input_shape = {t};
  d.info.ignore_index = ignore;
  d.info.next_token = true;
  d.info.fingerprint = "path: " + files_fingerprint({path});
  if (d.validation) {
    d.info.baseline_name = "unigram";
    d.info.baseline_loss = unigram_loss(y, vy, vocab, ignore);
  }
  return d;
}

}  // namespace tk::data
