// Device-wide barrier for cooperative launches (all blocks co-resident, checked on the host).
//
// State: {arrived, generation} in global memory; `arrived` must be 0 before the first use and the
// barrier returns it to 0 each time, so one zero-initialized state serves any number of launches
// (of one kernel at a time). Block leaders read the generation, arrive with an atomic add; the last
// to arrive resets `arrived` and bumps the generation (release); the others spin on the generation
// with acquire loads. __syncthreads() on both sides makes it a barrier for every thread.
#pragma once
#include <cstdint>

namespace encore::cuda {

struct GridBarrierState {
  unsigned int arrived;
  unsigned int generation;
};

__device__ __forceinline__ unsigned int load_acquire_gpu(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned long long load_acquire_gpu(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void store_release_gpu(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void grid_barrier(GridBarrierState* state) {
  __syncthreads();
  if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) {
    const unsigned int blocks = gridDim.x * gridDim.y * gridDim.z;
    const unsigned int gen = load_acquire_gpu(&state->generation);
    __threadfence();  // this block's writes before its arrival
    if (atomicAdd(&state->arrived, 1u) == blocks - 1) {
      atomicExch(&state->arrived, 0u);
      __threadfence();
      atomicAdd(&state->generation, 1u);
    } else {
      while (load_acquire_gpu(&state->generation) == gen) __nanosleep(20);
    }
    __threadfence();
  }
  __syncthreads();
}

}  // namespace encore::cuda
