// The intra-chunk terms of the KDA backward's kernel 3b (kda_bwd_grads_tc.cu), per channel a, with
// E_ij = 2^(G_i - G_j) (G: the chunk-local cumulative log2 decay, non-increasing along the rows):
//   dqi_i = sum_{j <= i} dAqk_ij K_j E_ij        dkr_i = sum_{j < i} dL_ij K_j E_ij
//   dkc_i = sum_{m >= i} (dAqk_mi Q~_m + dL_mi beta_m K_m) E_mi
// Two forms over the same shared tiles (host-callable, so tests/kda/test_kda_bwd_intra_cpu.cpp checks one
// against the other on the CPU):
// - intra_exact: one element (i, a), one exp2 per pair (the direct evaluation, for the test).
// - intra_factored: the 16 rows i of sub-block I = i / 16 for one channel, fla's factorization: with n
//   the sub-block's first row and r its last valid one, E_ij = 2^(G_i - G_n) 2^(G_n - G_j) for j < n and
//   E_mi = 2^(G_m - G_r) 2^(G_r - G_i) for m > r, every factor <= 1 (G non-increasing), so nothing
//   overflows where the exact form does not; each 2^(G_n - G_j) and 2^(G_m - G_r) serves 16 rows, and
//   the diagonal sub-block stays exact. ~2.6x fewer exp2 and, per pair, one broadcast load of dAqk / dL
//   instead of the K, G loads of every row.
// Tiles: G, Kt, Q [64][K] (row stride K), D = dAqk (lower triangle incl. the diagonal), M = dL (strict
// lower), Dt, Mt their transposes [64][64], beta [64]; rows >= `rows` zero in D, M.
#pragma once
#include <cmath>

#include "core/host_device.hpp"

namespace encore::cuda::kdabwd {

struct IntraTiles {
  const float *G, *Kt, *Q, *D, *M, *Dt, *Mt, *beta;
  int K, rows;
};

ENCORE_HOST_DEVICE inline void intra_exact(const IntraTiles& s, int i, int a, float& dqi, float& dkr, float& dkc) {
  const int K = s.K;
  const float gi = s.G[i * K + a];
  dqi = dkr = dkc = 0.f;
  for (int j = 0; j <= i; ++j) {
    const float kx = s.Kt[j * K + a] * exp2f(gi - s.G[j * K + a]);
    dqi += s.D[i * 64 + j] * kx;
    dkr += s.M[i * 64 + j] * kx;
  }
  for (int m = i; m < s.rows; ++m)
    dkc += (s.Dt[i * 64 + m] * s.Q[m * K + a] + s.Mt[i * 64 + m] * s.beta[m] * s.Kt[m * K + a]) * exp2f(s.G[m * K + a] - gi);
}

// x[0..15] = p[0..15] (p 16-byte aligned: four 128-bit loads on the device).
ENCORE_HOST_DEVICE inline void load16(const float* p, float (&x)[16]) {
#ifdef __CUDA_ARCH__
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float4 v = reinterpret_cast<const float4*>(p)[q];
    x[4 * q] = v.x, x[4 * q + 1] = v.y, x[4 * q + 2] = v.z, x[4 * q + 3] = v.w;
  }
#else
  for (int u = 0; u < 16; ++u) x[u] = p[u];
#endif
}

// Rows 16 I + u (u < 16, those < rows) of channel a; the Dt, Mt, D, M rows must be 16-byte aligned.
ENCORE_HOST_DEVICE inline void intra_factored(const IntraTiles& s, int I, int a, float (&dqi)[16], float (&dkr)[16], float (&dkc)[16]) {
  const int K = s.K, rows = s.rows, n = 16 * I;
#pragma unroll
  for (int u = 0; u < 16; ++u) dqi[u] = dkr[u] = dkc[u] = 0.f;
  if (n >= rows) return;
  const int r = (n + 15 < rows ? n + 15 : rows - 1);  // the sub-block's last valid row
  const float gn = s.G[n * K + a], gr = s.G[r * K + a];
  float x[16], y[16];
  // Rows: the earlier sub-blocks j < n through the reference n, then the factor 2^(G_i - G_n).
  for (int j = 0; j < n; ++j) {
    const float kx = s.Kt[j * K + a] * exp2f(gn - s.G[j * K + a]);
    load16(s.Dt + j * 64 + n, x);  // dAqk[n + u][j]
    load16(s.Mt + j * 64 + n, y);  // dL[n + u][j]
#pragma unroll
    for (int u = 0; u < 16; ++u) {
      dqi[u] += x[u] * kx;
      dkr[u] += y[u] * kx;
    }
  }
#pragma unroll
  for (int u = 0; u < 16; ++u) {
    const int i = n + u;
    if (i > r) continue;
    const float gi = s.G[i * K + a], f = exp2f(gi - gn);
    dqi[u] *= f;
    dkr[u] *= f;
    for (int j = n; j <= i; ++j) {  // the diagonal sub-block, exact
      const float kx = s.Kt[j * K + a] * exp2f(gi - s.G[j * K + a]);
      dqi[u] += s.D[i * 64 + j] * kx;
      dkr[u] += s.M[i * 64 + j] * kx;
    }
  }
  // Columns: the later rows m > r through the reference r, then the factor 2^(G_r - G_i).
  for (int m = r + 1; m < rows; ++m) {
    const float e = exp2f(s.G[m * K + a] - gr), qm = s.Q[m * K + a] * e, km = s.beta[m] * s.Kt[m * K + a] * e;
    load16(s.D + m * 64 + n, x);  // dAqk[m][n + u]
    load16(s.M + m * 64 + n, y);  // dL[m][n + u]
#pragma unroll
    for (int u = 0; u < 16; ++u) dkc[u] += x[u] * qm + y[u] * km;
  }
#pragma unroll
  for (int u = 0; u < 16; ++u) {
    const int i = n + u;
    if (i > r) continue;
    const float gi = s.G[i * K + a];
    dkc[u] *= exp2f(gr - gi);
    for (int m = i; m <= r; ++m)  // the diagonal sub-block, exact
      dkc[u] += (s.D[m * 64 + i] * s.Q[m * K + a] + s.M[m * 64 + i] * s.beta[m] * s.Kt[m * K + a]) * exp2f(s.G[m * K + a] - gi);
  }
}

}  // namespace encore::cuda::kdabwd
