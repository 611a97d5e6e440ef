// LLaMA last layer + loss, forward and backward (encore/blocks/llama_last.hpp): the block's steps 1-3 and
// its backward's stages (b)-(d) from blocks/plan.hpp, with the LM head + mean cross-entropy in place of
// the next layer's QKV + RoPE. Backend-agnostic: each step dispatches on the tensors' device.
#include "encore/blocks/llama_last.hpp"

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "blocks/plan.hpp"
#include "core/checks.hpp"
#include "encore/gemm.hpp"
#include "gemm/checks.hpp"

namespace encore {
namespace {

using namespace blocks;
using gemm::matrix;
using gemm::vector;

const char* kFwd = "llama_last_block";
const char* kBwd = "llama_last_block_backward";

// Rows of dℓ in the workspace: V padded to 16 bytes (the CUDA GEMMs' TMA rows; ce_bwd may write the
// columns [V, round_up(V, 8)) as scratch, encore/gemm.hpp).
int64_t padded(int64_t V) { return (V + 7) / 8 * 8; }

Plan plan(const LlamaLastBlockArgs& a, const LlamaLastBlockOptions& o, char* base) {
  Plan p;
  const int64_t M = a.y0.shape[0], V = a.w_lm.shape[0];
  Carve ws{base, 0, a.y0.device};
  forward_mlp_steps(p, ws, a.y0, a.x0, a.w0, a.w1, a.w2, a.gamma0, a.gamma_final, a.x1, a.z1, a.x2, a.r1, a.r2, a.h2, o.eps);
  const int ptn = gemm_partial_tile_n(Epilogue::kLse, M, V, a.y0.shape[1]);
  TensorView lparts = ws.take(DType::kFP32, M, (V + ptn - 1) / ptn), tlogit = ws.take(DType::kFP32, M), rows = ws.take(DType::kFP32, M);
  // 4: logits = r2 ⊙ (h2·W_lmᵀ), not stored: per-tile LSE and the target logit
  Step head = gemm_step("step 4 (LM head + LSE)", Epilogue::kLse);
  head.group = 3;
  head.g.a = a.h2;
  head.g.w = a.w_lm;
  head.g.row_scale = a.r2;
  head.g.partials = lparts;
  head.g.target = a.target;
  head.g.target_logit = tlogit;
  head.o.partial_tile_n = ptn;
  head.o.ignore_index = o.ignore_index;
  p.steps.push_back(head);
  Step fin;
  fin.kind = Step::kLseFinish;
  fin.name = "step 4 (lse_finish)";
  fin.group = 3;
  fin.lse = LseFinishArgs{lparts, a.lse, a.target, tlogit, rows};
  fin.ignore_index = o.ignore_index;
  p.steps.push_back(fin);
  Step mean;
  mean.kind = Step::kCeMean;
  mean.name = "step 4 (mean loss)";
  mean.group = 3;
  mean.mean = CeMeanArgs{a.target, rows, a.loss, {}, {}};
  mean.ignore_index = o.ignore_index;
  p.steps.push_back(mean);
  p.bytes = ws.off;
  return p;
}

Plan plan(const LlamaLastBlockBwdArgs& a, const LlamaLastBlockBwdOptions& o, char* base) {
  Plan p;
  const int64_t M = a.y0.shape[0], d = a.y0.shape[1], V = a.w_lm.shape[0];
  const DType t = a.y0.dtype;
  Carve ws{base, 0, a.y0.device};
  TensorView alpha = ws.take(DType::kFP32, 1), dl = ws.take(t, M, V, padded(V));
  const int ctn = gemm_partial_tile_n(Epilogue::kCeBwd, M, V, d);  // ce_bwd's partials tile
  TensorView zpart = ws.take(DType::kFP32, M, (V + ctn - 1) / ctn), zdz = ws.take(DType::kFP32, M);
  TensorView dx = ws.take(t, M, d), h = ws.take(t, M, d);  // h: x̂2⊙γf, then (c)'s x̂1⊙γ0 (dW_lm is taken before)
  TensorView gpart = column_partials(ws, M, d, V);
  Step mean;
  mean.kind = Step::kCeMean;
  mean.name = "(a) alpha = d_loss / n";
  mean.mean = CeMeanArgs{a.target, {}, {}, a.d_loss, alpha};
  mean.ignore_index = o.ignore_index;
  p.steps.push_back(mean);
  // dℓ = α·(softmax(r2 ⊙ (h2·W_lmᵀ)) − onehot), the logits recomputed; Σ z·dℓ per (row, ctn columns)
  Step ce = gemm_step("(a) ce_bwd through W_lm", Epilogue::kCeBwd);
  ce.g.a = a.h2;
  ce.g.w = a.w_lm;
  ce.g.row_scale = a.r2;
  ce.g.lse = a.lse;
  ce.g.target = a.target;
  ce.g.alpha = alpha;
  ce.g.d = dl;
  ce.g.partials = zpart;
  ce.o.partial_tile_n = ctn;
  ce.o.ignore_index = o.ignore_index;
  p.steps.push_back(ce);
  p.steps.push_back(partials_sum("(a) zdz sum", zpart, zdz, PartialsSum::kPerRow, 1.0f / float(d)));
  p.steps.push_back(rmsnorm_bwd_step("(a) rmsnorm_bwd through W_lm", dl, a.w_lm, a.x2, {}, a.gamma_final, a.r2, zdz, dx, h, gpart));
  p.steps.push_back(wgrad("(a) wgrad dW_lm", dl, h, a.dw_lm));
  p.steps.push_back(partials_sum("(a) dgamma_final sum", gpart, a.dgamma_final, PartialsSum::kPerColumn));
  stage_ffn_oproj(p, ws, {a.y0, a.w0, a.w1, a.w2, a.gamma0, a.x1, a.z1, a.r1}, dx, h, {a.d_y0, a.d_x0, a.dw0, a.dw1, a.dw2, a.dgamma0});
  p.bytes = ws.off;
  return p;
}

// Host targets: each in [0, V) or ignore_index (device targets are data: a bad one gives NaN rows).
Status check_targets(const TensorView& target, int64_t V, int ignore_index) {
  if (target.device.is_cuda()) return Status::ok();
  for (int64_t m = 0; m < target.shape[0]; ++m) {
    const int32_t y = static_cast<const int32_t*>(target.data)[m * target.strides[0]];
    if (y != ignore_index && (y < 0 || y >= V))
      return Status::invalid("target: row " + std::to_string(m) + " has target " + std::to_string(y) + ", outside [0, " + std::to_string(V) +
                             ") and not ignore_index (" + std::to_string(ignore_index) + ")");
  }
  return Status::ok();
}

// The shapes every matrix shares: M, d from y0, F from w2, V from w_lm.
struct Dims {
  int64_t M, d, F, V;
};
Status dims(const TensorView& y0, const TensorView& w2, const TensorView& w_lm, Dims* out) {
  ENCORE_RETURN_IF_ERROR(checks::present("y0", y0));
  ENCORE_RETURN_IF_ERROR(checks::ndim("y0", y0, 2, "[M, d]"));
  ENCORE_RETURN_IF_ERROR(checks::dtype_in("y0", y0, gemm::kIo));
  ENCORE_RETURN_IF_ERROR(checks::present("w2", w2));
  ENCORE_RETURN_IF_ERROR(checks::ndim("w2", w2, 2, "[d, F]"));
  ENCORE_RETURN_IF_ERROR(checks::present("w_lm", w_lm));
  ENCORE_RETURN_IF_ERROR(checks::ndim("w_lm", w_lm, 2, "[V, d]"));
  *out = {y0.shape[0], y0.shape[1], w2.shape[1], w_lm.shape[0]};
  if (out->M < 1 || out->d < 1 || out->F < 1 || out->V < 1) return Status::invalid("y0, w2, w_lm: M, d, F and V must be >= 1");
  return Status::ok();
}

// The weights and targets: the same fields in the forward's and the backward's arguments.
template <class A>
Status check_weights(const A& a, const Dims& n) {
  const std::initializer_list<DType> t = {a.y0.dtype};
  ENCORE_RETURN_IF_ERROR(matrix("w0", a.w0, n.d, n.d, "[d, d]", a.y0, t));
  ENCORE_RETURN_IF_ERROR(matrix("w1", a.w1, 2 * n.F, n.d, "[2F, d]", a.y0, t));
  ENCORE_RETURN_IF_ERROR(matrix("w2", a.w2, n.d, n.F, "[d, F]", a.y0, t));
  ENCORE_RETURN_IF_ERROR(matrix("w_lm", a.w_lm, n.V, n.d, "[V, d]", a.y0, t));
  ENCORE_RETURN_IF_ERROR(vector("gamma0", a.gamma0, n.d, "[d]", a.y0, t));
  ENCORE_RETURN_IF_ERROR(vector("gamma_final", a.gamma_final, n.d, "[d]", a.y0, t));
  return vector("target", a.target, n.M, "[M]", a.y0, {DType::kInt32});
}

// The forward's outputs, which the backward reads back (`note`: what its messages add).
template <class A>
Status check_saved(const A& a, const Dims& n, const std::string& note) {
  const std::initializer_list<DType> t = {a.y0.dtype}, f32 = {DType::kFP32};
  const std::string md = "[M, d]" + note, m2f = "[M, 2F]" + note, m = "[M]" + note;
  ENCORE_RETURN_IF_ERROR(matrix("x1", a.x1, n.M, n.d, md.c_str(), a.y0, t));
  ENCORE_RETURN_IF_ERROR(matrix("x2", a.x2, n.M, n.d, md.c_str(), a.y0, t));
  ENCORE_RETURN_IF_ERROR(matrix("z1", a.z1, n.M, 2 * n.F, m2f.c_str(), a.y0, t));
  ENCORE_RETURN_IF_ERROR(matrix("h2", a.h2, n.M, n.d, md.c_str(), a.y0, t));
  ENCORE_RETURN_IF_ERROR(vector("r1", a.r1, n.M, m.c_str(), a.y0, f32));
  ENCORE_RETURN_IF_ERROR(vector("r2", a.r2, n.M, m.c_str(), a.y0, f32));
  return vector("lse", a.lse, n.M, m.c_str(), a.y0, f32);
}

// The plan's checks after the arguments': every step's own validation on a placeholder workspace.
template <class A, class O>
Status check_plan(const char* what, const A& a, const O& o, const Dims& n) {
  ENCORE_RETURN_IF_ERROR(check_targets(a.target, n.V, o.ignore_index));
  const Plan p = plan(a, o, placeholder_workspace());
  for (const Step& s : p.steps) ENCORE_RETURN_IF_ERROR(validate_step(what, s));
  return Status::ok();
}

template <class A, class O>
size_t planned_bytes(const A& a, const O& o) {
  if (!validate(a, o)) return 0;
  return plan(a, o, nullptr).bytes;
}

template <class A, class O>
Status run_planned(const char* what, const A& a, const O& o, void* workspace, Stream stream) {
  ENCORE_RETURN_IF_ERROR(validate(a, o));
  ENCORE_RETURN_IF_ERROR(check_workspace(workspace, "workspace_bytes(args, opts)"));
  const Plan p = plan(a, o, static_cast<char*>(workspace));
  return run_steps(what, p, stream);
}

}  // namespace

Status validate(const LlamaLastBlockArgs& a, const LlamaLastBlockOptions& o) {
  Dims n;
  ENCORE_RETURN_IF_ERROR(dims(a.y0, a.w2, a.w_lm, &n));
  ENCORE_RETURN_IF_ERROR(matrix("x0", a.x0, n.M, n.d, "[M, d] (y0's shape)", a.y0, {a.y0.dtype}));
  ENCORE_RETURN_IF_ERROR(check_weights(a, n));
  ENCORE_RETURN_IF_ERROR(check_saved(a, n, ""));
  ENCORE_RETURN_IF_ERROR(vector("loss", a.loss, 1, "[1]", a.y0, {DType::kFP32}));
  if (!(o.eps >= 0.0f) || !std::isfinite(o.eps)) return Status::invalid("eps: must be finite and >= 0");
  const std::vector<Named> outs = {{"x1", &a.x1}, {"x2", &a.x2}, {"z1", &a.z1}, {"h2", &a.h2}, {"r1", &a.r1}, {"r2", &a.r2}, {"lse", &a.lse}, {"loss", &a.loss}};
  const std::vector<Named> ins = {{"y0", &a.y0}, {"x0", &a.x0}, {"w0", &a.w0}, {"w1", &a.w1}, {"w2", &a.w2}, {"gamma0", &a.gamma0},
                                  {"gamma_final", &a.gamma_final}, {"w_lm", &a.w_lm}, {"target", &a.target}};
  ENCORE_RETURN_IF_ERROR(no_overlaps(outs, ins));
  return check_plan(kFwd, a, o, n);
}

size_t workspace_bytes(const LlamaLastBlockArgs& a, const LlamaLastBlockOptions& o) { return planned_bytes(a, o); }

Status run(const LlamaLastBlockArgs& a, const LlamaLastBlockOptions& o, void* workspace, Stream stream) {
  return run_planned(kFwd, a, o, workspace, stream);
}

Status validate(const LlamaLastBlockBwdArgs& a, const LlamaLastBlockBwdOptions& o) {
  Dims n;
  ENCORE_RETURN_IF_ERROR(dims(a.y0, a.w2, a.w_lm, &n));
  const std::initializer_list<DType> t = {a.y0.dtype}, f32 = {DType::kFP32};
  ENCORE_RETURN_IF_ERROR(check_weights(a, n));
  ENCORE_RETURN_IF_ERROR(check_saved(a, n, " (saved by the forward)"));
  ENCORE_RETURN_IF_ERROR(vector("d_loss", a.d_loss, 1, "[1]", a.y0, f32));
  ENCORE_RETURN_IF_ERROR(matrix("d_y0", a.d_y0, n.M, n.d, "[M, d]", a.y0, t));
  ENCORE_RETURN_IF_ERROR(matrix("d_x0", a.d_x0, n.M, n.d, "[M, d]", a.y0, t));
  ENCORE_RETURN_IF_ERROR(matrix("dw0", a.dw0, n.d, n.d, "[d, d] (w0's shape)", a.y0, t));
  ENCORE_RETURN_IF_ERROR(matrix("dw1", a.dw1, 2 * n.F, n.d, "[2F, d] (w1's shape)", a.y0, t));
  ENCORE_RETURN_IF_ERROR(matrix("dw2", a.dw2, n.d, n.F, "[d, F] (w2's shape)", a.y0, t));
  ENCORE_RETURN_IF_ERROR(matrix("dw_lm", a.dw_lm, n.V, n.d, "[V, d] (w_lm's shape)", a.y0, t));
  ENCORE_RETURN_IF_ERROR(vector("dgamma0", a.dgamma0, n.d, "[d]", a.y0, f32));
  ENCORE_RETURN_IF_ERROR(vector("dgamma_final", a.dgamma_final, n.d, "[d]", a.y0, f32));
  const std::vector<Named> outs = {{"d_y0", &a.d_y0}, {"d_x0", &a.d_x0}, {"dw0", &a.dw0}, {"dw1", &a.dw1}, {"dw2", &a.dw2},
                                   {"dw_lm", &a.dw_lm}, {"dgamma0", &a.dgamma0}, {"dgamma_final", &a.dgamma_final}};
  const std::vector<Named> ins = {{"y0", &a.y0},         {"w0", &a.w0},     {"w1", &a.w1},         {"w2", &a.w2},   {"gamma0", &a.gamma0},
                                  {"gamma_final", &a.gamma_final}, {"w_lm", &a.w_lm}, {"target", &a.target}, {"x1", &a.x1},   {"x2", &a.x2},
                                  {"z1", &a.z1},         {"h2", &a.h2},     {"r1", &a.r1},         {"r2", &a.r2},   {"lse", &a.lse},
                                  {"d_loss", &a.d_loss}};
  ENCORE_RETURN_IF_ERROR(no_overlaps(outs, ins));
  return check_plan(kBwd, a, o, n);
}

size_t workspace_bytes(const LlamaLastBlockBwdArgs& a, const LlamaLastBlockBwdOptions& o) { return planned_bytes(a, o); }

Status run(const LlamaLastBlockBwdArgs& a, const LlamaLastBlockBwdOptions& o, void* workspace, Stream stream) {
  return run_planned(kBwd, a, o, workspace, stream);
}

}  // namespace encore
