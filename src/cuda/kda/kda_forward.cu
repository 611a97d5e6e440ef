// KDA chunked forward on CUDA (math-kda.md §4), two kernels on tensor cores (mma.sync bf16 -> fp32)
// connected by the workspace layout of kda_device.cuh: the intra-chunk kernel (kda_chunk.cu) writes
// each (chunk, head)'s operands; the state kernel (kda_state.cu) runs the serial inter-chunk pass per
// (sequence, head, 64, 32 or 16 value columns), computing each chunk's o on the way, and writes the final
// state (and the h residual when asked).
#include <string>

#include "cuda/common/device_guard.hpp"
#include "encore/core/device_info.hpp"
#include "cuda/kda/kda_device.cuh"

namespace encore::cuda {
namespace {

static_assert(sizeof(KdaCudaProblem) <= 32764, "the problem travels as one kernel parameter (32764-byte limit, CUDA 12.1+)");

int g_state_columns = 0;  // kda_state_columns_override; 0 = the rule below
int g_chunk_blocks = 0;   // kda_chunk_blocks_override; 0 = one block per SM

Status launched(cudaError_t e, const char* what) {
  if (e != cudaSuccess) return Status::cuda_error(std::string("kda forward: ") + what + ": " + cudaGetErrorString(e));
  return Status::ok();
}

}  // namespace

size_t kda_forward_workspace_bytes(int64_t chunks, int64_t H) {
  return size_t(chunks * H * kda::WsLayout::kBytes);
}

Status launch_kda_forward(const KdaCudaProblem& p, void* workspace, Stream stream) {
  DeviceGuard guard;
  ENCORE_RETURN_IF_ERROR(guard.set(p.device));
  if (p.chunk_start[p.N] == 0 && !p.final_state) return Status::ok();
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const DeviceInfo* info = nullptr;  // cached per device: no driver query per call
  ENCORE_RETURN_IF_ERROR(get_device_info(p.device, &info));
  const bool chunks = p.chunk_start[p.N] > 0;
  const int chunk_blocks = g_chunk_blocks > 0 ? g_chunk_blocks : info->sm_count;
  if (chunks) ENCORE_RETURN_IF_ERROR(launched(kda::launch_chunk_kernel(p, workspace, chunk_blocks, s), "chunk kernel"));
  // Value columns per state block: the narrowest of 16, 32, 64 whose grid fits one wave (one block
  // per SM), else 64: narrower blocks finish a serial step sooner, a second wave doubles the path.
  int columns = g_state_columns;
  if (columns == 0) {
    columns = 64;
    for (int c : {16, 32})
      if (int64_t(p.N) * p.H * ((p.V + c - 1) / c) <= info->sm_count) {
        columns = c;
        break;
      }
  }
  return launched(kda::launch_state_kernel(p, workspace, columns, s), "state kernel");
}

Status kda_chunk_blocks_override(int blocks) {
  if (blocks < 0) return Status::invalid("kda_chunk_blocks_override: blocks must be >= 0, got " + std::to_string(blocks));
  g_chunk_blocks = blocks;
  return Status::ok();
}

Status kda_state_columns_override(int columns) {
  if (columns != 0 && columns != 16 && columns != 32 && columns != 64)
    return Status::invalid("kda_state_columns_override: columns must be 0, 16, 32 or 64, got " + std::to_string(columns));
  g_state_columns = columns;
  return Status::ok();
}

}  // namespace encore::cuda
