// Host entry of the CUDA KDA forward (no CUDA types). The dispatch (src/kda/kda.cpp) has validated
// the problem; sequences come from host-side cu_seqlens (or the fixed-length batch) and travel to
// the kernels as launch parameters, so a launch reads no host memory and never synchronizes.
#pragma once
#include <cstddef>
#include <cstdint>

#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"

namespace encore::cuda {

constexpr int kKdaMaxSeqs = 1024;    // sequences per launch (the table is a launch parameter)
constexpr int kKdaMaxHeadDim = 128;  // K and V on CUDA

struct KdaTensor {  // [B, T, H, C] (or [B, T, H] with C = 1): element strides; dtype bf16 or fp32
  const void* data = nullptr;
  DType dtype = DType::kFP32;
  int64_t sb = 0, st = 0, sh = 0;
};

struct KdaCudaProblem {
  int B = 0, T = 0, H = 0, K = 0, V = 0, N = 0;
  float scale = 1.0f;
  bool l2norm = false, gate_in_kernel = false, lower_bound_gate = false;
  float lower_bound = -5.0f;
  KdaTensor q, k, v, g, beta;
  const float* A_log = nullptr;    // [H] fp32 or null
  const float* dt_bias = nullptr;  // [H * K] fp32 or null
  const float* h0 = nullptr;       // [N, H, K, V] fp32 contiguous or null
  void* o = nullptr;               // [B, T, H, V], dtype o_dtype, strides like KdaTensor
  DType o_dtype = DType::kFP32;
  int64_t o_sb = 0, o_st = 0, o_sh = 0;
  float* final_state = nullptr;    // [N, H, K, V] fp32 contiguous or null
  // Residuals for the backward (contiguous; null = not saved): G fp32 [B, T, H, K]; Aqk, Akk
  // [B, T, H, 64] and h [NT, H, K, V] in res_dtype (bf16 or fp32).
  float* res_G = nullptr;
  void* res_Aqk = nullptr;
  void* res_Akk = nullptr;
  void* res_h = nullptr;
  DType res_dtype = DType::kFP32;
  bool varlen = false;             // sequence n is in batch row 0 (varlen) or n (fixed length)
  int32_t seq_begin[kKdaMaxSeqs];  // tokens [begin, end) of sequence n
  int32_t seq_end[kKdaMaxSeqs];
  int32_t chunk_start[kKdaMaxSeqs + 1];  // first chunk slot of sequence n; [N] = total chunks
  // Sequences by chunk count, longest first (ties in index order): the state kernel's blocks start
  // in this order, so the longest serial passes never wait for a free SM behind short ones.
  int32_t seq_by_length[kKdaMaxSeqs];
  int device = 0;
  // Filled by launch_kda_forward: the chunk kernel's TMA descriptors (CUtensorMap, 128 bytes each) of
  // q, k, g, v as [B, T, H, C] bf16 tensors with boxes of 64 channels x 64 tokens, and the inputs
  // that have one (bit t; the others are read from global memory by the threads).
  alignas(128) unsigned char tmap[4][128];
  int raw_fast = 0;
};

// Workspace of the forward: one record per (chunk, head) with the head dims padded to 128
// (kda_device.cuh's WsLayout, 96.5 KB), so it depends on the chunk and head counts only.
size_t kda_forward_workspace_bytes(int64_t chunks, int64_t H);
Status launch_kda_forward(KdaCudaProblem& p, void* workspace, Stream stream);  // fills p.tmap, p.raw_fast

// Phase profile of the chunk kernel (bench suite kda_phases only): while enabled, thread 0 of every
// block adds the clock64() cycles of each barrier-separated phase to device counters, in the order
// 0, 7, 1, ..., 6 (0: the wait for the item's raw input tiles, 7: q, v and their sums of squares, the
// wait for the previous item's W and U stores to leave shared memory and the barrier, 1: k, the gate
// and k's sums of squares, 2: gate scan + L2-norm factors, 3: intra-chunk operands, 4: Aqk and L and
// the diagonal blocks of the inverse, 5: write-out beside the inverse's blocks below the diagonal,
// 6: W and U). read() returns the sums and the number of items and resets them.
constexpr int kKdaChunkPhases = 8;
// The phases in the order they run, and their short names (bench output).
constexpr int kKdaChunkPhaseOrder[kKdaChunkPhases] = {0, 7, 1, 2, 3, 4, 5, 6};
constexpr const char* kKdaChunkPhaseNames[kKdaChunkPhases] = {"raw-wait", "k+gate", "scan+norm", "operands", "Aqk/L+diag-inv",
                                                               "write-out+inverse", "W/U", "q+v+store-wait"};

// Value columns per block of the state kernel (bench suite kda_plans): 16, 32 or 64, or 0 for the
// launcher's rule. Process-wide; not for concurrent use.
Status kda_state_columns_override(int columns);
// Blocks of the persistent chunk kernel (tests: a small grid makes each block walk many items, the
// next item's inputs prefetched during the current one), or 0 for one per SM. Process-wide; not for
// concurrent use.
Status kda_chunk_blocks_override(int blocks);
// Test hook: which inputs the last chunk kernel read as raw TMA tiles (bit t: q, k, g, v; 0 for all
// where a block's shared memory was not 1024-byte aligned since the previous call, which resets that).
// Synchronizes. Process-wide; not for concurrent use.
Status kda_chunk_raw_inputs(int* mask);
Status kda_chunk_profile_enable(bool on);
Status kda_chunk_profile_read(unsigned long long cycles[kKdaChunkPhases], unsigned long long* blocks);

}  // namespace encore::cuda
