// ENCORE_HOST_DEVICE: __host__ __device__ under nvcc, nothing otherwise, for the small functions
// the CPU reference and the CUDA kernels share (fp8_scale.hpp, fast_div.hpp).
#pragma once

#ifdef __CUDACC__
#define ENCORE_HOST_DEVICE __host__ __device__
#else
#define ENCORE_HOST_DEVICE
#endif
