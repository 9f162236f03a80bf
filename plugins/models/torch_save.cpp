// A reader of torch.save's zip files: the pickle of data.pkl run on a small stack machine (the
// opcodes Python's pickle writes at protocols 2 to 4), tensors rebuilt from the archive's storages.
#include "torch_save.h"

#include <caffe2/serialize/inline_container.h>

#include <cstring>
#include <map>
#include <stdexcept>

#include <tk/error.h>

namespace tk::models {

const PyValue* PyValue::get(const std::string& key) const {
  if (kind != Kind::Dict) return nullptr;
  for (const auto& [k, v] : *entries)
    if (k.kind == Kind::String && k.s == key) return &v;
  return nullptr;
}

std::string PyValue::type_name() const {
  switch (kind) {
    case Kind::None: return "None";
    case Kind::Bool: return "bool";
    case Kind::Int: return "int";
    case Kind::Float: return "float";
    case Kind::String: return "str";
    case Kind::Tuple: return "tuple";
    case Kind::List: return "list";
    case Kind::Dict: return "dict";
    case Kind::Tensor: return "tensor";
    case Kind::Object: return s;
  }
  return "?";
}

namespace {

PyValue make(PyValue::Kind kind) {
  PyValue v;
  v.kind = kind;
  if (kind == PyValue::Kind::Tuple || kind == PyValue::Kind::List) v.items = std::make_shared<std::vector<PyValue>>();
  if (kind == PyValue::Kind::Dict) v.entries = std::make_shared<std::vector<std::pair<PyValue, PyValue>>>();
  return v;
}

PyValue object(const std::string& name) {
  PyValue v;
  v.kind = PyValue::Kind::Object;
  v.s = name;
  return v;
}

at::ScalarType storage_dtype(const std::string& type) {
  static const std::map<std::string, at::ScalarType> types = {
      {"torch.FloatStorage", at::kFloat}, {"torch.DoubleStorage", at::kDouble}, {"torch.HalfStorage", at::kHalf},
      {"torch.BFloat16Storage", at::kBFloat16}, {"torch.LongStorage", at::kLong}, {"torch.IntStorage", at::kInt},
      {"torch.ShortStorage", at::kShort}, {"torch.CharStorage", at::kChar}, {"torch.ByteStorage", at::kByte},
      {"torch.BoolStorage", at::kBool}};
  auto it = types.find(type);
  if (it == types.end()) throw std::runtime_error("a storage of type " + type + ", which trainkit does not read");
  return it->second;
}

/// The stack machine. Opcodes are Python's pickle module's (Lib/pickle.py names them).
class Unpickler {
 public:
  Unpickler(const std::string& bytes, caffe2::serialize::PyTorchStreamReader& archive)
      : p_(reinterpret_cast<const uint8_t*>(bytes.data())), begin_(p_), end_(p_ + bytes.size()), archive_(archive) {}

  PyValue run() {
    for (;;) {
      const uint8_t op = byte();
      if (op == '.') {  // STOP
        if (stack_.size() != 1) fail("the pickle ends with " + std::to_string(stack_.size()) + " values on its stack");
        return stack_.back();
      }
      step(op);
    }
  }

 private:
  void step(uint8_t op) {
    using K = PyValue::Kind;
    switch (op) {
      case 0x80: byte(); return;                                  // PROTO
      case 0x95: take(8); return;                                 // FRAME
      case '(': marks_.push_back(stack_.size()); return;          // MARK
      case 'N': stack_.push_back(PyValue()); return;              // NONE
      case 0x88: case 0x89: {                                     // NEWTRUE, NEWFALSE
        PyValue v = make(K::Bool);
        v.b = op == 0x88;
        return stack_.push_back(v);
      }
      case 'J': return push_int(static_cast<int32_t>(le(4)));    // BININT
      case 'K': return push_int(static_cast<int64_t>(le(1)));    // BININT1
      case 'M': return push_int(static_cast<int64_t>(le(2)));    // BININT2
      case 0x8a: return long1();                                  // LONG1
      case 'G': return binfloat();                                // BINFLOAT
      case 'X': return push_string(le(4));                        // BINUNICODE
      case 0x8c: return push_string(le(1));                       // SHORT_BINUNICODE
      case 0x8d: return push_string(le(8));                       // BINUNICODE8
      case 'T': case 'B': return push_string(le(4));              // BINSTRING, BINBYTES
      case 'U': case 'C': return push_string(le(1));              // SHORT_BINSTRING, SHORT_BINBYTES
      case '}': return stack_.push_back(make(K::Dict));           // EMPTY_DICT
      case ']': return stack_.push_back(make(K::List));           // EMPTY_LIST
      case ')': return stack_.push_back(make(K::Tuple));          // EMPTY_TUPLE
      case 0x8f: return stack_.push_back(make(K::List));          // EMPTY_SET, kept as a list
      case 0x85: case 0x86: case 0x87: return tuple(op - 0x84);   // TUPLE1, TUPLE2, TUPLE3
      case 't': return from_mark(K::Tuple);                       // TUPLE
      case 'l': return from_mark(K::List);                        // LIST
      case 0x91: return from_mark(K::List);                       // FROZENSET
      case 'd': return dict_from_mark();                          // DICT
      case 'a': return append(1);                                 // APPEND
      case 'e': case 0x90: return append(0);                      // APPENDS, ADDITEMS
      case 's': return setitems(false);                           // SETITEM
      case 'u': return setitems(true);                            // SETITEMS
      case 'q': return memo_put(le(1));                           // BINPUT
      case 'r': return memo_put(le(4));                           // LONG_BINPUT
      case 0x94: return memo_put(memo_.size());                   // MEMOIZE
      case 'h': return memo_get(le(1));                           // BINGET
      case 'j': return memo_get(le(4));                           // LONG_BINGET
      case 'c': return global();                                  // GLOBAL
      case 0x93: return stack_global();                           // STACK_GLOBAL
      case 'R': return reduce();                                  // REDUCE
      case 0x81: return newobj();                                 // NEWOBJ
      case 'b': pop(); return;                                    // BUILD: an object's state, not needed
      case 'Q': return persistent();                              // BINPERSID
      case '0': pop(); return;                                    // POP
      case '1': stack_.resize(mark()); return;                    // POP_MARK
      case '2': return stack_.push_back(top());                   // DUP
      default: {
        char hex[8];
        std::snprintf(hex, sizeof hex, "0x%02x", op);
        fail(std::string("opcode ") + hex + ", which trainkit's reader does not follow");
      }
    }
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error("data.pkl, byte " + std::to_string(p_ - begin_) + ": " + what);
  }
  uint8_t byte() {
    if (p_ >= end_) fail("the pickle ends before its STOP");
    return *p_++;
  }
  const uint8_t* take(uint64_t n) {
    if (n > static_cast<uint64_t>(end_ - p_)) fail("the pickle ends inside a value");
    const uint8_t* at = p_;
    p_ += n;
    return at;
  }
  uint64_t le(int n) {
    const uint8_t* b = take(static_cast<uint64_t>(n));
    uint64_t v = 0;
    for (int k = n - 1; k >= 0; --k) v = (v << 8) | b[k];
    return v;
  }
  PyValue pop() {
    if (stack_.empty() || (!marks_.empty() && stack_.size() <= marks_.back())) fail("a value taken from an empty stack");
    PyValue v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  PyValue& top() {
    if (stack_.empty()) fail("an empty stack");
    return stack_.back();
  }
  size_t mark() {
    if (marks_.empty()) fail("no MARK to go back to");
    const size_t m = marks_.back();
    marks_.pop_back();
    return m;
  }
  void push_int(int64_t i) {
    PyValue v = make(PyValue::Kind::Int);
    v.i = i;
    stack_.push_back(v);
  }
  void long1() {
    const uint64_t n = le(1);
    if (n > 8) fail("an integer of " + std::to_string(n) + " bytes");
    const uint8_t* b = take(n);
    uint64_t v = 0;
    for (uint64_t k = n; k-- > 0;) v = (v << 8) | b[k];
    if (n > 0 && n < 8 && (b[n - 1] & 0x80)) v |= ~uint64_t{0} << (8 * n);  // sign-extended
    push_int(static_cast<int64_t>(v));
  }
  void binfloat() {
    const uint8_t* b = take(8);
    uint64_t bits = 0;
    for (int k = 0; k < 8; ++k) bits = (bits << 8) | b[k];  // big-endian
    PyValue v = make(PyValue::Kind::Float);
    std::memcpy(&v.f, &bits, 8);
    stack_.push_back(v);
  }
  void push_string(uint64_t n) {
    const uint8_t* b = take(n);
    PyValue v = make(PyValue::Kind::String);
    v.s.assign(reinterpret_cast<const char*>(b), n);
    stack_.push_back(v);
  }
  void tuple(int n) {
    PyValue t = make(PyValue::Kind::Tuple);
    t.items->resize(static_cast<size_t>(n));
    for (int k = n - 1; k >= 0; --k) (*t.items)[static_cast<size_t>(k)] = pop();
    stack_.push_back(t);
  }
  void from_mark(PyValue::Kind kind) {
    const size_t m = mark();
    PyValue v = make(kind);
    v.items->assign(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    stack_.push_back(v);
  }
  void dict_from_mark() {
    const size_t m = mark();
    PyValue d = make(PyValue::Kind::Dict);
    if ((stack_.size() - m) % 2) fail("a dict of an odd number of keys and values");
    for (size_t k = m; k < stack_.size(); k += 2) d.entries->emplace_back(stack_[k], stack_[k + 1]);
    stack_.resize(m);
    stack_.push_back(d);
  }
  void append(int one) {
    const size_t from = one ? stack_.size() - 1 : mark();
    if (from > stack_.size() || from == 0) fail("APPEND without a list");
    PyValue& list = stack_[from - 1];
    if (list.kind != PyValue::Kind::List) fail("APPEND to a " + list.type_name());
    list.items->insert(list.items->end(), stack_.begin() + static_cast<std::ptrdiff_t>(from), stack_.end());
    stack_.resize(from);
  }
  void setitems(bool many) {
    const size_t from = many ? mark() : stack_.size() - 2;
    if (from > stack_.size() || from == 0 || (stack_.size() - from) % 2) fail("SETITEM without a dict, key and value");
    PyValue& dict = stack_[from - 1];
    if (dict.kind != PyValue::Kind::Dict) fail("SETITEM on a " + dict.type_name());
    for (size_t k = from; k < stack_.size(); k += 2) dict.entries->emplace_back(stack_[k], stack_[k + 1]);
    stack_.resize(from);
  }
  void memo_put(uint64_t at) { memo_[at] = top(); }
  void memo_get(uint64_t at) {
    auto it = memo_.find(at);
    if (it == memo_.end()) fail("a memo entry " + std::to_string(at) + " never put");
    stack_.push_back(it->second);
  }
  std::string line() {
    const uint8_t* at = p_;
    while (p_ < end_ && *p_ != '\n') ++p_;
    if (p_ == end_) fail("a GLOBAL without its newline");
    return std::string(reinterpret_cast<const char*>(at), static_cast<size_t>(p_++ - at));
  }
  void global() {
    const std::string module = line();
    stack_.push_back(object(module + "." + line()));
  }
  void stack_global() {
    const PyValue name = pop(), module = pop();
    stack_.push_back(object(module.s + "." + name.s));
  }
  void newobj() {
    pop();  // its arguments
    const PyValue cls = pop();
    stack_.push_back(object(cls.s));
  }
  /// A call: the ones that build what a checkpoint holds (dicts, tensors) are made; any other
  /// gives an opaque object of the callable's name.
  void reduce() {
    const PyValue args = pop(), callable = pop();
    const std::string& f = callable.s;
    const auto arg = [&](size_t k) -> const PyValue& {
      if (args.kind != PyValue::Kind::Tuple || k >= args.items->size()) fail(f + " called with too few arguments");
      return (*args.items)[k];
    };
    if (f == "collections.OrderedDict") {
      PyValue d = make(PyValue::Kind::Dict);
      if (args.kind == PyValue::Kind::Tuple && !args.items->empty() && arg(0).kind == PyValue::Kind::List)
        for (const auto& pair : *arg(0).items)
          if (pair.items && pair.items->size() == 2) d.entries->emplace_back((*pair.items)[0], (*pair.items)[1]);
      return stack_.push_back(d);
    }
    if (f == "torch._utils._rebuild_tensor_v2" || f == "torch._utils._rebuild_tensor")
      return stack_.push_back(rebuild_tensor(arg(0), arg(1), arg(2), arg(3)));
    if (f == "torch._utils._rebuild_parameter") return stack_.push_back(arg(0));
    stack_.push_back(object(f));
  }
  PyValue rebuild_tensor(const PyValue& storage, const PyValue& offset, const PyValue& size, const PyValue& stride) {
    if (storage.kind != PyValue::Kind::Tensor || offset.kind != PyValue::Kind::Int || !size.items || !stride.items ||
        size.items->size() != stride.items->size())
      fail("a tensor rebuilt from arguments that are not a storage, an offset, a size and a stride");
    std::vector<int64_t> sizes, strides;
    int64_t last = offset.i;
    for (size_t k = 0; k < size.items->size(); ++k) {
      sizes.push_back((*size.items)[k].i);
      strides.push_back((*stride.items)[k].i);
      if (sizes.back() < 0 || strides.back() < 0) fail("a tensor of negative size or stride");
      if (sizes.back() == 0) last = -1;
      else if (last >= 0) last += (sizes.back() - 1) * strides.back();
    }
    if (offset.i < 0 || last >= storage.tensor.numel())
      fail("a tensor reaching past its storage of " + std::to_string(storage.tensor.numel()) + " elements");
    PyValue t = make(PyValue::Kind::Tensor);
    t.tensor = storage.tensor.as_strided(sizes, strides, offset.i);
    return t;
  }
  /// ('storage', storage type, key, location, elements): the archive's data/<key>.
  void persistent() {
    const PyValue pid = pop();
    if (pid.kind != PyValue::Kind::Tuple || pid.items->size() < 5 || (*pid.items)[0].s != "storage")
      fail("a persistent id that is not a storage");
    const auto& items = *pid.items;
    const std::string& key = items[2].s;
    auto cached = storages_.find(key);
    if (cached == storages_.end()) {
      at::ScalarType dtype;
      try {
        dtype = storage_dtype(items[1].s);
      } catch (const std::exception& e) {
        fail(e.what());
      }
      const int64_t n = items[4].i;
      const std::string record = "data/" + key;
      if (!archive_.hasRecord(record)) fail("its storage " + record + " is not in the archive");
      auto [data, bytes] = archive_.getRecord(record);
      // Checked before anything is allocated: a damaged count must not ask for the memory it names.
      const size_t element = c10::elementSize(dtype);
      if (n < 0 || static_cast<uint64_t>(n) > bytes / element)
        fail("storage " + record + " holds " + std::to_string(bytes) + " bytes, not the " +
             (n < 0 ? std::string("(negative)") : std::to_string(static_cast<uint64_t>(n) * element)) + " of its " +
             std::to_string(n) + " elements");
      at::Tensor t = at::empty({n}, at::TensorOptions().dtype(dtype));
      std::memcpy(t.data_ptr(), data.get(), t.nbytes());
      cached = storages_.emplace(key, t).first;
    }
    PyValue v = make(PyValue::Kind::Tensor);
    v.tensor = cached->second;
    stack_.push_back(v);
  }

  const uint8_t* p_;
  const uint8_t* begin_;
  const uint8_t* end_;
  caffe2::serialize::PyTorchStreamReader& archive_;
  std::vector<PyValue> stack_;
  std::vector<size_t> marks_;
  std::map<uint64_t, PyValue> memo_;
  std::map<std::string, at::Tensor> storages_;
};

}  // namespace

PyValue read_torch_save(const std::filesystem::path& file) {
  try {
    caffe2::serialize::PyTorchStreamReader archive(file.string());
    if (!archive.hasRecord("data.pkl")) throw std::runtime_error("no data.pkl in the archive");
    auto [data, size] = archive.getRecord("data.pkl");
    const std::string bytes(static_cast<const char*>(data.get()), size);
    return Unpickler(bytes, archive).run();
  } catch (const c10::Error& e) {
    throw Error(file.string() + ": not a file torch.save wrote (" + e.what_without_backtrace() + ")");
  } catch (const std::exception& e) {
    throw Error(file.string() + ": " + e.what());
  }
}

}  // namespace tk::models
