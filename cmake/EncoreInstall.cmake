# cmake --install rules for the C++ library: public headers (include/encore), the static libraries
# (encore, encore_core, encore_reference and, in CUDA builds, encore_kernels_<family>), the CLI, and
# an exported target set with encoreConfig.cmake so consumers write find_package(encore CONFIG) and
# link encore::encore. Skipped in wheel builds (SKBUILD): the wheel carries only the Python package.
if(SKBUILD)
  return()
endif()

include(GNUInstallDirs)
include(CMakePackageConfigHelpers)
set(ENCORE_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/encore" CACHE STRING
    "Where encoreConfig.cmake goes, relative to the install prefix")

install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/encore" DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}"
        FILES_MATCHING PATTERN "*.hpp" PATTERN "*.def")  # *.def: catalogues the headers include

set(_encore_install_targets encore encore_core encore_reference)
if(ENCORE_CUDA)
  list(APPEND _encore_install_targets ${_encore_kernels})  # encore_kernels_<family> (and moe_sm90)
endif()
install(TARGETS ${_encore_install_targets} EXPORT encoreTargets
        ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}")
if(TARGET encore_cli)
  install(TARGETS encore_cli RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}")
endif()

install(EXPORT encoreTargets NAMESPACE encore:: FILE encoreTargets.cmake
        DESTINATION "${ENCORE_INSTALL_CMAKEDIR}")
configure_package_config_file("${PROJECT_SOURCE_DIR}/cmake/encoreConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/encoreConfig.cmake" INSTALL_DESTINATION "${ENCORE_INSTALL_CMAKEDIR}")
# 0.x: only the same minor version is compatible.
write_basic_package_version_file("${PROJECT_BINARY_DIR}/encoreConfigVersion.cmake"
  VERSION "${PROJECT_VERSION}" COMPATIBILITY SameMinorVersion)
install(FILES "${PROJECT_BINARY_DIR}/encoreConfig.cmake" "${PROJECT_BINARY_DIR}/encoreConfigVersion.cmake"
        DESTINATION "${ENCORE_INSTALL_CMAKEDIR}")
