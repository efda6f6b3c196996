# The layers.include_path.<layer> tests (tests/CMakeLists.txt): run as
#   cmake -DCXX=<c++ compiler> -DLAYER=<folder> -DALLOWED=<a|b|...> -DINCLUDES=<dir|dir|...>
#         -DSOURCE_DIR=<checkout> -DWORK=<scratch dir> -P indexcpLayerProbe.cmake
# INCLUDES are the include directories the folder's sources compile with (those of its target,
# cmake/indexcpLayers.cmake). For every folder G of src/ with a header h (the first in name order),
# a one-line probe is compiled with those directories only (-fsyntax-only, the C++ compiler even
# for the cuda layer: the point is the include path):
#   G allowed: `#if !__has_include("G/h") #error` must compile;
#   G refused: `#include "G/h"` must fail, and fail because "G/h" is not found (not for another
#              reason), e.g. `#include "cpu/kernels.hpp"` in the include context of src/cuda.
# Folders without a header (src/nccl) have nothing to probe.
foreach(v CXX LAYER INCLUDES SOURCE_DIR WORK)
  if(NOT DEFINED ${v} OR "${${v}}" STREQUAL "")
    message(FATAL_ERROR "indexcpLayerProbe.cmake: -D${v}= is missing")
  endif()
endforeach()
string(REPLACE "|" ";" ALLOWED "${ALLOWED}")
string(REPLACE "|" ";" INCLUDES "${INCLUDES}")
set(flags)
foreach(d IN LISTS INCLUDES)
  if(d STREQUAL "${SOURCE_DIR}/src")
    message(FATAL_ERROR "layer ${LAYER}: src/ itself is on the include path (${d})")
  endif()
  list(APPEND flags "-I${d}")
endforeach()

# The probe of a path the layer may include (`what`: "" for a folder's header, "the file " for a
# single file): a STATUS line when the include path finds it, else a SEND_ERROR and one more failure.
function(expect_found inc what)
  set(probe ${WORK}/${LAYER}_finds.cpp)
  file(WRITE ${probe} "#if !__has_include(\"${inc}\")\n#error \"${inc}\" is not on the include path\n#endif\n")
  execute_process(COMMAND ${CXX} -std=c++20 -fsyntax-only ${flags} ${probe}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(rc EQUAL 0)
    message(STATUS "src/${LAYER} may include ${what}\"${inc}\": found")
  else()
    message(SEND_ERROR "src/${LAYER} may include ${what}\"${inc}\", but it is not found:\n${out}")
    math(EXPR n "${failures} + 1")
    set(failures ${n} PARENT_SCOPE)
  endif()
endfunction()

file(MAKE_DIRECTORY ${WORK})
file(GLOB folders LIST_DIRECTORIES true RELATIVE ${SOURCE_DIR}/src ${SOURCE_DIR}/src/*)
list(SORT folders)
set(failures 0)
set(probed 0)
foreach(g IN LISTS folders)
  if(NOT IS_DIRECTORY ${SOURCE_DIR}/src/${g})
    continue()
  endif()
  file(GLOB headers RELATIVE ${SOURCE_DIR}/src/${g} ${SOURCE_DIR}/src/${g}/*.hpp ${SOURCE_DIR}/src/${g}/*.cuh)
  if(NOT headers)
    continue()
  endif()
  list(SORT headers)
  list(GET headers 0 h)
  set(inc "${g}/${h}")
  math(EXPR probed "${probed} + 1")
  list(FIND ALLOWED ${g} i)
  if(i GREATER -1)
    expect_found("${inc}" "")
  else()
    set(probe ${WORK}/${LAYER}_includes_${g}.cpp)
    file(WRITE ${probe} "#include \"${inc}\"\n")
    execute_process(COMMAND ${CXX} -std=c++20 -fsyntax-only ${flags} ${probe}
                    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
    # gcc: "fatal error: cpu/kernels.hpp: No such file or directory"; clang: "'cpu/kernels.hpp' file not found"
    string(REGEX MATCH "${inc}[:']? ?(No such file or directory|file not found)" missing "${out}")
    if(NOT rc EQUAL 0 AND missing)
      string(REGEX MATCH "[^\n]*(No such file or directory|file not found)[^\n]*" line "${out}")
      message(STATUS "src/${LAYER} may not include \"${inc}\": refused (${line})")
    else()
      message(SEND_ERROR "src/${LAYER} may not include \"${inc}\", but the probe (rc ${rc}) did not fail for a missing file:\n${out}")
      math(EXPR failures "${failures} + 1")
    endif()
  endif()
endforeach()
# the single files the layer may include from a folder it may not (INDEXCP_LAYER_FILES_<layer>)
string(REPLACE "|" ";" FILES "${FILES}")
foreach(f IN LISTS FILES)
  expect_found("${f}" "the file ")
endforeach()
if(probed LESS 5)
  message(FATAL_ERROR "layer ${LAYER}: only ${probed} folders probed (src/ not found?)")
endif()
if(failures GREATER 0)
  message(FATAL_ERROR "layer ${LAYER}: ${failures} of ${probed} probes failed")
endif()
