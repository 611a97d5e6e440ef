# Locates the CUTLASS 4.2 C++ headers shipped by the nvidia-cutlass==4.2.0.0 Python package
# (cutlass_library/source/{include,tools/util/include}) and exposes them as the INTERFACE target
# encore_cutlass (SYSTEM includes). Override with -DENCORE_CUTLASS_DIR=<.../cutlass_library/source>.
set(ENCORE_CUTLASS_REQUIRED_VERSION "4.2.0")

if(NOT ENCORE_CUTLASS_DIR)
  set(_cand "${PROJECT_SOURCE_DIR}/.deps/cutlass/cutlass_library/source")
  if(EXISTS "${_cand}/include/cutlass/version.h")
    set(_found "${_cand}")
  else()
    find_package(Python3 COMPONENTS Interpreter QUIET)
    if(Python3_Interpreter_FOUND)
      execute_process(
        COMMAND ${Python3_EXECUTABLE} -c "import cutlass_library, pathlib; print(pathlib.Path(cutlass_library.__file__).parent / 'source')"
        OUTPUT_VARIABLE _found OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    endif()
  endif()
  set(ENCORE_CUTLASS_DIR "${_found}" CACHE PATH "CUTLASS source root (cutlass_library/source of nvidia-cutlass==4.2.0.0)")
endif()

set(_ver_h "${ENCORE_CUTLASS_DIR}/include/cutlass/version.h")
if(NOT EXISTS "${_ver_h}")
  message(FATAL_ERROR "CUTLASS headers not found (looked for ${_ver_h}). Run scripts/install_deps.sh, "
                      "or pass -DENCORE_CUTLASS_DIR=<site-packages>/cutlass_library/source of nvidia-cutlass==4.2.0.0, "
                      "or build the CPU backend only: -DENCORE_CUDA=OFF (pip: -Ccmake.define.ENCORE_CUDA=OFF).")
endif()
file(STRINGS "${_ver_h}" _lines REGEX "#define CUTLASS_(MAJOR|MINOR|PATCH) [0-9]+")
foreach(_l IN LISTS _lines)
  if(_l MATCHES "CUTLASS_(MAJOR|MINOR|PATCH) ([0-9]+)")
    set(_cutlass_${CMAKE_MATCH_1} ${CMAKE_MATCH_2})
  endif()
endforeach()
set(ENCORE_CUTLASS_VERSION "${_cutlass_MAJOR}.${_cutlass_MINOR}.${_cutlass_PATCH}")
if(NOT ENCORE_CUTLASS_VERSION VERSION_EQUAL ENCORE_CUTLASS_REQUIRED_VERSION)
  message(FATAL_ERROR "CUTLASS ${ENCORE_CUTLASS_VERSION} found at ${ENCORE_CUTLASS_DIR}; encore pins ${ENCORE_CUTLASS_REQUIRED_VERSION}")
endif()
message(STATUS "encore: CUTLASS ${ENCORE_CUTLASS_VERSION} at ${ENCORE_CUTLASS_DIR}")

add_library(encore_cutlass INTERFACE)
target_include_directories(encore_cutlass SYSTEM INTERFACE
  "${ENCORE_CUTLASS_DIR}/include" "${ENCORE_CUTLASS_DIR}/tools/util/include")
