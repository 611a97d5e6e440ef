// Internal hooks of the KDA family for tests and benchmarks (never in include/): process-wide
// overrides of the CUDA launch rules, the chunk kernel's raw-input report and its phase profile.
// Implemented by the CUDA backend (kda/cuda); not for concurrent use.
#pragma once
#include "encore/core/status.hpp"
#include "kda/cuda/launch.hpp"

namespace encore::cuda {

// Phase profile of the chunk kernel (bench suite kda_phases only): while enabled, thread 0 of every
// block adds the clock64() cycles of each barrier-separated phase to device counters, in the order
// 0, 7, 1, ..., 6 (0: the wait for the item's raw input tiles, 7: q, v and their sums of squares, the
// wait for the previous item's W and U stores to leave shared memory and the barrier, 1: k, the gate
// and k's sums of squares, 2: gate scan + L2-norm factors, 3: intra-chunk operands, 4: Aqk and L and
// the diagonal blocks of the inverse, 5: write-out beside the inverse's blocks below the diagonal,
// 6: W and U). read() returns the sums and the number of items and resets them.

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
