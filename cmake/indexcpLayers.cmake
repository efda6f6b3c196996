# The layers of src/ (docs/architecture.md section 1), enforced by the include path.
#
# Every folder F of src/ compiles with only the folders it may include on its include path: the
# directory layers/F of the build tree holds one symbolic link per allowed folder G
# (layers/F/G -> src/G), and layers/F, include/ and the generated include/ are the only project
# directories its sources see. So `#include "cpu/kernels.hpp"` in src/cuda does not compile
# ("No such file or directory"), where with src/ on the path it did. A folder's own headers
# included without a prefix are found beside the including file (the "..." rule), and with the
# prefix through its own link. The library's folders (core, cpu, comm, cuda, nccl, io) are one
# OBJECT library each, indexcp_<F>, whose objects make the library indexcp ($<TARGET_OBJECTS>, so
# no usage requirement of the object libraries reaches indexcp, its link line or its export);
# bench and cli already are targets of their own (indexcp_bench, indexcp_cli) and get the same
# include path. The tests keep src/ on their path (they test internals).
#
# The table: INDEXCP_LAYER_ALLOWED_<F> lists the folders F may include besides the public headers
# (indexcp/...). It is the build's copy of kAllowed in tests/test_layers.cpp;
# Layers.BuildTableMatchesThisTable compares the two, the layers.include_path.<F> tests
# (tests/CMakeLists.txt, cmake/indexcpLayerProbe.cmake) check that the include path of each
# folder finds what the table allows and refuses the rest.
set(INDEXCP_LAYERS core cpu comm cuda nccl io bench cli)
set(INDEXCP_LAYER_ALLOWED_core core)
set(INDEXCP_LAYER_ALLOWED_cpu core cpu)
set(INDEXCP_LAYER_ALLOWED_comm core comm)
set(INDEXCP_LAYER_ALLOWED_cuda core comm cuda)
set(INDEXCP_LAYER_ALLOWED_nccl core nccl)
set(INDEXCP_LAYER_ALLOWED_io core io)
set(INDEXCP_LAYER_ALLOWED_bench core bench)
set(INDEXCP_LAYER_ALLOWED_cli core bench cli)
# Single files a folder may include from a folder it may not otherwise include (kAllowedFiles):
# bench's device buffers are the backend's (src/cuda/device_buffer.cuh includes only the CUDA
# runtime), linked as layers/bench/cuda/device_buffer.cuh.
set(INDEXCP_LAYER_FILES_bench cuda/device_buffer.cuh)

set(INDEXCP_LAYER_DIR ${PROJECT_BINARY_DIR}/layers)
# Made again at every configure, so that a link the table no longer allows does not stay behind
# (REMOVE_RECURSE removes the links, not what they point to).
file(REMOVE_RECURSE ${INDEXCP_LAYER_DIR})
foreach(_layer IN LISTS INDEXCP_LAYERS)
  file(MAKE_DIRECTORY ${INDEXCP_LAYER_DIR}/${_layer})
  foreach(_to IN LISTS INDEXCP_LAYER_ALLOWED_${_layer})
    file(CREATE_LINK ${PROJECT_SOURCE_DIR}/src/${_to} ${INDEXCP_LAYER_DIR}/${_layer}/${_to} SYMBOLIC)
  endforeach()
  foreach(_file IN LISTS INDEXCP_LAYER_FILES_${_layer})
    get_filename_component(_dir ${_file} DIRECTORY)
    file(MAKE_DIRECTORY ${INDEXCP_LAYER_DIR}/${_layer}/${_dir})
    file(CREATE_LINK ${PROJECT_SOURCE_DIR}/src/${_file} ${INDEXCP_LAYER_DIR}/${_layer}/${_file} SYMBOLIC)
  endforeach()
endforeach()
unset(_layer)
unset(_to)
unset(_file)
unset(_dir)

# The project include directories of folder <layer>, in the place src/ had on the library's
# include path (after the public headers).
function(indexcp_layer_include_dirs layer out)
  set(${out} ${PROJECT_SOURCE_DIR}/include ${INDEXCP_GENERATED_INCLUDE_DIR} ${INDEXCP_LAYER_DIR}/${layer}
      PARENT_SCOPE)
endfunction()

# indexcp_add_layer(<layer> <sources>...): the OBJECT library indexcp_<layer> of the sources of
# src/<layer> (paths relative to the calling CMakeLists.txt), compiled exactly as the sources of
# indexcp were when they were its own (the same options, definitions, standard, PIC and the
# include directories its usage requirements brought), and its objects added to indexcp.
# Options of one folder only (the CUDA flags of src/cuda) are added to indexcp_<layer> by the
# caller.
function(indexcp_add_layer layer)
  set(t indexcp_${layer})
  add_library(${t} OBJECT ${ARGN})
  indexcp_layer_include_dirs(${layer} dirs)
  target_include_directories(${t} PRIVATE ${dirs})
  target_compile_features(${t} PRIVATE cxx_std_20)
  target_compile_options(${t} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${INDEXCP_CXX_FLAGS}>)
  set_target_properties(${t} PROPERTIES POSITION_INDEPENDENT_CODE ON)
  # The sources of a shared library are compiled with <target>_EXPORTS defined; an object
  # library's are not, so it is defined here (nothing reads it; the flags stay the same).
  get_target_property(type indexcp TYPE)
  if(type STREQUAL "SHARED_LIBRARY")
    target_compile_definitions(${t} PRIVATE indexcp_EXPORTS)
  endif()
  # What indexcp's link libraries gave every one of its sources (include directories, -fopenmp).
  # An object library used through $<TARGET_OBJECTS> links nothing: this is for compiling only.
  target_link_libraries(${t} PRIVATE OpenMP::OpenMP_CXX Threads::Threads nlohmann_json::nlohmann_json
                                     ${INDEXCP_CUDART})
  target_sources(indexcp PRIVATE $<TARGET_OBJECTS:${t}>)
endfunction()

# indexcp_use_layer(<target> <layer>): a target of its own (indexcp_bench, indexcp_cli) compiles
# with the include path of folder <layer>.
function(indexcp_use_layer target layer)
  target_include_directories(${target} PRIVATE ${INDEXCP_LAYER_DIR}/${layer})
endfunction()
