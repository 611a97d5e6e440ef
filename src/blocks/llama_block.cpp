// LLaMA shifted-block forward: four GEMM-epilogue runs and two finishers over views of the
// workspace (encore/blocks/llama.hpp). Backend-agnostic: each step dispatches on the tensors' device, so the
// CPU backend runs the same schedule on the CPU references.
#include "encore/blocks/llama.hpp"

#include <cmath>
#include <cstdint>
#include <utility>

#include "core/checks.hpp"
#include "encore/gemm.hpp"

namespace encore {
namespace {

size_t align256(size_t x) { return (x + 255) / 256 * 256; }

struct Steps {
  GemmEpilogueArgs g[4];
  GemmEpilogueOptions o[4];
  RmsFinalReduceArgs f[2];
  int64_t d = 0;
  size_t bytes = 0;  // workspace
};

// x = a·wᵀ + c (written to d), h = x ⊙ γ (aux), partials of Σ x² per 128 columns.
void residual_step(GemmEpilogueArgs& g, GemmEpilogueOptions& o, const TensorView& a, const TensorView& w, const TensorView& c,
                   const TensorView& d, const TensorView& aux, const TensorView& gamma, const TensorView& partials, int partial_tile_n) {
  g.a = a;
  g.w = w;
  g.c = c;
  g.d = d;
  g.aux = aux;
  g.gamma = gamma;
  g.partials = partials;
  o = GemmEpilogueOptions{Epilogue::kResidualSqsumAux};
  o.partial_tile_n = partial_tile_n;
}

// The six steps over a workspace at `ws` (any 256-aligned address for validation and sizing).
Steps plan(const LlamaBlockArgs& a, char* ws) {
  Steps s;
  const int64_t M = a.y0.shape[0], d = a.y0.shape[1], F = a.w2.defined() && a.w2.ndim == 2 ? a.w2.shape[1] : 0;
  const DType t = a.y0.dtype;
  const Device dev = a.y0.device;
  const size_t es = dtype_size(t);
  size_t off = 0;
  auto take = [&](size_t bytes) {
    char* p = ws + off;
    off = align256(off + bytes);
    return p;
  };
  const int ptn1 = gemm_partial_tile_n(Epilogue::kResidualSqsumAux, M, d, d);
  const int ptn2 = gemm_partial_tile_n(Epilogue::kResidualSqsumAux, M, d, F);
  TensorView h1 = TensorView::contiguous(take(size_t(M * d) * es), t, {M, d}, dev);
  TensorView y1 = TensorView::contiguous(take(size_t(M * F) * es), t, {M, F}, dev);
  TensorView h2 = TensorView::contiguous(take(size_t(M * d) * es), t, {M, d}, dev);
  TensorView p1 = TensorView::contiguous(take(size_t(M * ((d + ptn1 - 1) / ptn1)) * 4), DType::kFP32, {M, (d + ptn1 - 1) / ptn1}, dev);
  TensorView p2 = TensorView::contiguous(take(size_t(M * ((d + ptn2 - 1) / ptn2)) * 4), DType::kFP32, {M, (d + ptn2 - 1) / ptn2}, dev);
  s.bytes = off;
  s.d = d;
  // 1: x1 = y0·w0ᵀ + x0, h1 = x1 ⊙ γ0, partials of Σ x1²
  residual_step(s.g[0], s.o[0], a.y0, a.w0, a.x0, a.x1, h1, a.gamma0, p1, ptn1);
  s.f[0] = RmsFinalReduceArgs{p1, a.r1};
  // 2: z1 = r1 ⊙ (h1·w1ᵀ), y1 = swiglu(z1)
  s.g[1].a = h1;
  s.g[1].w = a.w1;
  s.g[1].d = a.z1;
  s.g[1].aux = y1;
  s.g[1].row_scale = a.r1;
  s.o[1] = GemmEpilogueOptions{Epilogue::kSwiglu};
  // 3: x2 = y1·w2ᵀ + x1, h2 = x2 ⊙ γ1, partials of Σ x2²
  residual_step(s.g[2], s.o[2], y1, a.w2, a.x1, a.x2, h2, a.gamma1, p2, ptn2);
  s.f[1] = RmsFinalReduceArgs{p2, a.r2};
  // 4: qkv = RoPE(r2 ⊙ (h2·w3ᵀ))
  s.g[3].a = h2;
  s.g[3].w = a.w3;
  s.g[3].d = a.qkv;
  s.g[3].row_scale = a.r2;
  s.g[3].pos = a.pos;
  s.g[3].freq = a.freq;
  s.o[3] = GemmEpilogueOptions{Epilogue::kRope};
  return s;
}

const char* kStepNames[4] = {"step 1 (o-proj + residual + sqsum)", "step 2 (gate/up + SwiGLU)", "step 3 (down-proj + residual + sqsum)",
                             "step 4 (QKV + RoPE)"};

Status in_step(int i, Status st) {
  if (st) return st;
  return Status(st.code(), std::string("llama_block ") + kStepNames[i] + ": " + st.message());
}

// Validates, checks the workspace and plans the steps over it.
Status checked_plan(const LlamaBlockArgs& a, const LlamaBlockOptions& o, void* workspace, Steps* s) {
  ENCORE_RETURN_IF_ERROR(validate(a, o));
  if (workspace == nullptr) return Status::invalid("workspace: needs workspace_bytes(args, opts) bytes, got a null pointer");
  if (!checks::aligned(workspace, 256)) return Status::invalid("workspace: must be 256-byte aligned");
  *s = plan(a, static_cast<char*>(workspace));
  return Status::ok();
}

// Step i's GEMM-epilogue run and, after steps 0 and 2, its rms_final_reduce.
Status run_planned(const Steps& s, int i, float eps, Stream stream) {
  ENCORE_RETURN_IF_ERROR(in_step(i, run(s.g[i], s.o[i], nullptr, stream)));
  if (i == 0 || i == 2) return in_step(i, run(s.f[i / 2], s.d, eps, stream));
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
  Steps s = plan(a, reinterpret_cast<char*>(uintptr_t(1) << 12));
  for (int i = 0; i < 4; ++i) ENCORE_RETURN_IF_ERROR(in_step(i, validate(s.g[i], s.o[i])));
  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"r1", &a.r1}, {"r2", &a.r2}}) {
    ENCORE_RETURN_IF_ERROR(checks::present(name, *t));
    ENCORE_RETURN_IF_ERROR(checks::dtype_in(name, *t, {DType::kFP32}));
  }
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("x1", a.x1, "x0", a.x0));
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("x2", a.x2, "x1", a.x1));
  ENCORE_RETURN_IF_ERROR(checks::no_overlap("r2", a.r2, "r1", a.r1));
  return Status::ok();
}

size_t workspace_bytes(const LlamaBlockArgs& a, const LlamaBlockOptions& o) {
  if (!validate(a, o)) return 0;
  return plan(a, nullptr).bytes;
}

Status run(const LlamaBlockArgs& a, const LlamaBlockOptions& o, void* workspace, Stream stream) {
  Steps s;
  ENCORE_RETURN_IF_ERROR(checked_plan(a, o, workspace, &s));
  for (int i = 0; i < 4; ++i) ENCORE_RETURN_IF_ERROR(run_planned(s, i, o.eps, stream));
  return Status::ok();
}

Status run_step(const LlamaBlockArgs& a, const LlamaBlockOptions& o, void* workspace, int step, Stream stream) {
  if (step < 0 || step > 3) return Status::invalid("step: must be 0, 1, 2 or 3, got " + std::to_string(step));
  Steps s;
  ENCORE_RETURN_IF_ERROR(checked_plan(a, o, workspace, &s));
  return run_planned(s, step, o.eps, stream);
}

}  // namespace encore
