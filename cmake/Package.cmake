# The installed package: trainkitConfig.cmake (+ version file, exported targets, the plugin
# functions) and trainkit.pc for projects that do not use CMake. Relocatable: nothing in it names
# the install prefix.
include(CMakePackageConfigHelpers)

install(EXPORT trainkitTargets NAMESPACE trainkit:: DESTINATION ${TK_CMAKE_INSTALL_DIR})
set(TK_TORCH_VERSION "${Torch_VERSION}")
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/trainkitConfig.cmake.in
  ${PROJECT_BINARY_DIR}/trainkitConfig.cmake
  INSTALL_DESTINATION ${TK_CMAKE_INSTALL_DIR}
  PATH_VARS TK_PLUGIN_INSTALL_DIR)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/trainkitConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES
  ${PROJECT_BINARY_DIR}/trainkitConfig.cmake
  ${PROJECT_BINARY_DIR}/trainkitConfigVersion.cmake
  ${PROJECT_SOURCE_DIR}/cmake/TrainkitPlugin.cmake
  DESTINATION ${TK_CMAKE_INSTALL_DIR})

# pkg-config: the same compile and link lines, with LibTorch's spelled out.
set(TK_TORCH_CFLAGS "${TORCH_CXX_FLAGS}")
foreach(dir IN LISTS TORCH_INCLUDE_DIRS)
  if(NOT dir IN_LIST CMAKE_CXX_IMPLICIT_INCLUDE_DIRECTORIES)  # -isystem /usr/include breaks #include_next
    string(APPEND TK_TORCH_CFLAGS " -isystem ${dir}")
  endif()
endforeach()
get_filename_component(tk_torch_libdir "${TORCH_LIBRARY}" DIRECTORY)
set(TK_TORCH_LIBS "-L${tk_torch_libdir} -ltorch -ltorch_cpu -lc10")
file(RELATIVE_PATH TK_PC_TO_PREFIX "/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/")
configure_file(${PROJECT_SOURCE_DIR}/cmake/trainkit.pc.in ${PROJECT_BINARY_DIR}/trainkit.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/trainkit.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

# The example plugins, as an outside project builds them (tests/sdk/check_sdk.sh builds them from here).
set(TK_EXAMPLES_INSTALL_DIR "${CMAKE_INSTALL_DATADIR}/trainkit/examples")
install(DIRECTORY ${PROJECT_SOURCE_DIR}/examples/ DESTINATION ${TK_EXAMPLES_INSTALL_DIR})
# The guides (docs/, README.md) into share/doc/trainkit, linked to the installed examples and back.
file(RELATIVE_PATH tk_doc_to_examples "/${CMAKE_INSTALL_DOCDIR}" "/${TK_EXAMPLES_INSTALL_DIR}")
file(RELATIVE_PATH tk_examples_to_doc "/${TK_EXAMPLES_INSTALL_DIR}" "/${CMAKE_INSTALL_DOCDIR}")
install(CODE "set(TK_SOURCE_DIR \"${PROJECT_SOURCE_DIR}\")
set(TK_DOC_DIR \"${CMAKE_INSTALL_DOCDIR}\")
set(TK_EXAMPLES_DIR \"${TK_EXAMPLES_INSTALL_DIR}\")
set(TK_DOC_TO_EXAMPLES \"${tk_doc_to_examples}\")
set(TK_EXAMPLES_TO_DOC \"${tk_examples_to_doc}\")")
install(SCRIPT ${PROJECT_SOURCE_DIR}/cmake/InstallDocs.cmake)
