// The KDA chunk kernel's building blocks (kda_chunk.cu is their one includer): its block size and
// shared-memory layout (ChunkSmem: the fp32 and bf16 tiles of one item, what aliases what as the
// steps free them, the raw TMA tiles), the work-item descriptor, the raw-tile TMA issue, the
// per-item scalars, and the small device helpers of its steps (forward substitution of a diagonal
// block, shared-memory pair loads and stores, the hi + lo operand stores and the W/U identity part).
#pragma once
#include "kda/cuda/kda_device.cuh"

namespace encore::cuda::kda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kLdF = kD + 2;  // fp32 [64][130] rows: 8-byte aligned channel pairs; a half-warp's pairs in
                              // 16 consecutive rows (column access) fall in distinct banks
constexpr int kLdS = kC + 4;  // fp32 [64][68] rows: 16-byte aligned, so rows are read 4 entries at a time

struct ChunkSmem {  // byte offsets in dynamic shared memory
  static constexpr int kQ = 0;                      // fp32 [64][130] q (unnormed: rn applies on read)
  static constexpr int kK = kQ + kC * kLdF * 4;     // fp32 [64][130] k (unnormed: rn applies on read)
  static constexpr int kG = kK + kC * kLdF * 4;     // fp32 [64][130] gate, then cumulative log2 gate G
  static constexpr int kKinv = kG + kC * kLdF * 4;  // bf16 [64][136] k ⊙ 2^(G_r − G)       | raw q tile of the next item (step 4 on)
  static constexpr int kQr = kKinv + kC * kLd * 2;  // bf16 [64][136] q ⊙ 2^(G − G_r)   | later bf16(β k ⊙ 2^G) raw_at [64][128]
  static constexpr int kKr = kQr + kC * kLd * 2;    // bf16 [64][136] k ⊙ 2^(G − G_r)   | later A bf16 [64][72] at kAbf
  static constexpr int kAbf = kQr + kD * kLdC * 2;
  static constexpr int kKref = kKr + kC * kLd * 2;  // bf16 [96][136] k_j ⊙ 2^(G_16s − G_j), s = 1, 2, 3 | later bf16(β v) raw_at [64][128]
  static constexpr int kL = kKref + 96 * kLd * 2;   // fp32 [64][68] L                        | raw k tile (step 5 on)
  static constexpr int kAq = kL + kC * kLdS * 4;    // fp32 [64][68] Aqk                      | raw gate tile (step 5 on)
  static constexpr int kAs = kAq + kC * kLdS * 4;   // fp32 [64][68] A = (I + L)^-1           | raw v tile (step 5 on)
  static constexpr int kT = kAs + kC * kLdS * 4;    // fp32 [128] dt_bias of the head
  static constexpr int kBeta = kT + kD * 4;         // fp32 [64]
  static constexpr int kRn = kBeta + kC * 4;        // fp32 [2][64] L2-norm factors of q and k (1 without the norm)
  static constexpr int kSafe = kRn + 2 * kC * 4;    // int [4]: decay span of diagonal block s (float bits)
  static constexpr int kItem = kSafe + 16;          // int [2][8]: descriptors of this item and the next (ChunkItem)
  static constexpr int kInBar = kItem + 64;        // uint64: the raw input tiles' barrier
  static constexpr int kInvBar = kInBar + 8;       // uint64: step 4's level-1 inverse blocks (64 arrivals a phase)
  static constexpr int kBytes = kInBar + 16;
  // The raw input tiles (TMA destinations): the first 1024-byte aligned offsets of kinv, L, Aqk, A.
  static constexpr int kRawQ = (kKinv + 1023) / 1024 * 1024, kRawK = (kL + 1023) / 1024 * 1024;
  static constexpr int kRawG = (kAq + 1023) / 1024 * 1024, kRawV = (kAs + 1023) / 1024 * 1024;
  // Step 1's sums of squares of q and k over each row's 8-channel groups, fp32 [2][16][64] (the L2
  // norm; over qr, written from step 2 on).
  static constexpr int kPart = kQr;
  // Step 5's staging of the record's W and U, over k and G (read for the last time in step 4).
  static constexpr int kWStage = kK;
  static constexpr int kUStage = kWStage + int(WsLayout::kKg - WsLayout::kW);
};
static_assert(ChunkSmem::kKinv % 16 == 0 && ChunkSmem::kQr % 16 == 0 && ChunkSmem::kAbf % 16 == 0 && ChunkSmem::kKref % 16 == 0,
              "aligned bf16 tiles");
static_assert(kWarps == 16, "steps 1, 3, 4 and 6 map 16 warps");
static_assert(ChunkSmem::kBytes <= 227 * 1024, "fits the opt-in shared memory of an sm_90 block");
static_assert(ChunkSmem::kAbf + kC * kLdC * 2 <= ChunkSmem::kKref && 96 * kLd >= kD * kLdC, "aliased tiles fit");
static_assert(ChunkSmem::kUStage % 16 == 0 && ChunkSmem::kUStage + (WsLayout::kBytes - WsLayout::kU) <= ChunkSmem::kKinv,
              "W and U stage over k and G");
static_assert(2 * kRawTileBytes <= kC * kLdF * 4, "step 4's two lo tiles fit over q");
static_assert(ChunkSmem::kT % 16 == 0, "dt_bias read 4 entries at a time");
static_assert(ChunkSmem::kPart % 16 == 0 && ChunkSmem::kPart + 2 * 16 * kC * 4 <= ChunkSmem::kL, "step 1's partial sums fit over qr");
static_assert(ChunkSmem::kL % 16 == 0 && ChunkSmem::kAq % 16 == 0 && ChunkSmem::kAs % 16 == 0 &&
                  ChunkSmem::kRawQ + kRawTileBytes <= ChunkSmem::kQr && ChunkSmem::kRawK + kRawTileBytes <= ChunkSmem::kAq &&
                  ChunkSmem::kRawG + kRawTileBytes <= ChunkSmem::kAs && ChunkSmem::kRawV + kRawTileBytes <= ChunkSmem::kT,
              "raw input tiles fit the tiles they alias, from their first 1024-byte aligned offset");
constexpr float kMaxDiagSpan = 100.f;  // log2 bound of 2^(G_r − G_j) inside a diagonal block

// Row offset of reference s's block of k rows inside kref: s = 1 -> 0, 2 -> 16, 3 -> 48.
__device__ __forceinline__ int kref_row(int s) { return 8 * s * (s - 1); }

// One work item: the chunk in slot `slot` of head h (item = h · slots + slot). Found once per item,
// one item ahead, by one thread of the lightly loaded warps of step 3 (a search over <= 1024
// sequences and a division: ~10 dependent constant-memory loads, which every thread used to repeat
// twice per item), and kept in shared memory (ChunkSmem::kItem, two buffers by item parity) rather
// than in registers: the kernel sits at the 128-register limit of a 512-thread block.
struct ChunkItem {
  int slot, h, b, t0, rows, hq;  // hq: the q/k head of value head h (h / group)
  template <class P>
  __device__ ChunkItem(const P& p, int item) {
    const int slots = p.chunk_start[p.N];
    slot = item % slots;
    h = item / slots;
    hq = h / p.group;
    const int n = find_seq(p, slot);
    b = p.varlen ? 0 : n;
    t0 = p.seq_begin[n] + (slot - p.chunk_start[n]) * kC;
    rows = min(kC, p.seq_end[n] - t0);
  }
  __device__ explicit ChunkItem(const int* d) : slot(d[0]), h(d[1]), b(d[2]), t0(d[3]), rows(d[4]), hq(d[5]) {}
  __device__ void put(int* d) const {
    d[0] = slot, d[1] = h, d[2] = b, d[3] = t0, d[4] = rows, d[5] = hq;
  }
};

// Input t of the chunk (0 q, 1 k, 2 gate, 3 v), its channel count, and the tile its raw copy lands in
// (free from step 4 or 5 of the previous item to step 1).
template <class P>
__device__ __forceinline__ const KdaTensor& input(const P& p, int t) { return t == 0 ? p.q : t == 1 ? p.k : t == 2 ? p.g : p.v; }
template <class P>
__device__ __forceinline__ int channels(const P& p, int t) { return t == 3 ? p.V : p.K; }
template <class P>
__device__ __forceinline__ int raw_boxes(const P& p, int t) { return (channels(p, t) + 63) / 64; }  // TMA boxes of 64 channels
// Each lands at the first 1024-byte aligned offset of its region (the TMA boxes' 128-byte swizzle is
// a function of the address; the kernel checks that shared memory starts 1024-byte aligned).
__device__ __forceinline__ __nv_bfloat16* raw_tile(unsigned char* smem, int t) {
  return reinterpret_cast<__nv_bfloat16*>(smem + (t == 0 ? ChunkSmem::kRawQ : t == 1 ? ChunkSmem::kRawK : t == 2 ? ChunkSmem::kRawG : ChunkSmem::kRawV));
}

// An item's raw input tiles (bit t of `fast`: input t arrives by TMA), issued by thread 0 in up to
// three groups as their tiles fall free (mask: the inputs of this group): 64 tokens from the chunk's
// first (whatever lies past its last row is never read; tokens past T and channels past C arrive as
// zeros), all completing on `bar`, which the item's first group (`arm`) arms with every byte.
template <class P>
__device__ __forceinline__ void issue_raw(const P& p, const ChunkItem& it, unsigned char* smem, int fast, int mask, bool arm,
                                          int tid, uint64_t* bar) {
  if (tid != 0 || !fast) return;
  if (arm) {
    unsigned bytes = 0;
#pragma unroll
    for (int t = 0; t < 4; ++t)
      if (fast >> t & 1) bytes += raw_boxes(p, t) * kRawBoxBytes;
    mbar_expect(bar, bytes);
  }
  if (!(fast & mask)) return;
  fence_proxy_async_shared();  // the tiles' earlier generic accesses (ordered here by the last barrier) before the TMA writes
#pragma unroll
  for (int t = 0; t < 4; ++t)
    if ((fast & mask) >> t & 1)
      for (int box = 0; box < raw_boxes(p, t); ++box)
        tma_load_4d(raw_tile(smem, t) + box * (kC * 64), p.tmap[t], 64 * box, t < 2 ? it.hq : it.h, it.t0, it.b, bar);
}

// An item's scalars, loaded one step ahead into registers: this thread's β (row tid), dt_bias
// (channel tid) and A_log of the head.
struct ItemScalars {
  float beta, dtb, a_log;
};
template <class P>
__device__ __forceinline__ ItemScalars load_scalars(const P& p, const ChunkItem& it, int tid) {
  ItemScalars s;
  s.beta = tid < it.rows ? load(p.beta, it.b, it.t0 + tid, it.h, 0) : 0.f;
  s.dtb = p.gate_in_kernel && p.dt_bias && tid < p.K ? p.dt_bias[it.h * p.K + tid] : 0.f;
  s.a_log = p.gate_in_kernel && p.A_log ? p.A_log[it.h] : 0.f;
  return s;
}

// Σ x_e² over 8 values, in two chains (a fixed order: the L2-norm factors are deterministic).
__device__ __forceinline__ float sum_squares8(const float (&x)[8]) {
  float a = x[0] * x[0], b = x[1] * x[1];
#pragma unroll
  for (int e = 2; e < 8; e += 2) {
    a = fmaf(x[e], x[e], a);
    b = fmaf(x[e + 1], x[e + 1], b);
  }
  return a + b;
}

__device__ __forceinline__ float4 ld4(const float* a) { return *reinterpret_cast<const float4*>(a); }

// The diagonal block A_oo = (I + L_oo)^-1 of A = (I + L)^-1 by forward substitution: lane j < 16
// takes column j, X_ij = δ_ij − Σ_{j<=m<i} L_im X_mj, X in registers ([64][68] fp32 tiles, o = 16 s).
__device__ __forceinline__ void forward_substitution(const float* Ls, float* As, int o, int lane) {
  if (lane >= 16) return;
  const int j = lane;
  float x[16];  // column j of the block; x[m] = 0 for m < j, so the sums may start at m = 0
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float* Lrow = Ls + (o + i) * kLdS + o;  // 16-byte aligned
    float Lr[16];
#pragma unroll
    for (int q = 0; q < 4; ++q)
      if (4 * q < i) {
        const float4 v = ld4(Lrow + 4 * q);
        Lr[4 * q] = v.x, Lr[4 * q + 1] = v.y, Lr[4 * q + 2] = v.z, Lr[4 * q + 3] = v.w;
      }
    float s0 = i == j ? 1.f : 0.f, s1 = 0.f;  // two chains
#pragma unroll
    for (int m = 0; m < i; m += 2) {
      s0 -= Lr[m] * x[m];
      if (m + 1 < i) s1 -= Lr[m + 1] * x[m + 1];
    }
    x[i] = j <= i ? s0 + s1 : 0.f;
  }
#pragma unroll
  for (int i = 0; i < 16; ++i) As[(o + i) * kLdS + o + j] = x[i];
}

// fp32 channel pairs (8-byte aligned) and bf16 pairs (4-byte aligned) in shared or global memory.
__device__ __forceinline__ float2 ld2(const float* a) { return *reinterpret_cast<const float2*>(a); }
__device__ __forceinline__ void st2(float* a, float x, float y) { *reinterpret_cast<float2*>(a) = make_float2(x, y); }
__device__ __forceinline__ void st_u32(__nv_bfloat16* a, uint32_t v) { *reinterpret_cast<uint32_t*>(a) = v; }
__device__ __forceinline__ float2 scale2(float2 v, float f) { return make_float2(v.x * f, v.y * f); }

// Eight bf16 values (rounded from fp32) as one 16-byte shared store.
__device__ __forceinline__ void store8_bf16(__nv_bfloat16* dst, const float (&x)[8]) {
  *reinterpret_cast<uint4*>(dst) = make_uint4(pack_bf16(x[0], x[1]), pack_bf16(x[2], x[3]), pack_bf16(x[4], x[5]), pack_bf16(x[6], x[7]));
}

// Eight values x of row i, channels c0..c0+7, as bf16 hi + lo, each into a raw_at-layout [64][128]
// tile (hi: the W/U products' B operand, lo: their identity part): one 16-byte store each.
__device__ __forceinline__ void store_hi_lo(const float (&x)[8], __nv_bfloat16* hi, __nv_bfloat16* lo, int i, int c0) {
  float r[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) r[e] = x[e] - __bfloat162float(__float2bfloat16(x[e]));
  store8_bf16(hi + raw_at(i, c0), x);
  store8_bf16(lo + raw_at(i, c0), r);
}

// B fragments of two adjacent n-tiles for 16 rows k of a raw_at-layout [64][128] bf16 tile stored
// [k][n] (ldmatrix.trans): b0 = the first n-tile, b1 = the next. `at` is this lane's row address,
// x + raw_b_lane(n0) + 64 k0 for n-tiles n0/8, n0/8 + 1 and rows k0..k0+15 (k0 a multiple of 8 keeps
// the swizzle term, so a thread finds its column offsets once).
__device__ __forceinline__ int raw_b_lane(int n0) {
  const int lane = threadIdx.x & 31, m = lane >> 3, r = lane & 7;
  return raw_at(r + 8 * (m & 1), n0 + 8 * (m >> 1));  // (k 0, n 0) (k 8, n 0) (k 0, n 8) (k 8, n 8)
}
__device__ __forceinline__ void raw_b_frags(const __nv_bfloat16* at, uint32_t (&b0)[2], uint32_t (&b1)[2]) {
  uint32_t bf[4];
  ldmatrix_x4_trans(bf, at);
  b0[0] = bf[0], b0[1] = bf[1], b1[0] = bf[2], b1[1] = bf[3];
}

// Step 5's identity part: acc[nt] (rows r0..r0+15, columns n0 + 8 nt ..) += I · lo[r0..r0+15][n0..n0+63],
// one k-step with the 16 x 16 identity as the A fragment (built in registers) and lo, a raw_at-layout
// [64][128] bf16 tile stored [k][n], as B through ldmatrix.trans (lane offsets bl[n / 2] =
// raw_b_lane(n0 + 8 n)). With A in bf16 (unit diagonal exact) and B = bf16(x) this gives
// A x + (x − bf16(x)): the dominant diagonal term keeps ~16 bits of x.
template <int NT>
__device__ __forceinline__ void identity_lo_step(float (&acc)[NT][4], const __nv_bfloat16* lo, int r0, const int (&bl)[NT / 2]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const uint32_t d = pack_bf16(g == 2 * t ? 1.f : 0.f, g == 2 * t + 1 ? 1.f : 0.f);
  const uint32_t a[4] = {d, 0u, 0u, d};  // rows g / g + 8, columns 2t.. / 2t + 8..: I's entries
#pragma unroll
  for (int n = 0; n < NT; n += 2) {
    uint32_t b0[2], b1[2];
    raw_b_frags(lo + bl[n / 2] + 64 * r0, b0, b1);
    mma_bf16(acc[n], a, b0);
    mma_bf16(acc[n + 1], a, b1);
  }
}

// Largest decay span (G_r0 − G_i, log2) over rows i = r0..r0+7 of a diagonal block (its first row
// the reference), all channels: the warp's maximum (lanes over channels).
__device__ __forceinline__ float half_block_span(const float* Gs, int r0, int lane) {
  float m = 0.f;
  for (int c = lane; c < kD; c += 32) {
    const float Gr = Gs[r0 * kLdF + c];
    for (int i = r0; i < r0 + 8; ++i) m = fmaxf(m, Gr - Gs[i * kLdF + c]);
  }
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

// A diagonal block (rows r..r+15) whose decay span is too wide for one reference but not for two:
// its Aqk and L on tensor cores with rows r..r+7 against reference r and rows r+8..r+15 against
// r + 8, the bf16 operands built per fragment entry from the fp32 tiles (q, k with their L2-norm
// factors rn, G). Three products per matrix: part 0, columns r..r+7 against r (result rows 0-7
// valid: the top-left 8 x 8); part 1, columns r..r+7 against r + 8 (rows 8-15: bottom-left, both
// factors <= 1); part 2, columns r+8..r+15 against r + 8 (rows 8-15: bottom-right). The unused half
// of each product has finite factors (<= 1 on the A side). acc[m][part]: m 0 = Aqk, 1 = L (unscaled).
// Needs max (G_r − G_i) over rows r..r+7 and max (G_{r+8} − G_i) over rows r+8..r+15 <= 100.
__device__ __forceinline__ void diag_block_two_refs(const float* qs, const float* ks, const float* Gs, const float* rn, int r,
                                                    float (&acc)[2][3][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll 1
  for (int ksp = 0; ksp < kD / 16; ++ksp) {
    uint32_t aq[4], ak[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // A entry (row g + 8 (q & 1), channels c, c + 1)
      const int i = r + g + 8 * (q & 1), ref = r + 8 * (q & 1), c = 16 * ksp + 2 * t + 8 * (q >> 1);
      const float2 G = ld2(Gs + i * kLdF + c), Gr = ld2(Gs + ref * kLdF + c);
      const float f0 = fast_exp2(G.x - Gr.x), f1 = fast_exp2(G.y - Gr.y), sq = rn[i], sk = rn[kC + i];
      const float2 x = ld2(qs + i * kLdF + c), y = ld2(ks + i * kLdF + c);
      aq[q] = pack_bf16(x.x * sq * f0, x.y * sq * f1);
      ak[q] = pack_bf16(y.x * sk * f0, y.y * sk * f1);
    }
#pragma unroll
    for (int part = 0; part < 3; ++part) {  // B entry (channels c, c + 1; column j)
      const int j = r + g + (part == 2 ? 8 : 0), ref = part == 0 ? r : r + 8;
      uint32_t b[2];
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int c = 16 * ksp + 2 * t + 8 * q;
        const float2 G = ld2(Gs + j * kLdF + c), Gr = ld2(Gs + ref * kLdF + c), y = ld2(ks + j * kLdF + c);
        const float sk = rn[kC + j];
        b[q] = pack_bf16(y.x * sk * fast_exp2(Gr.x - G.x), y.y * sk * fast_exp2(Gr.y - G.y));
      }
      mma_bf16(acc[0][part], aq, b);
      mma_bf16(acc[1][part], ak, b);
    }
  }
}

// A diagonal block (rows r..r+15) whose decay span is too wide even for two references: its Aqk and
// L on tensor cores by halving, exact for any span. A pair (i, j), j < i, belongs to the level s (8,
// 4, 2, 1) of the highest bit in which i − r and j − r differ: i = b + s + u, j = b + u' (b a
// multiple of 2s, u, u' < s), and the reference m = b + s lies between them, so both factors
// 2^(G_i − G_m) and 2^(G_m − G_j) are <= 1 (one that underflows to 0 belongs to a pair whose true
// factor is below 2^-126). One m16n8k16 product per level and k-step: A rows 0-7 are q and rows
// 8-15 k of the level's lower rows ρ(g) = r + 2s (g / s) + s + g % s (so L comes out of the product
// that gives Aqk), B column n is k of κ(n) = r + 2s (n / s) + n % s; output (g, n) is a pair of the
// level when g / s == n / s. The diagonal Aqk_ii (factor 1) from two more products (columns
// 0-7, 8-15), of which only the diagonal entries are kept. lv[l]: level s = 8 >> l; dg[t]: column tile t.
__device__ __forceinline__ void diag_block_by_halving(const float* qs, const float* ks, const float* Gs, const float* rn, int r,
                                                      float (&lv)[4][4], float (&dg)[2][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll 1
  for (int ksp = 0; ksp < kD / 16; ++ksp) {
#pragma unroll
    for (int l = 0; l < 4; ++l) {
      const int s = 8 >> l, b = r + 2 * s * (g / s), rho = b + s + g % s, kap = b + g % s, m = b + s;  // B column n = g: κ(g)
      const float sq = rn[rho], sk = rn[kC + rho], skap = rn[kC + kap];
      uint32_t a[4], bf[2];
#pragma unroll
      for (int q = 0; q < 2; ++q) {  // channels c, c + 1: A entries (g, c) and (g + 8, c), B entry (c, g)
        const int c = 16 * ksp + 2 * t + 8 * q;
        const float2 Gm = ld2(Gs + m * kLdF + c), Gk = ld2(Gs + kap * kLdF + c);
        float2 f = make_float2(1.f, 1.f);  // 2^(G_ρ − G_m): 1 at s = 1 (ρ = m)
        if (s > 1) {
          const float2 Gr = ld2(Gs + rho * kLdF + c);
          f = make_float2(fast_exp2(Gr.x - Gm.x), fast_exp2(Gr.y - Gm.y));
        }
        const float2 x = ld2(qs + rho * kLdF + c), y = ld2(ks + rho * kLdF + c), z = ld2(ks + kap * kLdF + c);
        a[2 * q] = pack_bf16(x.x * sq * f.x, x.y * sq * f.y);
        a[2 * q + 1] = pack_bf16(y.x * sk * f.x, y.y * sk * f.y);
        bf[q] = pack_bf16(z.x * skap * fast_exp2(Gm.x - Gk.x), z.y * skap * fast_exp2(Gm.y - Gk.y));
      }
      mma_bf16(lv[l], a, bf);
    }
    uint32_t a[4];  // the diagonal: A rows g, g + 8 = q of rows r + g, r + g + 8; B column n = k of r + n (+ 8)
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int i = r + g + 8 * (q & 1), c = 16 * ksp + 2 * t + 8 * (q >> 1);
      const float2 x = ld2(qs + i * kLdF + c);
      a[q] = pack_bf16(x.x * rn[i], x.y * rn[i]);
    }
#pragma unroll
    for (int tile = 0; tile < 2; ++tile) {
      const int j = r + 8 * tile + g;
      uint32_t bf[2];
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const float2 z = ld2(ks + j * kLdF + 16 * ksp + 2 * t + 8 * q);
        bf[q] = pack_bf16(z.x * rn[kC + j], z.y * rn[kC + j]);
      }
      mma_bf16(dg[tile], a, bf);
    }
  }
}

}  // namespace
}  // namespace encore::cuda::kda
