# The libraries trainkit builds with besides LibTorch: Debian's -dev packages, found with
# find_package. With TK_HEADER_ONLY_DEPS set to a folder (tools/gpu-check.sh --prepare makes it),
# the same Debian packages unpacked there are used instead, all header-only (TOML++, spdlog with
# fmt, CLI11, nlohmann-json, doctest, the part of Boost that Boost.DLL needs, Gloo's headers,
# zlib's header with the machine's libz.so.1): for a machine with a compiler and a LibTorch (a
# PyTorch wheel's) but none of those packages and no network.
set(TK_HEADER_ONLY_DEPS "" CACHE PATH "a folder of unpacked Debian -dev packages to build against, header-only")

if(TK_HEADER_ONLY_DEPS)
  set(deps_include "${TK_HEADER_ONLY_DEPS}/usr/include")
  if(NOT EXISTS "${deps_include}/toml++/toml.h")
    message(FATAL_ERROR "TK_HEADER_ONLY_DEPS=${TK_HEADER_ONLY_DEPS} holds no usr/include/toml++/toml.h: "
                        "make it with tools/gpu-check.sh --prepare")
  endif()
  # doctest, nlohmann-json and CLI11 ship header-only CMake packages: found there as usual.
  list(APPEND CMAKE_PREFIX_PATH "${TK_HEADER_ONLY_DEPS}/usr")
  find_package(CLI11 REQUIRED)
  find_package(nlohmann_json 3 REQUIRED)
  # Debian's TOML++ and spdlog packages describe their compiled libraries; here, their headers alone.
  add_library(tomlplusplus::tomlplusplus INTERFACE IMPORTED GLOBAL)
  target_include_directories(tomlplusplus::tomlplusplus SYSTEM INTERFACE "${deps_include}")
  target_compile_definitions(tomlplusplus::tomlplusplus INTERFACE TOML_HEADER_ONLY=1)
  add_library(spdlog::spdlog INTERFACE IMPORTED GLOBAL)
  target_include_directories(spdlog::spdlog SYSTEM INTERFACE "${deps_include}")
  target_compile_definitions(spdlog::spdlog INTERFACE SPDLOG_FMT_EXTERNAL FMT_HEADER_ONLY)
  # Boost.DLL and Gloo: headers only, for every target.
  include_directories(SYSTEM "${deps_include}")
  set(ZLIB_INCLUDE_DIR "${deps_include}" CACHE PATH "zlib.h")
  # The machine's own libz, never one from the folder (Debian's libz.a there is no PIC: it cannot go
  # into a plugin).
  find_library(ZLIB_LIBRARY NAMES z NO_CMAKE_PATH NO_CMAKE_ENVIRONMENT_PATH)
  if(NOT ZLIB_LIBRARY)  # no -dev symlink on this machine: its runtime library itself
    find_file(ZLIB_LIBRARY NAMES libz.so.1 PATHS /lib/x86_64-linux-gnu /usr/lib/x86_64-linux-gnu /lib64 /usr/lib64 REQUIRED)
  endif()
  find_package(ZLIB REQUIRED)
else()
  find_package(tomlplusplus REQUIRED)
  find_package(spdlog REQUIRED)
  find_package(ZLIB REQUIRED)
  find_package(CLI11 REQUIRED)
  find_package(nlohmann_json 3 REQUIRED)
endif()
