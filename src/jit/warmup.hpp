// `encore jit warmup` (docs/jit.md, "Warm-up and info"): the config file's lines, one
// specialization family each, and the kernels (launch-plan variants) each line expands to.
//   rms_norm <bf16|fp16|fp32> <hidden> [add]
//   qk_norm <bf16|fp16> <head_dim 64|128|256> <q_heads> <kv_heads> [offset]
//   fp8_group_quant <bf16|fp16|fp32> <K, a multiple of 128> [group_size: 128]
//   mxfp8_quant <bf16|fp16|fp32> <K, a multiple of 32>     nvfp4_quant <bf16|fp16|fp32> <K, a multiple of 16>
//   moe_routing <bf16|fp16|fp32> <experts> <top_k> [<n_group> <topk_group>]
//   moe_dispatch <experts> <top_k>
//   moe_combine <bf16|fp16|fp32> <hidden> <top_k> [<out dtype>]
// '#' starts a comment; blank lines are skipped.
#pragma once
#include <cstdint>
#include <functional>
#include <istream>
#include <string>
#include <vector>

#include "encore/core/dtype.hpp"
#include "encore/core/status.hpp"
#include "jit/jit.hpp"

namespace encore::jit {

struct WarmupLine {
  std::string kernel;  // rms_norm, qk_norm, fp8_group_quant, mxfp8_quant, nvfp4_quant, moe_routing, moe_dispatch, moe_combine
  DType dtype = DType::kBF16;      // moe_dispatch: none (unused)
  DType out_dtype = DType::kBF16;  // moe_combine: out's dtype (default: dtype)
  // hidden | head_dim, q_heads, kv_heads | K, group_size | K | experts, top_k, n_group, topk_group |
  // experts, top_k | hidden, top_k
  std::vector<int64_t> dims;
  bool add = false;           // rms_norm
  bool offset = false;        // qk_norm
  int line = 0;               // 1-based line number in the config
};
// Parses a whole config; on the first bad line returns invalid naming the line and the expected form.
Status parse_warmup_config(std::istream& in, std::vector<WarmupLine>* out);
const char* default_warmup_config();  // the built-in list (`encore jit warmup` without --config)

// One kernel to compile: its readable name and the call that compiles (device < 0: cubin for
// `arch` only) or loads it (device >= 0).
struct WarmupItem {
  std::string name;
  std::function<Status(int device, const std::string& arch, Origin* origin, double* ms)> run;
};
// Every launch-plan variant of a line on a device with `sm_count` SMs.
std::vector<WarmupItem> warmup_items(const WarmupLine& line, int sm_count);

}  // namespace encore::jit
