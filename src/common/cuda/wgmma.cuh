// Hopper warpgroup tensor-core products (wgmma, sm_90a) with both bf16 operands in shared memory in
// the 128-byte swizzled layout, fp32 accumulators in registers, for kernels that compute 64-row
// tiles per warpgroup (4 warps, 128 threads); and stmatrix, which stores accumulator fragments
// (as bf16) into such tiles.
//
// Operand layout (128-byte swizzle): rows of 64 bf16 (128 bytes), the 16-byte piece p of row r stored
// at piece p ^ (r % 8), the tile 1024-byte aligned; wider matrices as several such tiles side by side.
//   - K-major (A [64][K] or Bᵀ [N][K], K along the row): a k-step of 16 is 32 bytes further along
//     the row; descriptor stride between 8-row groups 1024 bytes.
//   - MN-major A (tnspA: A [M = 64][K] stored as [K rows][64]): a k-step is 16 rows (2048 bytes).
//
// Accumulator fragment of a warpgroup's 64 x N tile: warp w (of 4), lane 4 g + t holds d[j][q] at
// row 16 w + g + 8 (q / 2), column 8 j + 2 t + q % 2 (the mma.sync m16n8 layout, per warp).
// Order (PTX ISA, wgmma): wgmma_fence() before the first product of a batch whenever the
// accumulators were touched by other instructions; shared memory written by ordinary stores or
// stmatrix needs fence.proxy.async (bulk_copy.cuh: fence_proxy_async_shared) by the writers, then a
// barrier, before a product reads it; wgmma_commit() then wgmma_wait<0>() before the accumulators
// are read or the operands are overwritten.
#pragma once
#include <cstdint>

#include "common/cuda/bulk_copy.cuh"

namespace encore::cuda {

// Descriptor of a 128-byte swizzled operand starting at `p` (a 1024-byte aligned tile, plus 32-byte
// k-steps for K-major operands): start address, leading byte offset, stride byte offset (both in
// 16-byte units), swizzle mode 1 (128 bytes) in bits 62-63. The stride between 8-row groups is 1024
// bytes in both majors. The leading offset is unused by K-major operands (1, as CUTLASS sets it); an
// MN-major operand gets 1024 bytes there too, its K-group stride in either reading of the two
// fields (its M extent is one 64-wide atom, so the other field is unused).
__device__ __forceinline__ uint64_t wgmma_desc_sw128(const void* p, bool mn_major = false) {
  const uint64_t lbo = mn_major ? 1024 >> 4 : 1;
  return uint64_t((smem_addr(p) & 0x3FFFF) >> 4) | (lbo << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// The descriptor of the operand `bytes` further on (a multiple of 16) from the one `d` describes:
// the start-address field (bits 0-13, address / 16) moves, the rest stays; both addresses lie in
// shared memory (< 256 KB), so the field cannot overflow. Lets a kernel build one descriptor per tile
// and step its k-steps by constant offsets instead of rebuilding each descriptor.
__device__ __forceinline__ uint64_t wgmma_desc_advance(uint64_t d, int bytes) { return d + uint64_t(bytes >> 4); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// d (64 x N, this thread's fragment) = A (64 x 16, descriptor a; MN-major when kTransA) · B (16 x N,
// descriptor b of Bᵀ, K-major) + (accumulate ? d : 0). N = 16, 32 or 64.
template <int N, int kTransA>
__device__ __forceinline__ void wgmma_bf16(float (&d)[N / 8][4], uint64_t a, uint64_t b, int accumulate);

template <int kTransA>
__device__ __forceinline__ void wgmma_bf16_16(float (&d)[2][4], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, %11, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3])
      : "l"(a), "l"(b), "r"(accumulate), "n"(kTransA));
}

template <int kTransA>
__device__ __forceinline__ void wgmma_bf16_32(float (&d)[4][4], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, "
      "%15}, %16, %17, p, 1, 1, %19, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
      : "l"(a), "l"(b), "r"(accumulate), "n"(kTransA));
}

template <int kTransA>
__device__ __forceinline__ void wgmma_bf16_64(float (&d)[8][4], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, "
      "%15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %35, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(a), "l"(b), "r"(accumulate), "n"(kTransA));
}

template <int N, int kTransA>
__device__ __forceinline__ void wgmma_bf16(float (&d)[N / 8][4], uint64_t a, uint64_t b, int accumulate) {
  static_assert(N == 16 || N == 32 || N == 64, "N = 16, 32 or 64");
  if constexpr (N == 16) wgmma_bf16_16<kTransA>(d, a, b, accumulate);
  else if constexpr (N == 32) wgmma_bf16_32<kTransA>(d, a, b, accumulate);
  else wgmma_bf16_64<kTransA>(d, a, b, accumulate);
}

// Four 8 x 8 bf16 matrices stored transposed: register r_i of lane 4 g + t holds row g, columns 2t
// and 2t + 1 of matrix i (an accumulator fragment's layout, packed by pack_bf16); lane 8 i + r gives
// the address of row r of stored matrix i (= column r of matrix i), 16 bytes.
__device__ __forceinline__ void stmatrix_x4_trans(const void* row, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr(row)), "r"(r0), "r"(r1), "r"(r2),
               "r"(r3)
               : "memory");
}

}  // namespace encore::cuda
