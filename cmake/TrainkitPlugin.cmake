# Functions that build and test trainkit plugins. trainkit's own plugins use them in its tree;
# installed, trainkitConfig.cmake provides them to projects that find_package(trainkit).
#
# Expects: the targets trainkit::core, trainkit::testing and trainkit::tk-plugin, and
# TRAINKIT_PLUGIN_DIR (the folder of trainkit's own plugins).

# tk_add_plugin(NAME SOURCES src... [OUTPUT_DIR dir])
# Builds tk_<NAME>.so: a MODULE library (loaded at run time, never linked) with hidden visibility,
# so that only its entry point is exported. The target is tk_plugin_<NAME>.
function(tk_add_plugin name)
  cmake_parse_arguments(P "" "OUTPUT_DIR" "SOURCES" ${ARGN})
  if(NOT P_SOURCES)
    message(FATAL_ERROR "tk_add_plugin(${name}): give SOURCES")
  endif()
  set(target tk_plugin_${name})
  add_library(${target} MODULE ${P_SOURCES})
  target_link_libraries(${target} PRIVATE trainkit::core)
  set_target_properties(${target} PROPERTIES
    PREFIX ""
    OUTPUT_NAME tk_${name}
    DEFINE_SYMBOL ""  # no tk_plugin_<name>_EXPORTS: the plugins of a project share one precompiled header
    CXX_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON)
  if(P_OUTPUT_DIR)
    set_target_properties(${target} PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${P_OUTPUT_DIR})
  endif()
  # The LibTorch and trainkit headers, precompiled once per project and reused by each plugin.
  if(NOT DEFINED TK_USE_PCH OR TK_USE_PCH)
    get_property(first GLOBAL PROPERTY TK_FIRST_PLUGIN)
    if(first)
      target_precompile_headers(${target} REUSE_FROM ${first})
    else()
      target_precompile_headers(${target} PRIVATE <tk/abi.h>)
      set_property(GLOBAL PROPERTY TK_FIRST_PLUGIN ${target})
    endif()
  endif()
endfunction()

# tk_add_plugin_test(NAME [OPTIONS toml] [NEUTRAL toml|none] [TESTS src... [OWN_MAIN]])
# Registers with ctest the plugin contract for tk_<NAME>.so (`tk-plugin check`, as <NAME>.contract)
# and, with TESTS, a doctest executable of those sources linked to trainkit::testing (as
# <NAME>.tests). The tests see TK_PLUGIN_FILE (the plugin library) and TK_PLUGIN_DIR (trainkit's
# own plugins). OPTIONS are the plugin options the contract's behavioural checks use; NEUTRAL the
# options with which it must leave a run bit-identical ("none": it always changes the numerics).
# The executable gets doctest's main() from a generated file, trainkit_doctest_main.cpp; with
# OWN_MAIN it does not (your TESTS then define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN, or a main of
# their own).
function(tk_add_plugin_test name)
  cmake_parse_arguments(P "OWN_MAIN" "OPTIONS;NEUTRAL" "TESTS" ${ARGN})
  set(target tk_plugin_${name})
  if(NOT TARGET ${target})
    message(FATAL_ERROR "tk_add_plugin_test(${name}): no plugin ${name}; call tk_add_plugin(${name} ...) first")
  endif()
  set(args)
  if(DEFINED P_OPTIONS)
    list(APPEND args --options "${P_OPTIONS}")
  endif()
  if(DEFINED P_NEUTRAL)
    list(APPEND args --neutral "${P_NEUTRAL}")
  endif()
  add_test(NAME ${name}.contract COMMAND $<TARGET_FILE:trainkit::tk-plugin> check $<TARGET_FILE:${target}> ${args})
  if(P_OWN_MAIN AND NOT P_TESTS)
    message(FATAL_ERROR "tk_add_plugin_test(${name}): OWN_MAIN goes with TESTS")
  endif()
  if(P_TESTS)
    find_package(doctest REQUIRED)
    set(main)
    if(NOT P_OWN_MAIN)
      set(main ${CMAKE_CURRENT_BINARY_DIR}/trainkit_doctest_main.cpp)
      if(NOT EXISTS ${main})
        file(WRITE ${main} "// doctest's main() for the tests of tk_add_plugin_test(). Tests that define their own\n"
                           "// (DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN, or main()) pass OWN_MAIN instead.\n"
                           "#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN\n#include <doctest/doctest.h>\n")
      endif()
      set_source_files_properties(${main} PROPERTIES SKIP_PRECOMPILE_HEADERS ON)
    endif()
    add_executable(${name}_tests ${P_TESTS} ${main})
    target_link_libraries(${name}_tests PRIVATE trainkit::testing doctest::doctest)
    target_compile_definitions(${name}_tests PRIVATE
      TK_PLUGIN_FILE="$<TARGET_FILE:${target}>"
      TK_PLUGIN_DIR="${TRAINKIT_PLUGIN_DIR}")
    add_dependencies(${name}_tests ${target})
    add_test(NAME ${name}.tests COMMAND ${name}_tests)
  endif()
endfunction()
