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
#include "blocks/plan.hpp"
#include "gemm/checks.hpp"

namespace encore {
namespace {

using namespace blocks;

// Stage (a): rope_bwd_zdz, rmsnorm_bwd through w3 (accumulating dx_prev), wgrad dw3, dγ.
void stage_a(Plan& p, Carve& ws, const TensorView& qkv, const TensorView& d_qkv, const TensorView& pos, const TensorView& freq,
             const TensorView& w3, const TensorView& x, const TensorView& r, const TensorView& gamma, const TensorView& dx_prev,
             const TensorView& dx, const TensorView& h, const TensorView& dw3, const TensorView& dgamma, int64_t M, int64_t d, int64_t N) {
  const DType t = qkv.dtype;
  TensorView dz2 = ws.take(t, M, N), zdz2 = ws.take(DType::kFP32, M);
  TensorView part = column_partials(ws, M, d, N);
  Step rope;
  rope.kind = Step::kRope;
  rope.name = "stage (a) rope_bwd_zdz";
  rope.rope = RopeBwdZdzArgs{qkv, d_qkv, pos, freq, dz2, zdz2};
  rope.scale = 1.0f / float(d);
  p.steps.push_back(rope);
  p.steps.push_back(rmsnorm_bwd_step("stage (a) rmsnorm_bwd through w3", dz2, w3, x, dx_prev, gamma, r, zdz2, dx, h, part));
  p.steps.push_back(wgrad("stage (a) wgrad dw3", dz2, h, dw3));
  p.steps.push_back(partials_sum("stage (a) dgamma sum", part, dgamma, PartialsSum::kPerColumn));
}

Plan plan(const LlamaBlockBwdArgs& a, char* base) {
  Plan p;
  const int64_t M = a.y0.shape[0], d = a.y0.shape[1], N = a.w3.shape[0];
  const DType t = a.y0.dtype;
  Carve ws{base, 0, a.y0.device};
  TensorView dx = ws.take(t, M, d), h = ws.take(t, M, d);  // h: x̂2⊙γ1 in (a), then x̂1⊙γ0 in (c)
  stage_a(p, ws, a.qkv, a.d_qkv, a.pos, a.freq, a.w3, a.x2, a.r2, a.gamma1, a.d_x2, dx, h, a.dw3, a.dgamma1, M, d, N);
  stage_ffn_oproj(p, ws, {a.y0, a.w0, a.w1, a.w2, a.gamma0, a.x1, a.z1, a.r1}, dx, h, {a.d_y0, a.d_x0, a.dw0, a.dw1, a.dw2, a.dgamma0});
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

using gemm::matrix;
using gemm::vector;

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
  const Plan p = plan(a, placeholder_workspace());
  for (const Step& s : p.steps) ENCORE_RETURN_IF_ERROR(validate_step(kBlock, s));
  return Status::ok();
}

size_t workspace_bytes(const LlamaBlockBwdArgs& a) {
  if (!validate(a)) return 0;
  return plan(a, nullptr).bytes;
}

Status run(const LlamaBlockBwdArgs& a, void* workspace, Stream stream) {
  ENCORE_RETURN_IF_ERROR(validate(a));
  ENCORE_RETURN_IF_ERROR(check_workspace(workspace, "workspace_bytes(args)"));
  const Plan p = plan(a, static_cast<char*>(workspace));
  return run_steps(kBlock, p, stream);
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
  const Plan p = plan(a, placeholder_workspace());
  for (const Step& s : p.steps) ENCORE_RETURN_IF_ERROR(validate_step(kQkv, s));
  return Status::ok();
}

size_t workspace_bytes(const QkvNormBwdArgs& a) {
  if (!validate(a)) return 0;
  return plan(a, nullptr).bytes;
}

Status run(const QkvNormBwdArgs& a, void* workspace, Stream stream) {
  ENCORE_RETURN_IF_ERROR(validate(a));
  ENCORE_RETURN_IF_ERROR(check_workspace(workspace, "workspace_bytes(args)"));
  const Plan p = plan(a, static_cast<char*>(workspace));
  return run_steps(kQkv, p, stream);
}

}  // namespace encore
