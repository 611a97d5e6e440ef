// Internal: the block compositions' shared plan machinery (encore/blocks/llama.hpp, llama_last.hpp). A
// block is a fixed list of steps (GEMM epilogues, the RoPE backward, finishers, partials sums) over views
// of one workspace, carved by bump allocation; validation runs every step's own checks on a placeholder
// workspace address, run() the steps in order. Backend-agnostic: each step dispatches on its tensors'
// device. Also the stages two blocks share: the forward's steps 1-3 and the backward's stages (b)-(d).
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/carve.hpp"
#include "core/checks.hpp"
#include "encore/gemm.hpp"
#include "gemm/checks.hpp"

namespace encore::blocks {


struct Step {
  enum Kind { kGemm, kRope, kSum, kRms, kLseFinish, kCeMean } kind = kGemm;
  const char* name = "";
  int group = 0;  // the forward's run_step(step) runs one group (a GEMM and its finisher)
  GemmEpilogueArgs g;
  GemmEpilogueOptions o;
  RopeBwdZdzArgs rope;
  PartialsSumArgs sum;
  PartialsSum axis = PartialsSum::kPerRow;
  float scale = 1.0f;
  RmsFinalReduceArgs rms;  // kRms: r from the partials over `hidden` columns, eps
  int64_t hidden = 0;
  float eps = 0.0f;
  LseFinishArgs lse;  // kLseFinish
  CeMeanArgs mean;    // kCeMean
  int ignore_index = -100;
};

struct Plan {
  std::vector<Step> steps;
  size_t bytes = 0;  // workspace
};

// A placeholder workspace base for validation and sizing (never dereferenced).
inline char* placeholder_workspace() { return reinterpret_cast<char*>(uintptr_t(1) << 12); }

inline Step gemm_step(const char* name, Epilogue e) {
  Step s;
  s.name = name;
  s.o.epilogue = e;
  return s;
}
inline Step wgrad(const char* name, const TensorView& dz, const TensorView& x, const TensorView& dw) {
  Step s = gemm_step(name, Epilogue::kWgrad);  // dw = dzᵀ·x: a = dz [tokens, N_out] stored, w = x [tokens, K_in]
  s.g.a = dz;
  s.g.w = x;
  s.g.d = dw;
  return s;
}
inline Step partials_sum(const char* name, const TensorView& partials, const TensorView& out, PartialsSum axis, float scale = 1.0f) {
  Step s;
  s.kind = Step::kSum;
  s.name = name;
  s.sum = PartialsSumArgs{partials, out};
  s.axis = axis;
  s.scale = scale;
  return s;
}

// The partials' column tile of rmsnorm_bwd over dz [M, K] and a consumer weight [K, d] (the launch
// plan's, gemm_partial_tile_n), and its dγ column partials [ceil(M / 128), round_up(d, tile)].
inline int rmsnorm_bwd_tile_n(int64_t M, int64_t d, int64_t K) { return gemm_partial_tile_n(Epilogue::kRmsnormBwd, M, d, K); }
inline TensorView column_partials(Carve& ws, int64_t M, int64_t d, int64_t K) {
  const int64_t tn = rmsnorm_bwd_tile_n(M, d, K);
  return ws.take(DType::kFP32, gemm_column_partials_rows(M), (d + tn - 1) / tn * tn);
}

// rmsnorm_bwd over dz and the consumer weight w [N_fwd, d]: dx = dx_prev + r·(γ⊙da − x̂·zdz), aux h = x̂⊙γ,
// dγ column partials `part` (column_partials(ws, M, d, N_fwd)).
inline Step rmsnorm_bwd_step(const char* name, const TensorView& dz, const TensorView& w, const TensorView& x, const TensorView& dx_prev,
                             const TensorView& gamma, const TensorView& r, const TensorView& zdz, const TensorView& dx, const TensorView& h,
                             const TensorView& part) {
  Step s = gemm_step(name, Epilogue::kRmsnormBwd);
  s.g.a = dz;
  s.g.w = w;
  s.g.c = x;
  s.g.c2 = dx_prev;
  s.g.gamma = gamma;
  s.g.row_scale = r;
  s.g.zdz = zdz;
  s.g.d = dx;
  s.g.aux = h;
  s.g.partials = part;
  s.o.partial_tile_n = rmsnorm_bwd_tile_n(dz.shape[0], w.shape[1], dz.shape[1]);
  return s;
}

// x = a·wᵀ + c (d), h = x ⊙ γ (aux), Σ x² partials, then r = rsqrt(mean(x²) + eps); one group.
inline void residual_norm_steps(Plan& p, const char* name, int group, const TensorView& a, const TensorView& w, const TensorView& c,
                                const TensorView& x, const TensorView& h, const TensorView& gamma, const TensorView& part, int ptn,
                                const TensorView& r, int64_t d, float eps) {
  Step s = gemm_step(name, Epilogue::kResidualSqsumAux);
  s.group = group;
  s.g.a = a;
  s.g.w = w;
  s.g.c = c;
  s.g.d = x;
  s.g.aux = h;
  s.g.gamma = gamma;
  s.g.partials = part;
  s.o.partial_tile_n = ptn;
  p.steps.push_back(s);
  Step f;
  f.kind = Step::kRms;
  f.name = name;
  f.group = group;
  f.rms = RmsFinalReduceArgs{part, r};
  f.hidden = d;
  f.eps = eps;
  p.steps.push_back(f);
}

// The block forward's steps 1-3 (groups 0-2): x1, h1, r1;  z1 = r1 ⊙ (h1·w1ᵀ), y1;  x2, h2 = x2 ⊙ γ_next, r2.
// h1, y1 and the partials are carved from ws; h2 is the caller's (workspace or a saved output).
inline void forward_mlp_steps(Plan& p, Carve& ws, const TensorView& y0, const TensorView& x0, const TensorView& w0, const TensorView& w1,
                              const TensorView& w2, const TensorView& gamma0, const TensorView& gamma_next, const TensorView& x1,
                              const TensorView& z1, const TensorView& x2, const TensorView& r1, const TensorView& r2, const TensorView& h2,
                              float eps) {
  const int64_t M = y0.shape[0], d = y0.shape[1], F = w2.defined() && w2.ndim == 2 ? w2.shape[1] : 0;
  const DType t = y0.dtype;
  const int ptn1 = gemm_partial_tile_n(Epilogue::kResidualSqsumAux, M, d, d), ptn2 = gemm_partial_tile_n(Epilogue::kResidualSqsumAux, M, d, F);
  TensorView h1 = ws.take(t, M, d), y1 = ws.take(t, M, F);
  TensorView p1 = ws.take(DType::kFP32, M, (d + ptn1 - 1) / ptn1), p2 = ws.take(DType::kFP32, M, (d + ptn2 - 1) / ptn2);
  residual_norm_steps(p, "step 1 (o-proj + residual + sqsum)", 0, y0, w0, x0, x1, h1, gamma0, p1, ptn1, r1, d, eps);
  Step sw = gemm_step("step 2 (gate/up + SwiGLU)", Epilogue::kSwiglu);
  sw.group = 1;
  sw.g.a = h1;
  sw.g.w = w1;
  sw.g.d = z1;
  sw.g.aux = y1;
  sw.g.row_scale = r1;
  p.steps.push_back(sw);
  residual_norm_steps(p, "step 3 (down-proj + residual + sqsum)", 2, y1, w2, x1, x2, h2, gamma_next, p2, ptn2, r2, d, eps);
}

// The saved tensors stages (b)-(d) read: the forward's inputs and its saved x1, z1, r1.
struct FfnOprojSaved {
  TensorView y0, w0, w1, w2, gamma0, x1, z1, r1;
};
struct FfnOprojGrads {
  TensorView d_y0, d_x0, dw0, dw1, dw2, dgamma0;
};

// Stages (b)-(d) of the block backward from dx, the gradient at x2 (a workspace view); h a workspace
// [M, d] view free for (c)'s aux:
//   (b) swiglu_bwd(dx, w2, z1): dz1, y1, zdz1 partials;  zdz1 = (1/d)·Σ;  wgrad dw2 = dxᵀ·y1
//   (c) rmsnorm_bwd(dz1, w1, x1, c2 = dx, γ0, r1): d_x0, h1, dγ0 partials;  wgrad dw1 = dz1ᵀ·h1;  dγ0
//   (d) dgrad d_y0 = d_x0·w0;  wgrad dw0 = d_x0ᵀ·y0
inline void stage_ffn_oproj(Plan& p, Carve& ws, const FfnOprojSaved& s, const TensorView& dx, const TensorView& h, const FfnOprojGrads& g) {
  const int64_t M = s.y0.shape[0], d = s.y0.shape[1], F = s.w2.shape[1];
  const DType t = s.y0.dtype;
  TensorView y1 = ws.take(t, M, F), dz1 = ws.take(t, M, 2 * F), zdz1 = ws.take(DType::kFP32, M);
  const int ztn = gemm_partial_tile_n(Epilogue::kSwigluBwd, M, F, d);
  TensorView zpart = ws.take(DType::kFP32, M, (F + ztn - 1) / ztn);
  TensorView gpart = column_partials(ws, M, d, 2 * F);
  Step sw = gemm_step("stage (b) swiglu_bwd through w2", Epilogue::kSwigluBwd);
  sw.g.a = dx;
  sw.g.w = s.w2;
  sw.g.c = s.z1;
  sw.g.d = y1;
  sw.g.aux = dz1;
  sw.g.partials = zpart;
  sw.o.partial_tile_n = ztn;
  p.steps.push_back(sw);
  p.steps.push_back(partials_sum("stage (b) zdz sum", zpart, zdz1, PartialsSum::kPerRow, 1.0f / float(d)));
  p.steps.push_back(wgrad("stage (b) wgrad dw2", dx, y1, g.dw2));
  p.steps.push_back(rmsnorm_bwd_step("stage (c) rmsnorm_bwd through w1", dz1, s.w1, s.x1, dx, s.gamma0, s.r1, zdz1, g.d_x0, h, gpart));
  p.steps.push_back(wgrad("stage (c) wgrad dw1", dz1, h, g.dw1));
  p.steps.push_back(partials_sum("stage (c) dgamma sum", gpart, g.dgamma0, PartialsSum::kPerColumn));
  Step dg = gemm_step("stage (d) dgrad d_y0", Epilogue::kDgrad);
  dg.g.a = g.d_x0;
  dg.g.w = s.w0;
  dg.g.d = g.d_y0;
  p.steps.push_back(dg);
  p.steps.push_back(wgrad("stage (d) wgrad dw0", g.d_x0, s.y0, g.dw0));
}

inline Status in_step(const char* what, const Step& s, Status st) {
  if (st) return st;
  return Status(st.code(), std::string(what) + " " + s.name + ": " + st.message());
}

// The GEMM steps' argument checks on a plan over a placeholder workspace (validate: shapes, dtypes,
// devices; the other steps' arguments are the blocks' own, checked up front).
inline Status validate_step(const char* what, const Step& s) {
  if (s.kind == Step::kGemm) return in_step(what, s, validate(s.g, s.o));
  return Status::ok();
}

// Every check a step's run makes before it writes (on CUDA the kernels' own limits and the device memory,
// the workspace's included), on the plan over the real workspace.
inline Status check_step(const char* what, const Step& s) {
  switch (s.kind) {
    case Step::kGemm: return in_step(what, s, gemm::check_run(s.g, s.o));
    case Step::kRope: return in_step(what, s, gemm::check_run(s.rope, s.scale));
    case Step::kSum: return in_step(what, s, gemm::check_run(s.sum, s.axis, s.scale));
    case Step::kRms: return in_step(what, s, gemm::check_run(s.rms, s.hidden, s.eps));
    case Step::kLseFinish: return in_step(what, s, gemm::check_run(s.lse));
    case Step::kCeMean: return in_step(what, s, gemm::check_run(s.mean));
  }
  return Status::internal("unknown step");
}

inline Status run_step(const char* what, const Step& s, Stream stream) {
  switch (s.kind) {
    case Step::kGemm: return in_step(what, s, run(s.g, s.o, nullptr, stream));
    case Step::kRope: return in_step(what, s, run(s.rope, s.scale, stream));
    case Step::kSum: return in_step(what, s, run(s.sum, s.axis, s.scale, stream));
    case Step::kRms: return in_step(what, s, run(s.rms, s.hidden, s.eps, stream));
    case Step::kLseFinish: return in_step(what, s, run(s.lse, s.ignore_index, stream));
    case Step::kCeMean: return in_step(what, s, run(s.mean, s.ignore_index, stream));
  }
  return Status::internal("unknown step");
}

// The steps of a plan over the real workspace (those of `group`, or all for -1): every step checked before
// the first runs, so a block refused on any step writes nothing.
inline Status run_steps(const char* what, const Plan& p, Stream stream, int group = -1) {
  for (const Step& s : p.steps)
    if (group < 0 || s.group == group) ENCORE_RETURN_IF_ERROR(check_step(what, s));
  for (const Step& s : p.steps)
    if (group < 0 || s.group == group) ENCORE_RETURN_IF_ERROR(run_step(what, s, stream));
  return Status::ok();
}

inline Status check_workspace(const void* workspace, const char* query) {
  if (workspace == nullptr) return Status::invalid(std::string("workspace: needs ") + query + " bytes, got a null pointer");
  if (!checks::aligned(workspace, 256)) return Status::invalid("workspace: must be 256-byte aligned");
  return Status::ok();
}

// A named list of tensors, for the pairwise overlap checks.
using Named = std::pair<const char*, const TensorView*>;

// No output overlaps another output or an input, but `allowed_out` may be `allowed_in` itself (same data,
// shape and strides: updated in place).
inline Status no_overlaps(const std::vector<Named>& outs, const std::vector<Named>& ins, const TensorView* allowed_out = nullptr,
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

}  // namespace encore::blocks
