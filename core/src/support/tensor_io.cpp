#include "tk/tensor_io.h"

#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <nlohmann/json.hpp>

#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <set>

#include "tk/error.h"
#include "tk/output.h"
#include "support/support.h"

namespace tk {

std::string save_tensor_dict(const NamedTensors& tensors) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  for (const auto& [name, t] : tensors) dict.insert(name, t.detach().cpu().contiguous());

  std::vector<char> pickled;
  // The last argument turns off TorchScript's type tags (restore_type_tag), which a
  // weights_only torch.load refuses.
  torch::jit::Pickler pickler([&](const char* buf, size_t n) { pickled.insert(pickled.end(), buf, buf + n); },
                              nullptr, nullptr, nullptr, nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(c10::IValue(dict));
  pickler.stop();

  std::string out;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t n) -> size_t {
    out.append(static_cast<const char*>(data), n);
    return n;
  });
  torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(), pickler.tensorData(), writer);
  writer.writeEndOfFile();
  return out;
}

void save_tensor_dict(const std::filesystem::path& file, const NamedTensors& tensors) {
  write_atomic(file, save_tensor_dict(tensors));
}

namespace {

/// The whole of `file`, a regular file (never a FIFO or a device, which could wait for a writer or
/// never end), read as the size it had when opened.
std::vector<char> read_whole(const std::filesystem::path& file) {
  std::error_code ec;
  if (!std::filesystem::exists(file, ec)) throw Error("cannot read '" + file.string() + "': no such file");
  if (!std::filesystem::is_regular_file(file, ec))
    throw Error(file.string() + " is not a regular file (a device, a pipe or a folder): a tensor file has a known size");
  const auto size = std::filesystem::file_size(file, ec);
  std::ifstream in(file, std::ios::binary);
  if (ec || !in) throw Error("cannot read '" + file.string() + "'" + (ec ? ": " + ec.message() : ""));
  std::vector<char> bytes(static_cast<size_t>(size));
  in.read(bytes.data(), static_cast<std::streamsize>(size));
  if (static_cast<uintmax_t>(in.gcount()) != size) throw Error(file.string() + ": changed while it was read");
  return bytes;
}

}  // namespace

NamedTensors load_tensor_dict(const std::filesystem::path& file) {
  const std::vector<char> bytes = read_whole(file);  // what pickle_load takes, read once
  c10::IValue v;
  try {
    v = torch::jit::pickle_load(bytes);
  } catch (const std::exception& e) {
    // LibTorch's unpickler reports some foreign objects (an OrderedDict) as its own internal bug.
    const std::string why = message_of(e);
    std::string reason = ": " + why;
    if (why.find("INTERNAL ASSERT") != std::string::npos)
      reason = ": it holds Python objects other than dicts of tensors (model.state_dict() is an OrderedDict: save "
               "dict(model.state_dict()))";
    // Python pickles a dict of one entry with SETITEM, which LibTorch 1.13's unpickler lacks.
    if (why.find("Unknown opcode") != std::string::npos)
      reason = ": its pickle has an opcode LibTorch cannot read (" + why +
               "; Python writes a dict of one entry that way, be it one tensor or one dict under one key: save a flat "
               "dict of two or more tensors)";
    throw Error(file.string() + ": not a tensor file written by torch.save or trainkit (a plain dict of name -> tensor)" +
                reason);
  }
  if (!v.isGenericDict()) throw Error(file.string() + ": expected a dict of tensors, got " + v.tagKind());
  NamedTensors out;
  for (const auto& item : v.toGenericDict()) {
    if (item.key().isString() && item.value().isGenericDict())
      throw Error(file.string() + ": its entry '" + item.key().toStringRef() + "' is a dict, not a tensor: a "
                  "checkpoint that keeps the weights under a key (nanoGPT's ckpt.pt keeps them under 'model')? Save "
                  "that dict alone: torch.save(dict(ckpt['" + item.key().toStringRef() + "']), FILE)");
    if (!item.key().isString() || !item.value().isTensor())
      throw Error(file.string() + ": expected a dict of name -> tensor, found an entry of " + item.key().tagKind() +
                  " -> " + item.value().tagKind());
    out.emplace_back(item.key().toStringRef(), item.value().toTensor());
  }
  return out;
}

namespace {

/// safetensors' dtype names.
const std::map<at::ScalarType, std::string>& dtype_names() {
  static const std::map<at::ScalarType, std::string> m = {
      {at::kDouble, "F64"}, {at::kFloat, "F32"}, {at::kHalf, "F16"}, {at::kBFloat16, "BF16"},
      {at::kLong, "I64"},   {at::kInt, "I32"},   {at::kShort, "I16"}, {at::kChar, "I8"},
      {at::kByte, "U8"},    {at::kBool, "BOOL"}};
  return m;
}

bool little_endian() {
  const uint16_t one = 1;
  return *reinterpret_cast<const unsigned char*>(&one) == 1;
}

/// The header length a safetensors file of `file_size` bytes states in its first 8 (at `first`),
/// checked to fit the file.
uint64_t header_length(const char* first, uint64_t file_size, const std::string& where) {
  if (file_size < 8) throw Error(where + "not a safetensors file (shorter than its 8-byte header length)");
  uint64_t len = 0;
  std::memcpy(&len, first, 8);
  if (len > file_size - 8)
    throw Error(where + "not a safetensors file (its header would be " + std::to_string(len) + " bytes, the file has " +
                std::to_string(file_size) + ")");
  return len;
}

/// The `len` bytes at `json` as a safetensors header: a JSON object, in the file's order.
nlohmann::ordered_json parse_header(const char* json, uint64_t len, const std::string& where) {
  nlohmann::ordered_json header;
  try {
    header = nlohmann::ordered_json::parse(json, json + len);
  } catch (const nlohmann::json::exception& e) {
    throw Error(where + "not a safetensors file (its header is not JSON: " + e.what() + ")");
  }
  if (!header.is_object()) throw Error(where + "not a safetensors file (its header is not a JSON object)");
  return header;
}

}  // namespace

std::string save_safetensors(const NamedTensors& tensors, const Metadata& metadata) {
  if (!little_endian()) throw Error("safetensors are little-endian; this machine is not");
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  header["__metadata__"] = nlohmann::ordered_json::object();
  for (const auto& [k, v] : metadata) header["__metadata__"][k] = v;
  header["__metadata__"]["format"] = "pt";  // what safetensors' PyTorch loader expects, whatever `metadata` says
  std::vector<at::Tensor> data;
  int64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    const auto it = dtype_names().find(t.scalar_type());
    if (it == dtype_names().end())
      throw Error("safetensors: tensor '" + name + "' has dtype " + std::string(c10::toString(t.scalar_type())) +
                  ", which the format has no name for");
    at::Tensor c = t.detach().cpu().contiguous();
    const int64_t n = static_cast<int64_t>(c.numel()) * static_cast<int64_t>(c.element_size());
    header[name] = {{"dtype", it->second}, {"shape", c.sizes().vec()}, {"data_offsets", {offset, offset + n}}};
    offset += n;
    data.push_back(std::move(c));
  }
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t len = json.size();
  std::memcpy(out.data(), &len, 8);
  out += json;
  out.reserve(out.size() + static_cast<size_t>(offset));
  for (const auto& c : data)
    out.append(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.numel()) * c.element_size());
  return out;
}

void save_safetensors(const std::filesystem::path& file, const NamedTensors& tensors, const Metadata& metadata) {
  write_atomic(file, save_safetensors(tensors, metadata));
}

Metadata load_safetensors_metadata(const std::filesystem::path& file) {
  const std::string where = file.string() + ": ";
  std::error_code ec;
  if (!std::filesystem::is_regular_file(file, ec)) throw Error(where + "no such file, or not a regular file");
  const auto size = std::filesystem::file_size(file, ec);
  std::ifstream in(file, std::ios::binary);
  char first[8] = {};
  if (ec || !in || !in.read(first, size < 8 ? static_cast<std::streamsize>(size) : 8)) throw Error(where + "cannot read it");
  const uint64_t len = header_length(first, size, where);
  std::vector<char> json(static_cast<size_t>(len));
  if (!in.read(json.data(), static_cast<std::streamsize>(len))) throw Error(where + "cannot read its header");
  const auto header = parse_header(json.data(), len, where);
  Metadata out;
  if (header.contains("__metadata__") && header["__metadata__"].is_object())
    for (const auto& [k, v] : header["__metadata__"].items())
      if (v.is_string()) out[k] = v.get<std::string>();
  return out;
}

NamedTensors load_safetensors(const std::filesystem::path& file) {
  const std::string where = file.string() + ": ";
  const std::vector<char> bytes = read_whole(file);
  if (!little_endian()) throw Error(where + "safetensors are little-endian; this machine is not");
  const uint64_t len = header_length(bytes.data(), bytes.size(), where);
  const nlohmann::ordered_json header = parse_header(bytes.data() + 8, len, where);  // the file's order: the model's
  const size_t base = 8 + static_cast<size_t>(len);
  const size_t data_bytes = bytes.size() - base;
  NamedTensors out;
  std::map<uint64_t, std::pair<uint64_t, std::string>> spans;  // begin -> (end, tensor): no two may overlap
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    const std::string at_entry = where + "tensor '" + name + "': ";
    try {
      const std::string dtype = entry.at("dtype").get<std::string>();
      at::ScalarType type = at::kFloat;
      bool known = false;
      for (const auto& [t, n] : dtype_names())
        if (n == dtype) type = t, known = true;
      if (!known) throw Error(at_entry + "dtype " + dtype + " is not one trainkit reads");
      const auto shape = entry.at("shape").get<std::vector<int64_t>>();
      const auto offsets = entry.at("data_offsets").get<std::vector<uint64_t>>();
      // The bytes of its shape, whose product (zeros aside, as LibTorch counts it) must fit 64 bits.
      uint64_t need = static_cast<uint64_t>(c10::elementSize(type)), extent = need;
      bool overflow = false, empty = false;
      for (int64_t d : shape) {
        if (d < 0) throw Error(at_entry + "a negative dimension");
        empty = empty || d == 0;
        if (d > 0) overflow = __builtin_mul_overflow(extent, static_cast<uint64_t>(d), &extent) || overflow;
      }
      need = empty ? 0 : extent;
      if (overflow) {
        std::string dims;
        for (int64_t e : shape) dims += (dims.empty() ? "" : ", ") + std::to_string(e);
        throw Error(at_entry + "its shape [" + dims + "] holds more bytes than any file can");
      }
      if (offsets.size() != 2 || offsets[1] < offsets[0] || offsets[1] > data_bytes || offsets[1] - offsets[0] != need)
        throw Error(at_entry + "data_offsets do not hold its " + std::to_string(need) + " bytes within the file's " +
                    std::to_string(data_bytes) + " bytes of data");
      if (need > 0) {  // its bytes are no other tensor's
        const auto next = spans.lower_bound(offsets[0]);
        const auto overlaps = [&](const auto& it) { return it->first < offsets[1] && offsets[0] < it->second.first; };
        for (auto it : {next, next == spans.begin() ? spans.end() : std::prev(next)})
          if (it != spans.end() && overlaps(it))
            throw Error(at_entry + "its bytes [" + std::to_string(offsets[0]) + ", " + std::to_string(offsets[1]) +
                        ") overlap those of tensor '" + it->second.second + "' [" + std::to_string(it->first) + ", " +
                        std::to_string(it->second.first) + "): a damaged or hand-made file");
        spans[offsets[0]] = {offsets[1], name};
      }
      at::Tensor t = at::empty(shape, at::TensorOptions(type));
      std::memcpy(t.data_ptr(), bytes.data() + base + offsets[0], need);
      out.emplace_back(name, std::move(t));
    } catch (const nlohmann::ordered_json::exception& e) {
      throw Error(at_entry + "its entry is malformed (" + e.what() + ")");
    }
  }
  return out;
}

}  // namespace tk

namespace tk::detail {

std::string model_share_file(int64_t r) { return "model-share-" + std::to_string(r) + ".pt"; }

namespace {
constexpr const char* kRecordFile = "run.json";
}  // namespace

void write_checkpoint_record(const std::filesystem::path& dir, const CheckpointRecord& record) {
  nlohmann::ordered_json info;
  info["format"] = record.model_shares > 0 ? 2 : 1;  // 2: the parameters are in model-share-<rank>.pt too
  info["world_size"] = record.world_size;
  if (record.model_shares > 0) info["model_shares"] = record.model_shares;
  info["recipe"] = nlohmann::ordered_json::object();
  for (const auto& [k, v] : record.recipe) info["recipe"][k] = v;
  write_file_atomic(dir / kRecordFile, info.dump(1) + "\n");
}

std::optional<CheckpointRecord> read_checkpoint_record(const std::filesystem::path& dir) {
  const std::string file = (dir / kRecordFile).string();
  std::ifstream in(file);
  if (!in) return std::nullopt;
  try {
    const auto info = nlohmann::json::parse(in);
    if (const int64_t format = info.value("format", int64_t{1}); format > 2)
      throw RunRefused(file + ": a checkpoint of format " + std::to_string(format) +
                       ", written by a newer trainkit; this one reads formats 1 and 2");
    CheckpointRecord record;
    record.world_size = info.at("world_size").get<int64_t>();
    record.model_shares = info.value("model_shares", int64_t{0});
    for (const auto& [k, v] : info.at("recipe").items()) record.recipe.emplace_back(k, v.get<std::string>());
    return record;
  } catch (const nlohmann::json::exception& e) {
    throw RunRefused(file + ": damaged (" + e.what() + ")");  // read again, it is as damaged
  }
}

NamedTensors load_model_file(const std::filesystem::path& file, int64_t shares) {
  NamedTensors all = load_tensor_dict(file);
  std::set<std::string> names;
  for (const auto& [name, t] : all) names.insert(name);
  for (int64_t r = 0; r < shares; ++r) {
    const std::filesystem::path share = file.parent_path() / model_share_file(r);
    if (!std::filesystem::is_regular_file(share))
      throw RunRefused(share.string() + " is missing: " + (file.parent_path() / kRecordFile).string() + " says " +
                       std::to_string(shares) + " ranks wrote a share of the parameters beside " +
                       file.filename().string());
    for (auto& [name, t] : load_tensor_dict(share)) {
      if (!names.insert(name).second)
        throw RunRefused(share.string() + ": tensor '" + name + "' is also in " + file.filename().string() +
                         " or an earlier share");
      all.emplace_back(name, std::move(t));
    }
  }
  return all;
}

}  // namespace tk::detail

namespace tk {

int64_t nonfinite_count(const torch::Tensor& t) {
  if (!t.is_floating_point()) return 0;
  return t.isfinite().logical_not().sum().item<int64_t>();
}

}  // namespace tk
