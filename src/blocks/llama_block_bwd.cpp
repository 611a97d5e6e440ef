// LLaMA shifted-block backward and the first layer's QKV-norm backward (encore/blocks/llama.hpp):
// a fixed list of steps (GEMM epilogues, the RoPE backward, partials sums) over views of the
// workspace. Backend-agnostic like the forward: each step dispatches on the tensors' device.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/checks.hpp"
#include "encore/blocks/llama.hpp"
#include "encore/gemm.hpp"
#include "gemm/checks.hpp"

namespace encore {
namespace {

size_t align256(size_t x) { return (x + 255) / 256 * 256; }

struct Step {
  enum Kind { kGemm, kRope, kSum } kind = kGemm;
  const char* name = "";
  GemmEpilogueArgs g;
  GemmEpilogueOptions o;
  RopeBwdZdzArgs rope;
  PartialsSumArgs sum;
  PartialsSum axis = PartialsSum::kPerRow;
  float scale = 1.0f;
};

struct Plan {
  std::vector<Step> steps;
  size_t bytes = 0;
};

// Bump allocation of workspace views (any 256-aligned base, also a placeholder for sizing).
struct Carve {
  char* base;
  size_t off = 0;
  Device dev;
  TensorView take(DType t, int64_t rows, int64_t cols) {
    char* p = base + off;
    off = align256(off + size_t(rows * cols) * dtype_size(t));
    return TensorView::contiguous(p, t, {rows, cols}, dev);
  }
  TensorView take(DType t, int64_t len) {
    char* p = base + off;
    off = align256(off + size_t(len) * dtype_size(t));
    return TensorView::contiguous(p, t, {len}, dev);
  }
};

Step gemm_step(const char* name, Epilogue e) {
  Step s;
  s.name = name;
  s.o.epilogue = e;
  return s;
}
Step wgrad(const char* name, const TensorView& dz, const TensorView& x, const TensorView& dw) {
  Step s = gemm_step(name, Epilogue::kWgrad);  // dw = dzᵀ·x: a = dz [tokens, N_out] stored, w = x [tokens, K_in]
  s.g.a = dz;
  s.g.w = x;
  s.g.d = dw;
  return s;
}
Step column_sum(const char* name, const TensorView& partials, const TensorView& out) {
  Step s;
  s.kind = Step::kSum;
  s.name = name;
  s.sum = PartialsSumArgs{partials, out};
  s.axis = PartialsSum::kPerColumn;
  return s;
}

constexpr int kTileN = 128;  // the dgrad kernels' partials tile (their one CUDA tile, ping-pong 128x128)

// Stage (a): rope_bwd_zdz, rmsnorm_bwd through w3 (accumulating dx_prev), wgrad dw3, dγ.
void stage_a(Plan& p, Carve& ws, const TensorView& qkv, const TensorView& d_qkv, const TensorView& pos, const TensorView& freq,
             const TensorView& w3, const TensorView& x, const TensorView& r, const TensorView& gamma, const TensorView& dx_prev,
             const TensorView& dx, const TensorView& h, const TensorView& dw3, const TensorView& dgamma, int64_t M, int64_t d, int64_t N) {
  const DType t = qkv.dtype;
  TensorView dz2 = ws.take(t, M, N), zdz2 = ws.take(DType::kFP32, M);
  TensorView part = ws.take(DType::kFP32, gemm_column_partials_rows(M), (d + kTileN - 1) / kTileN * kTileN);
  Step rope;
  rope.kind = Step::kRope;
  rope.name = "stage (a) rope_bwd_zdz";
  rope.rope = RopeBwdZdzArgs{qkv, d_qkv, pos, freq, dz2, zdz2};
  rope.scale = 1.0f / float(d);
  p.steps.push_back(rope);
  Step norm = gemm_step("stage (a) rmsnorm_bwd through w3", Epilogue::kRmsnormBwd);
  norm.g.a = dz2;
  norm.g.w = w3;
  norm.g.c = x;
  norm.g.c2 = dx_prev;
  norm.g.gamma = gamma;
  norm.g.row_scale = r;
  norm.g.zdz = zdz2;
  norm.g.d = dx;
  norm.g.aux = h;
  norm.g.partials = part;
  norm.o.partial_tile_n = kTileN;
  p.steps.push_back(norm);
  p.steps.push_back(wgrad("stage (a) wgrad dw3", dz2, h, dw3));
  p.steps.push_back(column_sum("stage (a) dgamma sum", part, dgamma));
}

Plan plan(const LlamaBlockBwdArgs& a, char* base) {
  Plan p;
  const int64_t M = a.y0.shape[0], d = a.y0.shape[1], F = a.w2.shape[1], N = a.w3.shape[0];
  const DType t = a.y0.dtype;
  Carve ws{base, 0, a.y0.device};
  TensorView dx = ws.take(t, M, d), h = ws.take(t, M, d);  // h: x̂2⊙γ1 in (a), then x̂1⊙γ0 in (c)
  stage_a(p, ws, a.qkv, a.d_qkv, a.pos, a.freq, a.w3, a.x2, a.r2, a.gamma1, a.d_x2, dx, h, a.dw3, a.dgamma1, M, d, N);
  // (b) down-proj dgrad + SwiGLU backward
  TensorView y1 = ws.take(t, M, F), dz1 = ws.take(t, M, 2 * F), zdz1 = ws.take(DType::kFP32, M);
  TensorView zpart = ws.take(DType::kFP32, M, (F + kTileN - 1) / kTileN);
  TensorView gpart = ws.take(DType::kFP32, gemm_column_partials_rows(M), (d + kTileN - 1) / kTileN * kTileN);
  Step sw = gemm_step("stage (b) swiglu_bwd through w2", Epilogue::kSwigluBwd);
  sw.g.a = dx;
  sw.g.w = a.w2;
  sw.g.c = a.z1;
  sw.g.d = y1;
  sw.g.aux = dz1;
  sw.g.partials = zpart;
  sw.o.partial_tile_n = kTileN;
  p.steps.push_back(sw);
  Step zs;
  zs.kind = Step::kSum;
  zs.name = "stage (b) zdz sum";
  zs.sum = PartialsSumArgs{zpart, zdz1};
  zs.axis = PartialsSum::kPerRow;
  zs.scale = 1.0f / float(d);
  p.steps.push_back(zs);
  p.steps.push_back(wgrad("stage (b) wgrad dw2", dx, y1, a.dw2));
  // (c) gate/up dgrad + the ffn norm's backward, accumulating dx
  Step norm = gemm_step("stage (c) rmsnorm_bwd through w1", Epilogue::kRmsnormBwd);
  norm.g.a = dz1;
  norm.g.w = a.w1;
  norm.g.c = a.x1;
  norm.g.c2 = dx;
  norm.g.gamma = a.gamma0;
  norm.g.row_scale = a.r1;
  norm.g.zdz = zdz1;
  norm.g.d = a.d_x0;
  norm.g.aux = h;
  norm.g.partials = gpart;
  norm.o.partial_tile_n = kTileN;
  p.steps.push_back(norm);
  p.steps.push_back(wgrad("stage (c) wgrad dw1", dz1, h, a.dw1));
  p.steps.push_back(column_sum("stage (c) dgamma sum", gpart, a.dgamma0));
  // (d) o-proj dgrad and wgrad
  Step dg = gemm_step("stage (d) dgrad d_y0", Epilogue::kDgrad);
  dg.g.a = a.d_x0;
  dg.g.w = a.w0;
  dg.g.d = a.d_y0;
  p.steps.push_back(dg);
  p.steps.push_back(wgrad("stage (d) wgrad dw0", a.d_x0, a.y0, a.dw0));
  p.bytes = ws.off;
  return p;
}

Plan plan(const QkvNormBwdArgs& a, char* base) {
  Plan p;
  const int64_t M = a.x.shape[0], d = a.x.shape[1], N = a.w3.shape[0];
  Carve ws{base, 0, a.x.device};
  TensorView h = ws.take(a.x.dtype, M, d);
  stage_a(p, ws, a.qkv, a.d_qkv, a.pos, a.freq, a.w3, a.x, a.r, a.gamma, a.d_x_prev, a.dx, h, a.dw3, a.dgamma, M, d, N);
  p.bytes = ws.off;
  return p;
}

Status in_step(const char* what, const Step& s, Status st) {
  if (st) return st;
  return Status(st.code(), std::string(what) + " " + s.name + ": " + st.message());
}

Status validate_step(const char* what, const Step& s) {
  switch (s.kind) {
    case Step::kGemm: return in_step(what, s, validate(s.g, s.o));
    default: return Status::ok();  // validated by their runs (no separate validate); shapes checked up front
  }
}

Status run_step(const char* what, const Step& s, Stream stream) {
  switch (s.kind) {
    case Step::kGemm: return in_step(what, s, run(s.g, s.o, nullptr, stream));
    case Step::kRope: return in_step(what, s, run(s.rope, s.scale, stream));
    case Step::kSum: return in_step(what, s, run(s.sum, s.axis, s.scale, stream));
  }
  return Status::internal("unknown step");
}

using gemm::matrix;
using gemm::vector;

// A named list of tensors, for the pairwise overlap checks.
using Named = std::pair<const char*, const TensorView*>;

Status no_overlaps(const std::vector<Named>& outs, const std::vector<Named>& ins, const TensorView* allowed_out = nullptr,
                   const TensorView* allowed_in = nullptr) {
  for (size_t i = 0; i < outs.size(); ++i) {
    if (!outs[i].second->defined()) continue;
    for (size_t j = i + 1; j < outs.size(); ++j)
      if (outs[j].second->defined()) ENCORE_RETURN_IF_ERROR(checks::no_overlap(outs[i].first, *outs[i].second, outs[j].first, *outs[j].second));
    for (const Named& in : ins) {
      if (!in.second->defined()) continue;
      if (outs[i].second == allowed_out && in.second == allowed_in) {
        const TensorView &o = *outs[i].second, &x = *in.second;
        const bool same = o.data == x.data && o.shape_string() == x.shape_string() && o.strides[0] == x.strides[0] && o.strides[1] == x.strides[1];
        if (same) continue;
      }
      ENCORE_RETURN_IF_ERROR(checks::no_overlap(outs[i].first, *outs[i].second, in.first, *in.second));
    }
  }
  return Status::ok();
}

const char* kBlock = "llama_block_backward";
const char* kQkv = "qkv_norm_backward";

}  // namespace

Status validate(const LlamaBlockBwdArgs& a) {
  ENCORE_RETURN_IF_ERROR(checks::present("y0", a.y0));
  ENCORE_RETURN_IF_ERROR(checks::ndim("y0", a.y0, 2, "[M, d]"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("y0", a.y0, gemm::kIo));
  const int64_t M = a.y0.shape[0], d = a.y0.shape[1];
  const std::initializer_list<DType> t = {a.y0.dtype}, f32 = {DType::kFP32};
  ENCORE_RETURN_IF_ERROR(checks::present("w2", a.w2));
  ENCORE_RETURN_IF_ERROR(checks::ndim("w2", a.w2, 2, "[d, F]"));
  ENCORE_RETURN_IF_ERROR(checks::present("w3", a.w3));
  ENCORE_RETURN_IF_ERROR(checks::ndim("w3", a.w3, 2, "[Nqkv, d]"));
  const int64_t F = a.w2.shape[1], N = a.w3.shape[0];
  // Inputs, saved tensors and gradients: shapes of this block (a saved tensor of another forward fails here).
  ENCORE_RETURN_IF_ERROR(matrix("w0", a.w0, d, d, "[d, d]", a.y0, t));
  ENCORE_RETURN_IF_ERROR(matrix("w1", a.w1, 2 * F, d, "[2F, d]", a.y0, t));
  ENCORE_RETURN_IF_ERROR(matrix("w2", a.w2, d, F, "[d, F]", a.y0, t));
  ENCORE_RETURN_IF_ERROR(matrix("w3", a.w3, N, d, "[Nqkv, d]", a.y0, t));
  ENCORE_RETURN_IF_ERROR(vector("gamma0", a.gamma0, d, "[d]", a.y0, t));
  ENCORE_RETURN_IF_ERROR(vector("gamma1", a.gamma1, d, "[d]", a.y0, t));
  ENCORE_RETURN_IF_ERROR(vector("pos", a.pos, M, "[M]", a.y0, {DType::kInt32}));
  ENCORE_RETURN_IF_ERROR(vector("freq", a.freq, N, "[Nqkv]", a.y0, f32));
  ENCORE_RETURN_IF_ERROR(matrix("x1", a.x1, M, d, "[M, d] (saved by the forward)", a.y0, t));
  ENCORE_RETURN_IF_ERROR(matrix("x2", a.x2, M, d, "[M, d] (saved by the forward)", a.y0, t));
  ENCORE_RETURN_IF_ERROR(matrix("z1", a.z1, M, 2 * F, "[M, 2F] (saved by the forward)", a.y0, t));
  ENCORE_RETURN_IF_ERROR(matrix("qkv", a.qkv, M, N, "[M, Nqkv] (saved by the forward)", a.y0, t));
  ENCORE_RETURN_IF_ERROR(vector("r1", a.r1, M, "[M] (saved by the forward)", a.y0, f32));
  ENCORE_RETURN_IF_ERROR(vector("r2", a.r2, M, "[M] (saved by the forward)", a.y0, f32));
  ENCORE_RETURN_IF_ERROR(matrix("d_qkv", a.d_qkv, M, N, "[M, Nqkv] (qkv's shape)", a.y0, t));
  ENCORE_RETURN_IF_ERROR(matrix("d_x2", a.d_x2, M, d, "[M, d] (x2's shape)", a.y0, t));
  ENCORE_RETURN_IF_ERROR(matrix("d_y0", a.d_y0, M, d, "[M, d]", a.y0, t));
  ENCORE_RETURN_IF_ERROR(matrix("d_x0", a.d_x0, M, d, "[M, d]", a.y0, t));
  ENCORE_RETURN_IF_ERROR(matrix("dw0", a.dw0, d, d, "[d, d] (w0's shape)", a.y0, t));
  ENCORE_RETURN_IF_ERROR(matrix("dw1", a.dw1, 2 * F, d, "[2F, d] (w1's shape)", a.y0, t));
  ENCORE_RETURN_IF_ERROR(matrix("dw2", a.dw2, d, F, "[d, F] (w2's shape)", a.y0, t));
  ENCORE_RETURN_IF_ERROR(matrix("dw3", a.dw3, N, d, "[Nqkv, d] (w3's shape)", a.y0, t));
  ENCORE_RETURN_IF_ERROR(vector("dgamma0", a.dgamma0, d, "[d]", a.y0, f32));
  ENCORE_RETURN_IF_ERROR(vector("dgamma1", a.dgamma1, d, "[d]", a.y0, f32));
  const std::vector<Named> outs = {{"d_y0", &a.d_y0}, {"d_x0", &a.d_x0}, {"dw0", &a.dw0}, {"dw1", &a.dw1},
                                   {"dw2", &a.dw2},   {"dw3", &a.dw3},   {"dgamma0", &a.dgamma0}, {"dgamma1", &a.dgamma1}};
  const std::vector<Named> ins = {{"y0", &a.y0}, {"w0", &a.w0},   {"w1", &a.w1},   {"w2", &a.w2},       {"w3", &a.w3},
                                  {"gamma0", &a.gamma0}, {"gamma1", &a.gamma1}, {"pos", &a.pos}, {"freq", &a.freq}, {"x1", &a.x1},
                                  {"x2", &a.x2}, {"z1", &a.z1},   {"qkv", &a.qkv}, {"r1", &a.r1},       {"r2", &a.r2},
                                  {"d_qkv", &a.d_qkv}, {"d_x2", &a.d_x2}};
  ENCORE_RETURN_IF_ERROR(no_overlaps(outs, ins, &a.d_x0, &a.d_x2));
  // Every step's own checks (the CUDA limits among them come at run time), on a placeholder workspace.
  const Plan p = plan(a, reinterpret_cast<char*>(uintptr_t(1) << 12));
  for (const Step& s : p.steps) ENCORE_RETURN_IF_ERROR(validate_step(kBlock, s));
  return Status::ok();
}

size_t workspace_bytes(const LlamaBlockBwdArgs& a) {
  if (!validate(a)) return 0;
  return plan(a, nullptr).bytes;
}

Status run(const LlamaBlockBwdArgs& a, void* workspace, Stream stream) {
  ENCORE_RETURN_IF_ERROR(validate(a));
  if (workspace == nullptr) return Status::invalid("workspace: needs workspace_bytes(args) bytes, got a null pointer");
  if (!checks::aligned(workspace, 256)) return Status::invalid("workspace: must be 256-byte aligned");
  const Plan p = plan(a, static_cast<char*>(workspace));
  for (const Step& s : p.steps) ENCORE_RETURN_IF_ERROR(run_step(kBlock, s, stream));
  return Status::ok();
}

Status validate(const QkvNormBwdArgs& a) {
  ENCORE_RETURN_IF_ERROR(checks::present("x", a.x));
  ENCORE_RETURN_IF_ERROR(checks::ndim("x", a.x, 2, "[M, d]"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("x", a.x, gemm::kIo));
  ENCORE_RETURN_IF_ERROR(checks::present("w3", a.w3));
  ENCORE_RETURN_IF_ERROR(checks::ndim("w3", a.w3, 2, "[Nqkv, d]"));
  const int64_t M = a.x.shape[0], d = a.x.shape[1], N = a.w3.shape[0];
  const std::initializer_list<DType> t = {a.x.dtype}, f32 = {DType::kFP32};
  ENCORE_RETURN_IF_ERROR(matrix("w3", a.w3, N, d, "[Nqkv, d]", a.x, t));
  ENCORE_RETURN_IF_ERROR(vector("gamma", a.gamma, d, "[d]", a.x, t));
  ENCORE_RETURN_IF_ERROR(vector("pos", a.pos, M, "[M]", a.x, {DType::kInt32}));
  ENCORE_RETURN_IF_ERROR(vector("freq", a.freq, N, "[Nqkv]", a.x, f32));
  ENCORE_RETURN_IF_ERROR(vector("r", a.r, M, "[M] (saved by the forward)", a.x, f32));
  ENCORE_RETURN_IF_ERROR(matrix("qkv", a.qkv, M, N, "[M, Nqkv] (saved by the forward)", a.x, t));
  ENCORE_RETURN_IF_ERROR(matrix("d_qkv", a.d_qkv, M, N, "[M, Nqkv] (qkv's shape)", a.x, t));
  if (a.d_x_prev.defined()) ENCORE_RETURN_IF_ERROR(matrix("d_x_prev", a.d_x_prev, M, d, "[M, d] (x's shape)", a.x, t));
  ENCORE_RETURN_IF_ERROR(matrix("dx", a.dx, M, d, "[M, d] (x's shape)", a.x, t));
  ENCORE_RETURN_IF_ERROR(matrix("dw3", a.dw3, N, d, "[Nqkv, d] (w3's shape)", a.x, t));
  ENCORE_RETURN_IF_ERROR(vector("dgamma", a.dgamma, d, "[d]", a.x, f32));
  const std::vector<Named> outs = {{"dx", &a.dx}, {"dw3", &a.dw3}, {"dgamma", &a.dgamma}};
  const std::vector<Named> ins = {{"x", &a.x},     {"gamma", &a.gamma}, {"w3", &a.w3},       {"pos", &a.pos},          {"freq", &a.freq},
                                  {"r", &a.r},     {"qkv", &a.qkv},     {"d_qkv", &a.d_qkv}, {"d_x_prev", &a.d_x_prev}};
  ENCORE_RETURN_IF_ERROR(no_overlaps(outs, ins));
  const Plan p = plan(a, reinterpret_cast<char*>(uintptr_t(1) << 12));
  for (const Step& s : p.steps) ENCORE_RETURN_IF_ERROR(validate_step(kQkv, s));
  return Status::ok();
}

size_t workspace_bytes(const QkvNormBwdArgs& a) {
  if (!validate(a)) return 0;
  return plan(a, nullptr).bytes;
}

Status run(const QkvNormBwdArgs& a, void* workspace, Stream stream) {
  ENCORE_RETURN_IF_ERROR(validate(a));
  if (workspace == nullptr) return Status::invalid("workspace: needs workspace_bytes(args) bytes, got a null pointer");
  if (!checks::aligned(workspace, 256)) return Status::invalid("workspace: must be 256-byte aligned");
  const Plan p = plan(a, static_cast<char*>(workspace));
  for (const Step& s : p.steps) ENCORE_RETURN_IF_ERROR(run_step(kQkv, s, stream));
  return Status::ok();
}

}  // namespace encore
