# Run by `cmake --install`: the guides into the documentation folder (docs/*.md and their images,
# README.md, uPlot's README and license), their links into the source tree rewritten to where the
# installed files are, and the installed examples' README pointed at the installed guides.
# Expects TK_SOURCE_DIR, TK_DOC_DIR, TK_EXAMPLES_DIR (relative to the prefix) and
# TK_DOC_TO_EXAMPLES, TK_EXAMPLES_TO_DOC (relative paths between the two).
set(root "$ENV{DESTDIR}${CMAKE_INSTALL_PREFIX}")
set(doc "${root}/${TK_DOC_DIR}")
file(MAKE_DIRECTORY "${doc}/uplot")

# Writes `text` to `file` and lists it in the install manifest.
function(tk_install_text file text)
  message(STATUS "Installing: ${file}")
  file(WRITE "${file}" "${text}")
  set(CMAKE_INSTALL_MANIFEST_FILES ${CMAKE_INSTALL_MANIFEST_FILES} "${file}" PARENT_SCOPE)
endfunction()

file(GLOB guides "${TK_SOURCE_DIR}/docs/*.md")
foreach(guide IN LISTS guides)
  file(READ "${guide}" text)
  string(REPLACE "](../examples" "](${TK_DOC_TO_EXAMPLES}" text "${text}")
  string(REPLACE "](../tools/tk-report/vendor/uplot/" "](uplot/" text "${text}")
  string(REPLACE "](../README.md" "](README.md" text "${text}")
  get_filename_component(name "${guide}" NAME)
  tk_install_text("${doc}/${name}" "${text}")
endforeach()
file(READ "${TK_SOURCE_DIR}/README.md" text)
string(REPLACE "](docs/" "](" text "${text}")
string(REPLACE "](examples/" "](${TK_DOC_TO_EXAMPLES}/" text "${text}")
tk_install_text("${doc}/README.md" "${text}")
file(GLOB images "${TK_SOURCE_DIR}/docs/*.png")
set(copies)
foreach(image IN LISTS images)
  get_filename_component(name "${image}" NAME)
  list(APPEND copies "${image}" "${doc}/${name}")
endforeach()
list(APPEND copies "${TK_SOURCE_DIR}/tools/tk-report/vendor/uplot/README.md" "${doc}/uplot/README.md"
                   "${TK_SOURCE_DIR}/tools/tk-report/vendor/uplot/LICENSE" "${doc}/uplot/LICENSE")
while(copies)
  list(POP_FRONT copies from to)
  message(STATUS "Installing: ${to}")
  configure_file("${from}" "${to}" COPYONLY)
  list(APPEND CMAKE_INSTALL_MANIFEST_FILES "${to}")
endwhile()

# The examples' README, installed as it is in the source, links the guides there.
set(readme "${root}/${TK_EXAMPLES_DIR}/README.md")
file(READ "${readme}" text)
string(REPLACE "](../docs/" "](${TK_EXAMPLES_TO_DOC}/" text "${text}")
file(WRITE "${readme}" "${text}")
