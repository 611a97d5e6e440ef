// LLaMA shifted-block forward: four GEMM-epilogue runs and two finishers over views of the
// workspace (encore/blocks/llama.hpp; steps 1-3 shared with the last layer, blocks/plan.hpp).
// Backend-agnostic: each step dispatches on the tensors' device, so the CPU backend runs the same
// schedule on the CPU references.
#include "encore/blocks/llama.hpp"

#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/checks.hpp"
#include "blocks/plan.hpp"
#include "encore/gemm.hpp"

namespace encore {
namespace {

using namespace blocks;

// The six steps in four groups over a workspace at `ws` (any 256-aligned address for validation and sizing).
Plan plan(const LlamaBlockArgs& a, float eps, char* base) {
  Plan p;
  const int64_t M = a.y0.shape[0], d = a.y0.shape[1];
  Carve ws{base, 0, a.y0.device};
  TensorView h2 = ws.take(a.y0.dtype, M, d);
  forward_mlp_steps(p, ws, a.y0, a.x0, a.w0, a.w1, a.w2, a.gamma0, a.gamma1, a.x1, a.z1, a.x2, a.r1, a.r2, h2, eps);
  // 4: qkv = RoPE(r2 ⊙ (h2·w3ᵀ))
  Step rope = gemm_step("step 4 (QKV + RoPE)", Epilogue::kRope);
  rope.group = 3;
  rope.g.a = h2;
  rope.g.w = a.w3;
  rope.g.d = a.qkv;
  rope.g.row_scale = a.r2;
  rope.g.pos = a.pos;
  rope.g.freq = a.freq;
  p.steps.push_back(rope);
  p.bytes = ws.off;
  return p;
}

const char* kBlock = "llama_block";

// Validates, checks the workspace and plans the steps over it.
Status checked_plan(const LlamaBlockArgs& a, const LlamaBlockOptions& o, void* workspace, Plan* p) {
  ENCORE_RETURN_IF_ERROR(validate(a, o));
  ENCORE_RETURN_IF_ERROR(check_workspace(workspace, "workspace_bytes(args, opts)"));
  *p = plan(a, o.eps, static_cast<char*>(workspace));
  return Status::ok();
}

}  // namespace

Status validate(const LlamaBlockArgs& a, const LlamaBlockOptions& o) {
  ENCORE_RETURN_IF_ERROR(checks::present("y0", a.y0));
  ENCORE_RETURN_IF_ERROR(checks::ndim("y0", a.y0, 2, "[M, d]"));
  ENCORE_RETURN_IF_ERROR(checks::present("w2", a.w2));
  ENCORE_RETURN_IF_ERROR(checks::ndim("w2", a.w2, 2, "[d, F]"));
  ENCORE_RETURN_IF_ERROR(checks::present("w0", a.w0));
  if (a.w0.ndim != 2 || a.w0.shape[0] != a.y0.shape[1])
    return Status::invalid("w0: expected [d, d] with d = " + std::to_string(a.y0.shape[1]) + " (y0's columns), got " + a.w0.shape_string());
  if (!(o.eps >= 0.0f) || !std::isfinite(o.eps)) return Status::invalid("eps: must be finite and >= 0");
  // Shapes, dtypes, devices and overlaps of every step, on a placeholder workspace address.
  const Plan p = plan(a, o.eps, placeholder_workspace());
  for (const Step& s : p.steps) ENCORE_RETURN_IF_ERROR(validate_step(kBlock, s));
  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"r1", &a.r1}, {"r2", &a.r2}}) {
    ENCORE_RETURN_IF_ERROR(checks::present(name, *t));
    ENCORE_RETURN_IF_ERROR(checks::dtype_in(name, *t, {DType::kFP32}));
  }
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("x1", a.x1, "x0", a.x0));
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("x2", a.x2, "x1", a.x1));
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("r2", a.r2, "r1", a.r1));
  // Every output is written while inputs and earlier outputs are still read (x1 by step 3, r1 by step 2):
  // no output overlaps another or an input (the steps check only their own operands).
  const std::vector<Named> outs = {{"x1", &a.x1}, {"x2", &a.x2}, {"z1", &a.z1}, {"qkv", &a.qkv}, {"r1", &a.r1}, {"r2", &a.r2}};
  const std::vector<Named> ins = {{"y0", &a.y0},         {"x0", &a.x0},         {"w0", &a.w0},   {"w1", &a.w1},    {"w2", &a.w2},
                                  {"w3", &a.w3},         {"gamma0", &a.gamma0}, {"gamma1", &a.gamma1}, {"pos", &a.pos}, {"freq", &a.freq}};
  return no_overlaps(outs, ins);
}

size_t workspace_bytes(const LlamaBlockArgs& a, const LlamaBlockOptions& o) {
  if (!validate(a, o)) return 0;
  return plan(a, o.eps, nullptr).bytes;
}

Status run(const LlamaBlockArgs& a, const LlamaBlockOptions& o, void* workspace, Stream stream) {
  Plan p;
  ENCORE_RETURN_IF_ERROR(checked_plan(a, o, workspace, &p));
  return run_steps(kBlock, p, stream);
}

Status run_step(const LlamaBlockArgs& a, const LlamaBlockOptions& o, void* workspace, int step, Stream stream) {
  if (step < 0 || step > 3) return Status::invalid("step: must be 0, 1, 2 or 3, got " + std::to_string(step));
  Plan p;
  ENCORE_RETURN_IF_ERROR(checked_plan(a, o, workspace, &p));
  return run_steps(kBlock, p, stream, step);
}

}  // namespace encore
