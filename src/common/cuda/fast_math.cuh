// Hardware approximations of 2^x and 1/x (one MUFU instruction each, flush-to-zero), shared by the
// kernel families. exp2f compiles to the same MUFU.EX2 wrapped in a subnormal range fix-up (a
// compare and two predicated multiplies); these skip it, so results below 2^-126 are 0.
#pragma once

namespace encore::cuda {

constexpr float kLog2e = 1.4426950408889634f;

// 2^x (2^-inf = 0, 2^x = +inf for x >= 128).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// 1 / x.
__device__ __forceinline__ float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace encore::cuda
