#include "tk/options.h"

#include "tk/error.h"

#include "api/api.h"
#include "support/support.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

namespace tk {

namespace {

/// The lowest memory limit of the cgroups this process is in, from its own up to the root: cgroup
/// v2's memory.max, v1's memory.limit_in_bytes under the memory controller (a Slurm job's limit is
/// on its own cgroup, below the root); "max" and v1's huge number are none.
std::optional<double> cgroup_limit() {
  namespace fs = std::filesystem;
  std::optional<double> lowest;
  const auto read = [&lowest](const fs::path& file) {
    std::ifstream in(file);
    std::string v;
    if (!(in >> v)) return;
    char* end = nullptr;
    const double limit = std::strtod(v.c_str(), &end);
    if (end != v.c_str() && *end == '\0' && limit > 0) lowest = std::min(lowest.value_or(limit), limit);
  };
  std::ifstream self("/proc/self/cgroup");  // "0::/path" (v2), "N:controller,...:/path" (v1)
  for (std::string line; std::getline(self, line);) {
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = "," + line.substr(a + 1, b - a - 1) + ",";
    const bool v2 = controllers == ",,";
    if (!v2 && controllers.find(",memory,") == std::string::npos) continue;
    const fs::path root = v2 ? "/sys/fs/cgroup" : "/sys/fs/cgroup/memory";
    const char* file = v2 ? "memory.max" : "memory.limit_in_bytes";
    for (fs::path dir = fs::path(line.substr(b + 1)).relative_path();; dir = dir.parent_path()) {
      read(root / dir / file);
      if (dir.empty()) break;
    }
  }
  for (const char* file : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) read(file);
  return lowest;
}

/// TK_MACHINE_MEMORY where it is set (what a run may count on: a share of a machine), else null.
const char* given_machine_memory() {
  const char* given = std::getenv("TK_MACHINE_MEMORY");
  return given && *given != '\0' ? given : nullptr;
}

}  // namespace

std::string detail::machine_memory_note() { return given_machine_memory() ? " (TK_MACHINE_MEMORY)" : ""; }

double machine_memory_bytes() {
  if (const char* given = given_machine_memory()) {
    const auto bytes = parse_bytes(given);
    if (!bytes) throw Error(std::string("environment variable TK_MACHINE_MEMORY: ") + bytes_expected(given));
    return *bytes;
  }
  // The physical memory, or a container's limit where lower: read once (a process stays in its cgroup).
  static const double machine = [] {
    const double physical = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
    return std::min(physical, cgroup_limit().value_or(physical));
  }();
  return machine;
}

std::string format_bytes(double b) {
  char buf[40];
  constexpr double kMiB = 1024.0 * 1024;
  const char* unit = b >= kMiB * 1024 * 1024 ? "TiB" : b >= kMiB * 1024 ? "GiB" : "MiB";
  const double v = b / (unit[0] == 'T' ? kMiB * 1024 * 1024 : unit[0] == 'G' ? kMiB * 1024 : kMiB);
  // Three digits, never "1e+03 MiB" for the sizes from 1000 to 1023 of a unit.
  std::snprintf(buf, sizeof buf, v >= 999.5 && unit[0] != 'T' ? "%.0f %s" : "%.3g %s", v, unit);
  return buf;
}

namespace {
/// `name` as refusals spell it: "plugins.shard.stage", within its section's context.
std::string qualified(const Options& o, const std::string& name) {
  return o.context().empty() ? name : o.context() + "." + name;
}
}  // namespace

void require_memory(const Options& o, const std::string& key, double bytes, const std::string& what) {
  // Every rank of a launch on this machine makes what this one makes, at the same time.
  const int here = detail::local_world_size_from_environment();
  const double have = machine_memory_bytes();
  if (bytes * here <= have) return;
  std::string need = what + " needs about " + format_bytes(bytes) + " of memory";
  if (here > 1)
    need += " on each of the " + std::to_string(here) + " ranks on this machine, " + format_bytes(bytes * here) + " together";
  throw detail::MemoryRefusal(o.where(key), qualified(o, key) + ": " + need + "; this machine has " + format_bytes(have) +
                                                detail::machine_memory_note());
}

std::optional<double> parse_bytes(const std::string& v) {
  size_t pos = 0;
  double x = 0;
  try {
    x = std::stod(v, &pos);
  } catch (const std::exception&) {
    pos = 0;
  }
  std::string unit = v.substr(pos);
  unit.erase(0, unit.find_first_not_of(' '));
  static const std::pair<const char*, double> kUnits[] = {
      {"", 1},          {"B", 1},         {"KiB", 1024.0},  {"MiB", 1024.0 * 1024}, {"GiB", 1024.0 * 1024 * 1024},
      {"TiB", 1024.0 * 1024 * 1024 * 1024}, {"kB", 1e3}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12}};
  if (pos > 0 && std::isfinite(x) && x > 0)
    for (const auto& [name, scale] : kUnits)
      if (unit == name) return x * scale;
  return std::nullopt;
}

std::string bytes_expected(const std::string& v) {
  return "expected a size > 0 like \"1.5GiB\", \"800MiB\" or \"2GB\", got \"" + v + "\"";
}

double parse_bytes(const Options& o, const std::string& key) {
  const std::string& v = o.get_string(key);
  if (auto bytes = parse_bytes(v)) return *bytes;
  o.fail(key, bytes_expected(v));
}

std::string require_file(const Options& o, const std::string& key) {
  const std::string& path = o.get_path(key);
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) o.fail(key, path + " is a folder, not a file");
  if (!std::filesystem::exists(path, ec)) o.fail(key, "no such file: " + path);
  if (!std::filesystem::is_regular_file(path, ec)) o.fail(key, path + " is not a regular file (a device or a pipe?)");
  return path;
}


const char* to_string(OptionType t) noexcept {
  switch (t) {
    case OptionType::Bool: return "boolean";
    case OptionType::Int: return "integer";
    case OptionType::Float: return "float";
    case OptionType::String: return "string";
    case OptionType::IntList: return "array of integers";
    case OptionType::FloatList: return "array of floats";
    case OptionType::Path: return "path";
    case OptionType::StringList: return "array of strings";
  }
  return "?";
}

OptionSpec opt_bool(std::string name, bool def, std::string doc) {
  return {std::move(name), OptionType::Bool, def, std::move(doc)};
}
OptionSpec opt_int(std::string name, int64_t def, std::string doc) {
  return {std::move(name), OptionType::Int, def, std::move(doc)};
}
OptionSpec opt_float(std::string name, double def, std::string doc) {
  return {std::move(name), OptionType::Float, def, std::move(doc)};
}
OptionSpec opt_string(std::string name, std::string def, std::string doc,
                      std::vector<std::string> choices) {
  return {std::move(name), OptionType::String, std::move(def), std::move(doc), std::move(choices)};
}
OptionSpec opt_path(std::string name, std::string def, std::string doc) {
  return {std::move(name), OptionType::Path, std::move(def), std::move(doc)};
}
OptionSpec opt_ints(std::string name, std::vector<int64_t> def, std::string doc) {
  return {std::move(name), OptionType::IntList, std::move(def), std::move(doc)};
}
OptionSpec opt_floats(std::string name, std::vector<double> def, std::string doc) {
  return {std::move(name), OptionType::FloatList, std::move(def), std::move(doc)};
}
OptionSpec opt_strings(std::string name, std::vector<std::string> def, std::string doc) {
  return {std::move(name), OptionType::StringList, std::move(def), std::move(doc)};
}

void Options::set(const std::string& name, OptionValue v, SourceLoc where) {
  values_[name] = std::move(v);
  where_[name] = std::move(where);
}

const OptionValue& Options::at(const std::string& name, OptionType t) const {
  auto it = values_.find(name);
  if (it == values_.end())
    throw Error("option '" + name + "' is not declared in " + (context_.empty() ? "options" : context_));
  static constexpr OptionType kIndexType[] = {OptionType::Bool,   OptionType::Int,
                                              OptionType::Float,  OptionType::String,
                                              OptionType::IntList, OptionType::FloatList,
                                              OptionType::StringList};
  if (kIndexType[it->second.index()] != t)
    throw Error("option '" + name + "' of " + context_ + " is a " +
                to_string(kIndexType[it->second.index()]) + ", read as a " + to_string(t));
  return it->second;
}

bool Options::get_bool(const std::string& n) const { return std::get<bool>(at(n, OptionType::Bool)); }
int64_t Options::get_int(const std::string& n) const {
  auto it = values_.find(n);
  if (it != values_.end() && std::holds_alternative<std::string>(it->second))
    throw Error("option '" + n + "' of " + context_ + " is \"" + std::get<std::string>(it->second) +
                "\", not a number: read it with get_word");
  return std::get<int64_t>(at(n, OptionType::Int));
}
std::string Options::get_word(const std::string& n) const {
  auto it = values_.find(n);
  if (it != values_.end() && std::holds_alternative<std::string>(it->second)) return std::get<std::string>(it->second);
  return "";
}
double Options::get_float(const std::string& n) const { return std::get<double>(at(n, OptionType::Float)); }
const std::string& Options::get_string(const std::string& n) const {
  return std::get<std::string>(at(n, OptionType::String));
}
const std::string& Options::get_path(const std::string& n) const {
  return std::get<std::string>(at(n, OptionType::String));
}
const std::vector<int64_t>& Options::get_ints(const std::string& n) const {
  return std::get<std::vector<int64_t>>(at(n, OptionType::IntList));
}
const std::vector<double>& Options::get_floats(const std::string& n) const {
  return std::get<std::vector<double>>(at(n, OptionType::FloatList));
}
const std::vector<std::string>& Options::get_strings(const std::string& n) const {
  return std::get<std::vector<std::string>>(at(n, OptionType::StringList));
}

bool Options::is_set(const std::string& name) const {
  auto it = where_.find(name);
  return it != where_.end() && !it->second.file.empty();
}

SourceLoc Options::where(const std::string& name) const {
  auto it = where_.find(name);
  if (it != where_.end() && !it->second.file.empty()) return it->second;
  return section_loc_;
}

void Options::fail(const std::string& name, const std::string& what) const {
  throw RecipeError(where(name), qualified(*this, name) + ": " + what);
}

static std::string format_double(double d) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", d);
  std::string s = buf;
  // Shortest representation that round-trips.
  for (int prec = 1; prec < 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, d);
    if (std::stod(buf) == d) {
      s = buf;
      break;
    }
  }
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

namespace detail {
std::string escape_controls(const std::string& text) {
  std::string out;
  for (char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\r') {
      out += "\\r";
    } else if (u < 0x20 || u == 0x7f) {
      char esc[8];
      std::snprintf(esc, sizeof esc, "\\u%04X", u);
      out += esc;
    } else {
      out += c;
    }
  }
  return out;
}
}  // namespace detail

std::string to_toml(const OptionValue& v) {
  struct Visitor {
    std::string operator()(bool b) const { return b ? "true" : "false"; }
    std::string operator()(int64_t i) const { return std::to_string(i); }
    std::string operator()(double d) const { return format_double(d); }
    std::string operator()(const std::string& s) const {
      // A basic string: quotes, backslashes and control characters escaped (a literal newline, in
      // a data set's document separator say, is no TOML).
      std::string out;
      for (char c : s) {
        if (c == '"' || c == '\\') out += '\\';
        out += c;
      }
      return "\"" + detail::escape_controls(out) + "\"";
    }
    std::string operator()(const std::vector<int64_t>& xs) const {
      std::string out = "[";
      for (size_t i = 0; i < xs.size(); ++i) out += (i ? ", " : "") + std::to_string(xs[i]);
      return out + "]";
    }
    std::string operator()(const std::vector<double>& xs) const {
      std::string out = "[";
      for (size_t i = 0; i < xs.size(); ++i) out += (i ? ", " : "") + format_double(xs[i]);
      return out + "]";
    }
    std::string operator()(const std::vector<std::string>& xs) const {
      std::string out = "[";
      for (size_t i = 0; i < xs.size(); ++i) out += (i ? ", " : "") + (*this)(xs[i]);
      return out + "]";
    }
  };
  return std::visit(Visitor{}, v);
}

Options defaults_of(const OptionSpecs& specs) {
  Options o;
  for (const auto& s : specs) o.set(s.name, s.default_value);
  o.set_specs(specs);
  return o;
}

const OptionSpec* Options::spec(const std::string& name) const {
  for (const auto& s : specs_)
    if (s.name == name) return &s;
  return nullptr;
}

}  // namespace tk
