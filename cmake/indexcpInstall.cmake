# Install rules of indexcp (included by the top-level CMakeLists.txt when INDEXCP_INSTALL is on):
#   include/indexcp/*.hpp          the public headers, with the generated indexcp/version.hpp
#   lib/libindexcp.a (or .so)      the library
#   lib/cmake/indexcp/             indexcpConfig.cmake, indexcpConfigVersion.cmake and the
#                                  exported target indexcp::indexcp (indexcpTargets*.cmake)
# so that another project finds it with find_package(indexcp 0.2) and links indexcp::indexcp.
include(CMakePackageConfigHelpers)

set(INDEXCP_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/indexcp" CACHE STRING
    "Where the CMake package of indexcp is installed (relative to the prefix)")
mark_as_advanced(INDEXCP_INSTALL_CMAKEDIR)

install(TARGETS indexcp EXPORT indexcpTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/indexcp DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.hpp")
install(FILES ${INDEXCP_GENERATED_INCLUDE_DIR}/indexcp/version.hpp
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/indexcp)
install(EXPORT indexcpTargets NAMESPACE indexcp:: FILE indexcpTargets.cmake
        DESTINATION ${INDEXCP_INSTALL_CMAKEDIR})

# Values the config file needs (cmake/indexcpConfig.cmake.in).
get_target_property(_indexcp_type indexcp TYPE)
if(_indexcp_type STREQUAL "SHARED_LIBRARY")
  set(indexcp_config_shared TRUE)
else()
  set(indexcp_config_shared FALSE)
endif()
set(indexcp_config_cuda_root "")
if(INDEXCP_WITH_CUDA)
  # the toolkit the library was compiled with (CUDAToolkit_BIN_DIR is <root>/bin)
  get_filename_component(indexcp_config_cuda_root "${CUDAToolkit_BIN_DIR}" DIRECTORY)
endif()
set(indexcp_config_nccl_dir "")
if(INDEXCP_WITH_NCCL)
  get_filename_component(indexcp_config_nccl_dir "${INDEXCP_NCCL_LIBRARY}" DIRECTORY)
endif()

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/indexcpConfig.cmake.in
  ${PROJECT_BINARY_DIR}/indexcpConfig.cmake
  INSTALL_DESTINATION ${INDEXCP_INSTALL_CMAKEDIR})
# Compatibility: the same major version; while the major version is 0 the minor version is the
# compatibility level (0.2.x accepts a request for 0.2 or 0.2.y <= 0.2.x; not 0.1, not 0.3).
if(PROJECT_VERSION_MAJOR EQUAL 0)
  set(_indexcp_compat SameMinorVersion)
else()
  set(_indexcp_compat SameMajorVersion)
endif()
write_basic_package_version_file(${PROJECT_BINARY_DIR}/indexcpConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY ${_indexcp_compat})
install(FILES ${PROJECT_BINARY_DIR}/indexcpConfig.cmake ${PROJECT_BINARY_DIR}/indexcpConfigVersion.cmake
        DESTINATION ${INDEXCP_INSTALL_CMAKEDIR})
unset(_indexcp_type)
unset(_indexcp_compat)
