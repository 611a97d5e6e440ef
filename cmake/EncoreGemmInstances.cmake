# encore_gemm_instances(<out_var>): generates the CUDA GEMM-epilogue instantiations from the
# catalogue include/encore/gemm_epilogues.def into <build>/generated/gemm: one translation unit per
# (epilogue, tile) row entry, sm90_<name>_<tile>.cu defining cuda::launch_gemm_<name>_<tile>, and
# gemm_launchers.cpp, the table behind cuda::gemm_launcher(). Files are rewritten only when their
# text changes. Sets <out_var> to the generated sources.
function(encore_gemm_instances out_var)
  set(def "${PROJECT_SOURCE_DIR}/include/encore/gemm_epilogues.def")
  set(dir "${PROJECT_BINARY_DIR}/generated/gemm")
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${def}")
  file(STRINGS "${def}" rows REGEX "^ENCORE_GEMM_EPILOGUE\\(")
  # tile flag -> (suffix, sm90 config, GemmTile)
  set(kTileCoop256 "coop256;Cooperative128x256;kCooperative128x256")
  set(kTilePp128 "pp128;Pingpong128x128;kPingpong128x128")
  set(kTilePp64 "pp64;Pingpong64x256;kPingpong64x256")
  set(sources)
  set(decls "")
  set(entries "")
  foreach(row IN LISTS rows)
    if(NOT row MATCHES "^ENCORE_GEMM_EPILOGUE\\(([A-Za-z0-9]+), *([a-z0-9_]+), *([^,]+), *([^,)]+)\\)")
      message(FATAL_ERROR "gemm_epilogues.def: cannot parse row '${row}' (one row per line: Name, name, operands, tiles)")
    endif()
    set(Name "${CMAKE_MATCH_1}")
    set(name "${CMAKE_MATCH_2}")
    string(REGEX MATCHALL "kTile[A-Za-z0-9]+" tiles "${CMAKE_MATCH_4}")
    if(NOT tiles)
      message(FATAL_ERROR "gemm_epilogues.def: row ${Name} names no tile (kTileNone for a CPU-only row)")
    endif()
    list(REMOVE_ITEM tiles kTileNone)  # a row with the CPU reference only: no translation unit
    foreach(tile IN LISTS tiles)
      if(NOT DEFINED ${tile})
        message(FATAL_ERROR "gemm_epilogues.def: row ${Name}: unknown tile ${tile}")
      endif()
      list(GET ${tile} 0 suffix)
      list(GET ${tile} 1 config)
      list(GET ${tile} 2 gemm_tile)
      set(fn "launch_gemm_${name}_${suffix}")
      set(tu "${dir}/sm90_${name}_${suffix}.cu")
      file(CONFIGURE OUTPUT "${tu}" CONTENT
"// Generated from include/encore/gemm_epilogues.def by cmake/EncoreGemmInstances.cmake: do not edit.
// The ${name} epilogue (program sm90::${Name}) on the ${config} tile.
#include \"gemm/cuda/sm90_gemm.cuh\"

namespace encore::cuda {

Status ${fn}(const GemmProblem& p, Stream stream);  // listed in gemm_launchers.cpp

Status ${fn}(const GemmProblem& p, Stream stream) {
  return sm90::launch_program<sm90::${Name}, sm90::${config}>(p, stream, \"gemm_${name}\");
}

}  // namespace encore::cuda
")
      list(APPEND sources "${tu}")
      string(APPEND decls "Status ${fn}(const GemmProblem& p, Stream stream);\n")
      string(APPEND entries "      {Epilogue::k${Name}, GemmTile::${gemm_tile}, &${fn}},\n")
    endforeach()
  endforeach()
  file(CONFIGURE OUTPUT "${dir}/gemm_launchers.cpp" CONTENT
"// Generated from include/encore/gemm_epilogues.def by cmake/EncoreGemmInstances.cmake: do not edit.
// The (epilogue, tile) launchers the build instantiates, for cuda::gemm_launcher.
#include \"gemm/cuda/launch.hpp\"

namespace encore::cuda {

${decls}
GemmLauncher gemm_launcher(Epilogue e, GemmTile tile) {
  struct Entry {
    Epilogue e;
    GemmTile tile;
    GemmLauncher launch;
  };
  static constexpr Entry kTable[] = {
${entries}  };
  for (const Entry& x : kTable)
    if (x.e == e && x.tile == tile) return x.launch;
  return nullptr;
}

}  // namespace encore::cuda
")
  list(APPEND sources "${dir}/gemm_launchers.cpp")
  set(${out_var} ${sources} PARENT_SCOPE)
endfunction()
