// silu(g) * u = g / (1 + e^-g) * u in fp32 as the CPU reference writes it; every SwiGLU of the moe
// family's CUDA paths (the grouped GEMMs' epilogue and row kernel, the decode GEMV) calls this one
// function. Each step rounds on its own (__fadd_rn / __fdiv_rn / __fmul_rn: nothing is contracted into
// an fma with expf's last multiply, whatever code surrounds it), so the paths agree bit for bit on the
// same fp32 inputs.
#pragma once

namespace encore::cuda {

__device__ __forceinline__ float silu_mul(float g, float u) { return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u); }

}  // namespace encore::cuda
