# encore_add_kernel_family(<family> <sources...>): a static CUDA library encore_kernels_<family>
# compiled for CMAKE_CUDA_ARCHITECTURES (90a by default), plus ENCORE_PORTABLE_ARCHS for the families in
# ENCORE_PORTABLE_FAMILIES, with the project's device flags.
function(encore_add_kernel_family family)
  set(target encore_kernels_${family})
  if(NOT ARGN)  # a family with no kernels yet (moe: CPU only): an empty interface library
    add_library(${target} INTERFACE)
    target_link_libraries(${target} INTERFACE encore_core)
    return()
  endif()
  add_library(${target} STATIC ${ARGN})
  target_link_libraries(${target} PUBLIC encore_core)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo>
    $<$<AND:$<COMPILE_LANGUAGE:CUDA>,$<BOOL:${ENCORE_PTXAS_VERBOSE}>>:-Xptxas=-v,--warn-on-spills>)
  set_target_properties(${target} PROPERTIES CUDA_SEPARABLE_COMPILATION OFF)
  if(ENCORE_PORTABLE_ARCHS AND family IN_LIST ENCORE_PORTABLE_FAMILIES)
    set_target_properties(${target} PROPERTIES CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES};${ENCORE_PORTABLE_ARCHS}")
  endif()
endfunction()
