#pragma once
/// Typed, documented options: how plugins and built-in components declare what a recipe may set.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "tk/error.h"

// What this header declares is libtrainkit's interface: exported (the library hides the rest).
#pragma GCC visibility push(default)

namespace tk {

/// Path is a string that names a file or folder: a relative one is resolved against the folder of
/// the recipe that sets it (the working directory for a `--set`), when the recipe is read.
enum class OptionType { Bool, Int, Float, String, IntList, FloatList, Path, StringList };

/// Name of a type as shown in errors and docs ("integer", "float", ...).
const char* to_string(OptionType t) noexcept;

using OptionValue =
    std::variant<bool, int64_t, double, std::string, std::vector<int64_t>, std::vector<double>, std::vector<std::string>>;

/// One option: name, type, default, one-line doc; `choices` restricts a string option.
struct OptionSpec {
  std::string name;
  OptionType type = OptionType::String;
  OptionValue default_value;
  std::string doc;
  /// The values a string option may take; the words an integer option may take instead of a
  /// number (micro_batch = "auto").
  std::vector<std::string> choices = {};
  bool required = false;
  /// An option of an earlier version that moved or went: a recipe may still name it, so that the
  /// plugin refuses it saying where it went; it is not written to recipe.toml nor part of a run's
  /// identity (a checkpoint that records it differs in nothing by it).
  bool retired = false;
  /// Where a retired option went, as a flat recipe key ("batch.accumulation"): a checkpoint that
  /// records the option is compared there on a resume.
  std::string moved_to = {};
  /// Values of a string option that train bit-identically on the CPU (an optimizer's step forms):
  /// a resume on the CPU may change between them; on a GPU they are different runs.
  std::vector<std::string> same_on_cpu = {};
  /// A section that names no component but sets this option selects the component that declares
  /// it ([model] torchscript = "file.pt" is the torchscript model).
  bool selects = false;
};

using OptionSpecs = std::vector<OptionSpec>;

/// Builders that keep declarations short and typed.
OptionSpec opt_bool(std::string name, bool def, std::string doc);
OptionSpec opt_int(std::string name, int64_t def, std::string doc);
OptionSpec opt_float(std::string name, double def, std::string doc);
OptionSpec opt_string(std::string name, std::string def, std::string doc,
                      std::vector<std::string> choices = {});
OptionSpec opt_path(std::string name, std::string def, std::string doc);
OptionSpec opt_ints(std::string name, std::vector<int64_t> def, std::string doc);
OptionSpec opt_floats(std::string name, std::vector<double> def, std::string doc);
/// A list of strings; a recipe may also give one string, a list of one.
OptionSpec opt_strings(std::string name, std::vector<std::string> def, std::string doc);

class Options;

/// The memory of this machine a run counts on, in bytes: TK_MACHINE_MEMORY where it is set (a
/// size, "64GiB": a share of a machine), else the physical memory, or the lowest limit of the
/// cgroups this process is in (a container's, a Slurm job's) where that is lower.
double machine_memory_bytes();
/// "1.5 GiB", "300 MiB".
std::string format_bytes(double bytes);
/// Refuses, naming `key` of `o`, what could not fit this machine's memory: `bytes` is the
/// estimate of what `what` ("a model of 3.2e9 parameters") needs in this process, which every rank
/// of the launch on this machine needs too (LOCAL_WORLD_SIZE, or an srun step's tasks on the node).
void require_memory(const Options& o, const std::string& key, double bytes, const std::string& what);

/// A size in bytes from text such as "1.5GiB", "800MiB", "2GB" or "4096" (binary units KiB, MiB,
/// GiB, TiB; decimal kB, MB, GB, TB); nullopt when it is not one or not > 0.
std::optional<double> parse_bytes(const std::string& text);
/// What parse_bytes expects, for an error about `text`.
std::string bytes_expected(const std::string& text);
/// parse_bytes of option `key` of `o`, refused, naming the key, when it is not a size.
double parse_bytes(const Options& o, const std::string& key);

/// The file path option `key` of `o` names, refused (naming the key) when it is missing, a folder,
/// or not a regular file (a device, a pipe).
std::string require_file(const Options& o, const std::string& key);

/// Resolved option values (defaults filled in), each with where it was set.
class Options {
 public:
  Options() = default;

  void set(const std::string& name, OptionValue v, SourceLoc where = {});
  bool has(const std::string& name) const { return values_.count(name) != 0; }
  /// True when the value was given (in a recipe or override), false when it is the default.
  bool is_set(const std::string& name) const;

  bool get_bool(const std::string& name) const;
  int64_t get_int(const std::string& name) const;
  /// The word an integer option holds instead of a number (one of its spec's choices), else "".
  std::string get_word(const std::string& name) const;
  double get_float(const std::string& name) const;
  const std::string& get_string(const std::string& name) const;
  /// A Path option: absolute once read from a recipe (empty stays empty).
  const std::string& get_path(const std::string& name) const;
  const std::vector<int64_t>& get_ints(const std::string& name) const;
  const std::vector<double>& get_floats(const std::string& name) const;
  const std::vector<std::string>& get_strings(const std::string& name) const;

  /// Where `name` was set (the recipe position, or empty when it is a default).
  SourceLoc where(const std::string& name) const;

  /// An error at the place `name` was set: "file:line:col: <context>.<name>: what".
  [[noreturn]] void fail(const std::string& name, const std::string& what) const;

  /// The section these options came from, e.g. "optimizer" or "plugins.grad_accum".
  const std::string& context() const noexcept { return context_; }
  void set_context(std::string c) { context_ = std::move(c); }
  const SourceLoc& section_loc() const noexcept { return section_loc_; }
  void set_section_loc(SourceLoc l) { section_loc_ = std::move(l); }

  const std::map<std::string, OptionValue>& values() const noexcept { return values_; }
  /// The declarations these values were read against (empty for options built by hand).
  const OptionSpecs& specs() const noexcept { return specs_; }
  void set_specs(OptionSpecs specs) { specs_ = std::move(specs); }
  /// The declaration of `name`, or null.
  const OptionSpec* spec(const std::string& name) const;

 private:
  const OptionValue& at(const std::string& name, OptionType t) const;

  std::map<std::string, OptionValue> values_;
  std::map<std::string, SourceLoc> where_;
  OptionSpecs specs_;
  std::string context_;
  SourceLoc section_loc_;
};

/// Text of a value as it would be written in TOML ("0.1", "\"mean\"", "[1, 2]").
std::string to_toml(const OptionValue& v);

/// Options filled with the specs' defaults only (for tests and for plugins built in code).
Options defaults_of(const OptionSpecs& specs);

#pragma GCC visibility push(hidden)  // the core's own: not exported
namespace detail {
struct BinderState;
}  // namespace detail
#pragma GCC visibility pop

/// How a plugin declares its options: each one once, bound to the member that holds it. The
/// member's value when bind() is called is the option's default, its type the option's type; the
/// core fills the members with the recipe's values before Plugin::init. A name is written once, so
/// it cannot be misspelled where it is read; a name declared twice, a reserved one (`name`,
/// `path`), an empty doc or a default outside its choices is refused when the library registers.
class OptionBinder {
 public:
  /// A boolean, integer, float, string, or list of integers, floats or strings (a recipe may give
  /// one string for a list of one).
  OptionBinder& add(const std::string& name, bool& member, const std::string& doc);
  OptionBinder& add(const std::string& name, int64_t& member, const std::string& doc);
  OptionBinder& add(const std::string& name, double& member, const std::string& doc);
  OptionBinder& add(const std::string& name, std::string& member, const std::string& doc);
  OptionBinder& add(const std::string& name, std::vector<int64_t>& member, const std::string& doc);
  OptionBinder& add(const std::string& name, std::vector<double>& member, const std::string& doc);
  OptionBinder& add(const std::string& name, std::vector<std::string>& member, const std::string& doc);
  /// A string option that takes one of `choices`.
  OptionBinder& add(const std::string& name, std::string& member, const std::string& doc,
                    std::vector<std::string> choices);
  /// A file or folder: a relative path is made absolute against the recipe's folder.
  OptionBinder& path(const std::string& name, std::string& member, const std::string& doc);
  /// A word of `words`, each standing for one value of `member`'s type (an enum, say); the
  /// member's value now must be one of them (it is the default).
  template <class E>
  OptionBinder& choice(const std::string& name, E& member, const std::string& doc,
                       std::vector<std::pair<std::string, E>> words) {
    std::vector<std::string> names;
    std::string fallback;
    for (const auto& [word, value] : words) {
      names.push_back(word);
      if (value == member && fallback.empty()) fallback = word;
    }
    return add_word(name, &member, doc, std::move(names), fallback,
                    [&member, words](const std::string& w) {
                      for (const auto& [word, value] : words)
                        if (word == w) member = value;
                    });
  }
  /// Makes the option declared last one that a recipe must set.
  OptionBinder& required();
  /// Makes the option declared last a retired one (OptionSpec::retired): refuse it in init() when
  /// option_given(), saying where its setting went.
  OptionBinder& retired();
  /// Makes the option declared last a retired one that moved to recipe key `key`
  /// (OptionSpec::moved_to), such as "batch.accumulation".
  OptionBinder& moved_to(std::string key);

  /// Every option declared so far, in order.
  const OptionSpecs& specs() const;

  OptionBinder();
  ~OptionBinder();
  OptionBinder(const OptionBinder&) = delete;
  OptionBinder& operator=(const OptionBinder&) = delete;

 private:
  friend struct detail::BinderState;
  OptionBinder& add_word(const std::string& name, const void* member, const std::string& doc,
                         std::vector<std::string> words, const std::string& current,
                         std::function<void(const std::string&)> assign);
  std::unique_ptr<detail::BinderState> state_;
};

}  // namespace tk

#pragma GCC visibility pop
