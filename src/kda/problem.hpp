// Internal: a validated KDA problem (sizes, sequences, resolved options) shared by the backends.
#pragma once
#include <cstdint>
#include <vector>

#include "encore/kda.hpp"

namespace encore::kda {

constexpr int kChunk = 64;          // chunk length of the chunked algorithm
constexpr int64_t kMaxHeadDim = 256;

struct Sequence {
  int64_t batch = 0, begin = 0, end = 0;  // tokens [begin, end) of batch row `batch`
};

// H is the number of value heads (HV: v, g, beta, o, states, A_log, dt_bias and every residual are
// per value head); Hq (<= H, dividing it) the number of q/k heads: value head h reads q/k head
// h / group() (fla's grouped value attention; Hq = H without it).
struct KdaProblem {
  int64_t B = 0, T = 0, H = 0, K = 0, V = 0;
  int64_t Hq = 0;
  int64_t group() const { return Hq > 0 ? H / Hq : 1; }
  double scale = 0.0;  // resolved
  KdaOptions opts;
  std::vector<Sequence> seqs;  // N sequences, in order
};

// Chunks of kChunk tokens of one sequence, and of all of p's sequences (NT, the rows of residuals.h).
inline int64_t seq_chunks(const Sequence& s) { return (s.end - s.begin + kChunk - 1) / kChunk; }
inline int64_t chunk_count(const KdaProblem& p) {
  int64_t c = 0;
  for (const Sequence& s : p.seqs) c += seq_chunks(s);
  return c;
}

// Validates the forward's arguments and fills `out`.
Status make_problem(const KdaForwardArgs& a, const KdaOptions& o, KdaProblem* out);

// The CPU backend's I/O: a host view as a dense row-major fp64 array and back (any strides, any
// float dtype); strided_offset is the element offset of the i-th element in row-major order.
int64_t strided_offset(const TensorView& t, int64_t i);
// A [.., V, K] state view (state_v_first) as the [.., K, V] view of the same elements (the last two dims
// and their strides swapped; undefined stays undefined): the CPU backend's state I/O in either layout.
TensorView state_kv_view(const TensorView& t);
std::vector<double> load_dense(const TensorView& t);
void store_dense(const TensorView& t, const std::vector<double>& src);

}  // namespace encore::kda
