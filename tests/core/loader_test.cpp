// The plugin loader against well-formed and broken fixture libraries.
#include <dlfcn.h>
#include <tk/abi.h>
#include <tk/loader.h>

#include <cstdlib>

#include "support.h"

namespace fs = std::filesystem;

namespace {

const fs::path kFixtures = TK_TEST_PLUGIN_DIR;

std::string load_error(const fs::path& file) {
  tk::PluginLoader loader({kFixtures});
  try {
    loader.load_plugin(file);
  } catch (const tk::PluginLoadError& e) {
    return e.what();
  }
  return "(loaded)";
}

bool is_loaded(const fs::path& file) {
  void* h = dlopen(file.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (h) dlclose(h);
  return h != nullptr;
}

}  // namespace

TEST_SUITE("loader") {
  TEST_CASE("a well-formed plugin loads with its name, version and options") {
    tk::PluginLoader loader({kFixtures});
    auto lp = loader.load_plugin(loader.find("probe"));
    CHECK(lp.name == "probe");
    CHECK(lp.version == "1.0.0");
    CHECK(lp.file == kFixtures / "tk_probe.so");
    CHECK(lp.plugin->name() == "probe");
    tk::Registry registry;
    loader.load(loader.find("probe"), registry);
    REQUIRE(registry.plugins().size() == 1);
    CHECK(registry.plugins().front().specs.size() == 12);
    CHECK(registry.plugins().front().doc == "records the events it sees; vetoes, throws or kills on request");
  }

  TEST_CASE("each broken library is refused with the file and expected vs found") {
    const fs::path bad_abi = kFixtures / "tk_bad_abi.so";
    CHECK(load_error(bad_abi) == bad_abi.string() + ": plugin ABI version mismatch: expected " +
                                     std::to_string(TK_PLUGIN_ABI_VERSION) +
                                     ", got 999. Rebuild the plugin against this trainkit (" TK_VERSION
                                     "): `cmake -S . -B build -DCMAKE_PREFIX_PATH=<trainkit's prefix> && cmake "
                                     "--build build`; it was built for a newer trainkit than this one");
    const fs::path old_abi = kFixtures / "tk_old_abi.so";
    CHECK(load_error(old_abi) == old_abi.string() + ": plugin ABI version mismatch: expected " +
                                     std::to_string(TK_PLUGIN_ABI_VERSION) + ", got " +
                                     std::to_string(TK_PLUGIN_ABI_VERSION - 1) +
                                     ". Rebuild the plugin against this trainkit (" TK_VERSION
                                     "): `cmake -S . -B build -DCMAKE_PREFIX_PATH=<trainkit's prefix> && cmake "
                                     "--build build`; a plugin written for API " +
                                     std::to_string(TK_PLUGIN_ABI_VERSION - 1) +
                                     " needs the source changes listed under \"Porting a plugin to API " +
                                     std::to_string(TK_PLUGIN_ABI_VERSION) + "\" in docs/plugins.md");
    const fs::path no_entry = kFixtures / "tk_no_entry.so";
    CHECK(load_error(no_entry) == no_entry.string() +
                                      ": not a trainkit plugin: it does not export the entry point 'tk_plugin_entry' "
                                      "(define it with TK_PLUGIN or TK_LIBRARY)");
    const fs::path old_torch = kFixtures / "tk_old_torch.so";
    CHECK(load_error(old_torch) == old_torch.string() +
                                       ": plugin 'old_torch' was built against LibTorch 0.4.1, expected " +
                                       TORCH_VERSION + " (the LibTorch this trainkit uses)");
    const fs::path null_factory = kFixtures / "tk_null_factory.so";
    CHECK(load_error(null_factory) == fs::weakly_canonical(null_factory).string() +
                                           ": plugin 'null_factory': its factory returned null");
    const fs::path no_register = kFixtures / "tk_no_register.so";
    CHECK(load_error(no_register) == no_register.string() + ": plugin 'no_register' has a null registration function");
    const fs::path bad_layout = kFixtures / "tk_bad_layout.so";
    const std::string layout = load_error(bad_layout);
    CHECK(layout.find(bad_layout.string() + ": plugin was built with headers whose types have another layout: "
                                            "expected layout 0x") == 0);
    CHECK(layout.find("(trainkit " TK_VERSION "), got 0x") != std::string::npos);
    CHECK(layout.find("(trainkit 0.1.9); rebuild it against this trainkit") != std::string::npos);
    const fs::path newer = kFixtures / "tk_newer.so";
    CHECK(load_error(newer) == newer.string() + ": plugin was built against trainkit 99.1.0, newer than this one (" TK_VERSION
                                                 "): it may use functions this one does not have; rebuild it against this "
                                                 "trainkit, or run it with trainkit 99.1.0 or later");
    const fs::path throws = kFixtures / "tk_throws.so";
    CHECK(load_error(throws) == throws.string() + ": plugin 'throws' failed to register: no licence for this machine");
    CHECK(load_error(kFixtures / "tk_missing.so") == (kFixtures / "tk_missing.so").string() +
                                                          ": plugin file does not exist");
    const fs::path not_a_library = fs::path(TK_SOURCE_DIR) / "tests/fixtures/bad_key.toml";
    CHECK(load_error(not_a_library) == not_a_library.string() + ": not a shared library (invalid ELF header)");
    // A truncated library would crash the dynamic loader (SIGBUS): refused before it sees it.
    const fs::path truncated = tkt::temp_dir("truncated-lib");
    fs::create_directories(truncated);
    {
      std::ifstream in(kFixtures / "tk_throws.so", std::ios::binary);
      std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      std::ofstream(truncated / "tk_cut.so", std::ios::binary) << bytes.substr(0, bytes.size() / 2);
    }
    CHECK(load_error(truncated / "tk_cut.so").find(": truncated or damaged (") != std::string::npos);
    // Of the right size, zeros from byte 30000 on (an interrupted, preallocated copy): the tables
    // the dynamic loader reads are gone, and it would crash on them.
    {
      std::ifstream in(fs::path(TK_PLUGIN_DIR) / "tk_clip.so", std::ios::binary);
      std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      REQUIRE(bytes.size() > 30000);
      std::fill(bytes.begin() + 30000, bytes.end(), '\0');
      std::ofstream(truncated / "tk_zeros.so", std::ios::binary) << bytes;
    }
    CHECK(load_error(truncated / "tk_zeros.so").find(truncated.string() + "/tk_zeros.so: damaged (") == 0);
    CHECK(load_error(truncated) == truncated.string() + ": is a folder, not a plugin library");
    CHECK(load_error("/dev/null") == "/dev/null: is not a regular file (a device or a pipe?)");
    fs::remove_all(truncated);
  }

  TEST_CASE("a plugin not on the search path is reported with the folders searched and what exists") {
    tk::PluginLoader loader({"/nonexistent/dir", kFixtures});
    try {
      loader.find("nope");
      FAIL("found a plugin that does not exist");
    } catch (const tk::PluginLoadError& e) {
      std::string m = e.what();
      CHECK(m.find("plugin 'nope' not found: no tk_nope.so in\n  /nonexistent/dir\n  " + kFixtures.string()) == 0);
      CHECK(m.find("available plugins: bad_abi, bad_layout, cycle_a") != std::string::npos);
    }
  }

  TEST_CASE("the search path has the recipe folder first and honours TK_PLUGIN_PATH") {
    setenv("TK_PLUGIN_PATH", "/opt/a:/opt/b", 1);
    auto dirs = tk::PluginLoader::default_dirs("/recipes");
    unsetenv("TK_PLUGIN_PATH");
    REQUIRE(dirs.size() == 4);
    CHECK(dirs[0] == fs::path("/recipes/plugins"));
    CHECK(dirs[1] == fs::path("/opt/a"));
    CHECK(dirs[2] == fs::path("/opt/b"));
    // trainkit's own plugins, found next to libtrainkit (here: the build tree's).
    CHECK(fs::equivalent(dirs[3], fs::path(TK_PLUGIN_DIR)));
  }

  TEST_CASE("an instance keeps its library loaded for as long as it lives") {
    const fs::path file = kFixtures / "tk_fake_clip2.so";
    REQUIRE_FALSE(is_loaded(file));
    std::shared_ptr<tk::Plugin> plugin;
    {
      tk::PluginLoader loader({kFixtures});
      plugin = loader.load_plugin(file).plugin;
    }
    CHECK(is_loaded(file));
    REQUIRE(plugin->contract().provides.size() == 1);  // its code still runs
    CHECK(plugin->contract().provides.front().name() == "grads.clipped");
    auto copy = plugin;
    plugin.reset();
    CHECK(is_loaded(file));
    copy.reset();
    CHECK_FALSE(is_loaded(file));
  }
}
