// encore._encore_torch, the GEMM-epilogue family: C++ CompositeExplicitAutograd kernels of the
// torch.ops.encore ops whose Python kernel in python/encore/gemm.py is one launcher call (gemm_row_scale,
// gemm_scalar_scale, gemm_residual_rms_partial, gemm_swiglu, gemm_rope, gemm_qkv_head_sqsum, gemm_lse,
// gemm_epilogue, the finishers rms_final_reduce, lse_finish, partials_sum, cross_entropy_bwd(_), and the
// QK-norm + RoPE finish qk_norm_rope_ / qk_norm_rope_backward). Each allocates the outputs the launcher
// allocates (same shapes, dtypes, padded rows), fills the same GemmEpilogueArgs / GemmEpilogueOptions
// (or the finisher's Args), and raises the launcher's ValueError messages for the checks it makes itself.
#include <algorithm>
#include <array>
#include <tuple>

#include "common.hpp"
#include "encore/gemm.hpp"

namespace {

using namespace encore_torch;
using encore::Epilogue;
using encore::GemmEpilogueArgs;
using encore::GemmEpilogueOptions;
using encore::GemmTile;

constexpr std::array<GemmTile, 4> kTiles = {GemmTile::kAuto, GemmTile::kCooperative128x256, GemmTile::kPingpong128x128,
                                            GemmTile::kPingpong64x256};

// gemm.py _tile_name: the GemmTile of that name; ValueError listing the names otherwise.
GemmTile tile_of(c10::string_view tile) {
  for (GemmTile t : kTiles)
    if (tile == encore::gemm_tile_name(t)) return t;
  std::vector<std::string> names;
  for (GemmTile t : kTiles) names.emplace_back(encore::gemm_tile_name(t));
  std::sort(names.begin(), names.end());
  TORCH_CHECK_VALUE(false, "tile: one of ", py_list(names), ", got ", py_repr(tile));
}

// gemm.py _options: the options of one launch (partial_tile_n resolved by the caller).
GemmEpilogueOptions options(Epilogue e, c10::string_view tile = "auto", int64_t partial_tile_n = 0, int64_t head_dim = 128,
                            int64_t ignore_index = -100) {
  GemmEpilogueOptions o;
  o.epilogue = e;
  o.tile = tile_of(tile);
  o.partial_tile_n = to_int(partial_tile_n, "partial_tile_n");
  o.head_dim = to_int(head_dim, "head_dim");
  o.ignore_index = to_int(ignore_index, "ignore_index");
  return o;
}

// The tensors of one launch by GemmEpilogueArgs field (null: absent); fields() makes the views in the
// C++ field order, as the binding does.
struct Operands {
  const at::Tensor *a = nullptr, *w = nullptr, *d = nullptr, *aux = nullptr, *c = nullptr, *c2 = nullptr, *zdz = nullptr,
                   *gamma = nullptr, *row_scale = nullptr, *pos = nullptr, *freq = nullptr, *alpha = nullptr, *partials = nullptr,
                   *target = nullptr, *target_logit = nullptr, *lse = nullptr;
};

const at::Tensor* opt(const OptTensor& t) { return t && t->defined() ? &*t : nullptr; }
TensorView field(const at::Tensor* t, const char* name) { return t && t->defined() ? view(*t, name) : TensorView{}; }

GemmEpilogueArgs fields(const Operands& o) {
  return GemmEpilogueArgs{field(o.a, "a"),           field(o.w, "w"),         field(o.d, "d"),
                          field(o.aux, "aux"),       field(o.c, "c"),         field(o.c2, "c2"),
                          field(o.zdz, "zdz"),       field(o.gamma, "gamma"), field(o.row_scale, "row_scale"),
                          field(o.pos, "pos"),       field(o.freq, "freq"),   field(o.alpha, "alpha"),
                          field(o.partials, "partials"), field(o.target, "target"), field(o.target_logit, "target_logit"),
                          field(o.lse, "lse")};
}

// One launch: the views, then the options (gemm.py builds GemmEpilogueArgs, then _options), then the run.
void launch(const Operands& ops, Epilogue e, c10::string_view tile = "auto", int64_t partial_tile_n = 0, int64_t head_dim = 128,
            int64_t ignore_index = -100) {
  const GemmEpilogueArgs args = fields(ops);
  const GemmEpilogueOptions opts = options(e, tile, partial_tile_n, head_dim, ignore_index);
  check(encore::run(args, opts, nullptr, stream_of(*ops.a)));  // (no GEMM epilogue needs a workspace)
}

// gemm.py _mn: (M, N), N from w's rows (columns for a weight_kn row), M from a's rows (columns for a_transposed).
std::pair<int64_t, int64_t> mn(const at::Tensor& a, const at::Tensor& w, bool weight_kn = false, bool a_transposed = false) {
  TORCH_CHECK_VALUE(a.dim() == 2 && w.dim() == 2, "a, w: expected a ", a_transposed ? "[K, M]" : "[M, K]", " and w ",
                    weight_kn ? "[K, N]" : "[N, K]");
  return {a.size(a_transposed ? 1 : 0), w.size(weight_kn ? 1 : 0)};
}

// gemm.py _check_tile_n / _tile_n: the partials' tile width, partial_tile_n or (0) the epilogue's default for K = a's columns.
// A width past C++ int is refused here (TypeError, as the launcher's options refuse it), before ceil_div(n, t) overflows.
int64_t tile_width(Epilogue e, const at::Tensor& a, int64_t partial_tile_n) {
  TORCH_CHECK_VALUE(partial_tile_n >= 0, "partial_tile_n: must be positive or 0 (auto), got ", partial_tile_n);
  const int64_t t = partial_tile_n ? to_int(partial_tile_n, "partial_tile_n") : encore::gemm_partial_tile_n(e, 1, 1, a.size(1));
  TORCH_CHECK(t > 0, "partial_tile_n: no default tile width for the ", encore::epilogue_name(e), " epilogue");
  return t;
}

// gemm.py _padded_rows: an [m, n] view of rows padded to a multiple of 8 elements, in like's dtype.
at::Tensor padded_rows(const at::Tensor& like, int64_t m, int64_t n) {
  return new_empty(like, {m, (n + 7) / 8 * 8}).slice(1, 0, n);
}

std::vector<at::Tensor> present(std::initializer_list<at::Tensor> outs) {
  std::vector<at::Tensor> got;
  for (const at::Tensor& t : outs)
    if (t.defined()) got.push_back(t);
  return got;
}

// --- the GEMM-epilogue ops ------------------------------------------------------------------------------------

at::Tensor gemm_row_scale(const at::Tensor& a, const at::Tensor& w, const at::Tensor& r, c10::string_view tile) {
  const auto [m, n] = mn(a, w);
  at::Tensor d = new_empty(a, {m, n});
  launch({.a = &a, .w = &w, .d = &d, .row_scale = &r}, Epilogue::kRowScale, tile);
  return d;
}

at::Tensor gemm_scalar_scale(const at::Tensor& a, const at::Tensor& w, const at::Tensor& alpha, c10::string_view tile) {
  const auto [m, n] = mn(a, w);
  at::Tensor d = new_empty(a, {m, n});
  launch({.a = &a, .w = &w, .d = &d, .alpha = &alpha}, Epilogue::kScalarScale, tile);
  return d;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gemm_residual_rms_partial(const at::Tensor& a, const at::Tensor& w,
                                                                         const at::Tensor& residual, const at::Tensor& gamma,
                                                                         int64_t partial_tile_n) {
  const auto [m, n] = mn(a, w);
  at::Tensor d = new_empty(a, {m, n}), aux = new_empty(a, {m, n});
  const int64_t t = tile_width(Epilogue::kResidualSqsumAux, a, partial_tile_n);
  at::Tensor p = new_empty(a, {m, ceil_div(n, t)}, at::kFloat);
  launch({.a = &a, .w = &w, .d = &d, .aux = &aux, .c = &residual, .gamma = &gamma, .partials = &p},
         Epilogue::kResidualSqsumAux, "auto", t);
  return {d, aux, p};
}

std::tuple<at::Tensor, at::Tensor> gemm_swiglu(const at::Tensor& a, const at::Tensor& w, const OptTensor& r, c10::string_view tile) {
  const auto [m, n] = mn(a, w);
  at::Tensor z = new_empty(a, {m, n}), y = new_empty(a, {m, n / 2});
  launch({.a = &a, .w = &w, .d = &z, .aux = &y, .row_scale = opt(r)}, Epilogue::kSwiglu, tile);
  return {z, y};
}

at::Tensor gemm_rope(const at::Tensor& a, const at::Tensor& w, const at::Tensor& pos, const at::Tensor& freq, const OptTensor& r,
                     c10::string_view tile) {
  const auto [m, n] = mn(a, w);
  at::Tensor d = new_empty(a, {m, n});
  launch({.a = &a, .w = &w, .d = &d, .row_scale = opt(r), .pos = &pos, .freq = &freq}, Epilogue::kRope, tile);
  return d;
}

std::tuple<at::Tensor, at::Tensor> gemm_qkv_head_sqsum(const at::Tensor& a, const at::Tensor& w, int64_t head_dim) {
  const auto [m, n] = mn(a, w);
  TORCH_CHECK_VALUE(head_dim > 0, "head_dim: ", head_dim, " must be positive and divide N = ", n);
  at::Tensor d = new_empty(a, {m, n}), p = new_empty(a, {m, n / head_dim}, at::kFloat);
  launch({.a = &a, .w = &w, .d = &d, .partials = &p}, Epilogue::kQkvHeadSqsum, "auto", 0, head_dim);
  return {d, p};
}

// [partials, logits if store_logits, target_logit if target]
std::vector<at::Tensor> gemm_lse(const at::Tensor& a, const at::Tensor& w, const OptTensor& r, const OptTensor& target,
                                 bool store_logits, int64_t ignore_index, int64_t partial_tile_n) {
  const auto [m, n] = mn(a, w);
  const int64_t t = tile_width(Epilogue::kLse, a, partial_tile_n);
  at::Tensor p = new_empty(a, {m, ceil_div(n, t)}, at::kFloat);
  at::Tensor d = store_logits ? padded_rows(a, m, n) : at::Tensor();  // any vocabulary width on CUDA
  at::Tensor tl = opt(target) ? new_empty(a, {m}, at::kFloat) : at::Tensor();
  launch({.a = &a, .w = &w, .d = &d, .row_scale = opt(r), .partials = &p, .target = opt(target), .target_logit = &tl},
         Epilogue::kLse, "auto", t, 128, ignore_index);
  return present({p, d, tl});
}

// gemm.py _as_epilogue: the catalogue row of that name; ValueError listing the rows otherwise.
const encore::GemmEpilogueInfo& row_named(c10::string_view name) {
  std::vector<std::string> names;
  for (int i = 0; i < encore::gemm_epilogue_count(); ++i) {
    const encore::GemmEpilogueInfo* info = encore::gemm_epilogue_info(Epilogue(i));
    if (name == info->name) return *info;
    names.emplace_back(info->name);
  }
  TORCH_CHECK_VALUE(false, "epilogue: one of ", py_list(names), ", got ", py_repr(name));
}

// Any catalogue row by name: [d, aux, partials, target_logit], the ones the row writes (gemm.py _layout and
// _epilogue_outputs: the same shapes, D's rows padded for lse and ce_bwd).
std::vector<at::Tensor> gemm_epilogue(c10::string_view epilogue, const at::Tensor& a, const at::Tensor& w, const OptTensor& c,
                                      const OptTensor& gamma, const OptTensor& row_scale, const OptTensor& pos, const OptTensor& freq,
                                      const OptTensor& alpha, const OptTensor& target, bool store_d, int64_t partial_tile_n,
                                      int64_t head_dim, int64_t ignore_index, c10::string_view tile, const OptTensor& c2,
                                      const OptTensor& zdz, const OptTensor& lse) {
  const encore::GemmEpilogueInfo& info = row_named(epilogue);
  const uint32_t uses = info.operands;
  const bool has_d = (uses & encore::kOperandD) || ((uses & encore::kOperandDOptional) && store_d);
  const bool has_aux = uses & (encore::kOperandAux | encore::kOperandAuxHalf | encore::kOperandAuxDouble);
  const bool column = uses & encore::kOperandColumnPartials, tiles = uses & encore::kOperandTilePartials;
  const bool has_partials = column || tiles || (uses & encore::kOperandHeadPartials);
  const bool has_target_logit = (uses & encore::kOperandTarget) && opt(target);
  const auto [m, n] = mn(a, w, uses & encore::kOperandWeightKN, uses & encore::kOperandATransposed);
  const int64_t tile_n = column || tiles ? tile_width(info.epilogue, a, partial_tile_n) : 0;
  at::Tensor d, aux, p, tl;
  if (has_d) {
    const bool padded = info.epilogue == Epilogue::kLse || info.epilogue == Epilogue::kCeBwd;
    d = padded ? padded_rows(a, m, n) : new_empty(a, {m, n});
  }
  if (has_aux)
    aux = new_empty(a, {m, uses & encore::kOperandAuxHalf ? n / 2 : uses & encore::kOperandAuxDouble ? 2 * n : n});
  if (has_partials) {
    if (column)
      p = new_empty(a, {encore::gemm_column_partials_rows(m), ceil_div(n, tile_n) * tile_n}, at::kFloat);
    else if (tiles)
      p = new_empty(a, {m, ceil_div(n, tile_n)}, at::kFloat);
    else
      p = new_empty(a, {m, head_dim > 0 ? n / head_dim : 0}, at::kFloat);
  }
  if (has_target_logit) tl = new_empty(a, {m}, at::kFloat);
  launch({.a = &a, .w = &w, .d = &d, .aux = &aux, .c = opt(c), .c2 = opt(c2), .zdz = opt(zdz), .gamma = opt(gamma),
          .row_scale = opt(row_scale), .pos = opt(pos), .freq = opt(freq), .alpha = opt(alpha), .partials = &p, .target = opt(target),
          .target_logit = &tl, .lse = opt(lse)},
         info.epilogue, tile, tile_n, head_dim, ignore_index);
  return present({d, aux, p, tl});
}

// --- the finishers ----------------------------------------------------------------------------------------------

at::Tensor rms_final_reduce(const at::Tensor& partials, int64_t hidden, double eps) {
  check_dims(partials, "partials", 2, "[M, tiles]");
  at::Tensor r = new_empty(partials, {partials.size(0)}, at::kFloat);
  check(encore::run(encore::RmsFinalReduceArgs{view(partials, "partials"), view(r, "r")}, hidden, float(eps), stream_of(partials)));
  return r;
}

// [lse, loss if target]
std::vector<at::Tensor> lse_finish(const at::Tensor& partials, const OptTensor& target, const OptTensor& target_logit,
                                   int64_t ignore_index) {
  check_dims(partials, "partials", 2, "[M, tiles]");
  const int64_t m = partials.size(0);
  at::Tensor lse = new_empty(partials, {m}, at::kFloat);
  at::Tensor loss = opt(target) ? new_empty(partials, {m}, at::kFloat) : at::Tensor();
  const encore::LseFinishArgs args{view(partials, "partials"), view(lse, "lse"), view(target, "target"),
                                   view(target_logit, "target_logit"), field(&loss, "loss")};
  check(encore::run(args, to_int(ignore_index, "ignore_index"), stream_of(partials)));
  return present({lse, loss});
}

at::Tensor partials_sum(const at::Tensor& partials, bool per_column, double scale, int64_t n) {
  check_dims(partials, "partials", 2, "[rows, cols]");
  const int64_t rows = partials.size(0), cols = partials.size(1);
  TORCH_CHECK_VALUE(!per_column || (1 <= n && n <= cols), "n: must be in [1, ", cols, "] (the partials' columns), got ", n);
  at::Tensor out = new_empty(partials, {per_column ? n : rows}, at::kFloat);
  check(encore::run(encore::PartialsSumArgs{view(partials, "partials"), view(out, "out")},
                    per_column ? encore::PartialsSum::kPerColumn : encore::PartialsSum::kPerRow, float(scale), stream_of(partials)));
  return out;
}

// The cross-entropy backward into `out`: where out is not logits, the C++ API's "dlogits" is the caller's out
// and a message naming it says so (gemm.py _cross_entropy_bwd_launch).
void cross_entropy_bwd_into(const at::Tensor& logits, const at::Tensor& lse, const at::Tensor& target, const OptTensor& alpha,
                            int64_t ignore_index, const at::Tensor& out, bool in_place) {
  const encore::CrossEntropyBwdArgs args{view(logits, "logits"), view(lse, "lse"), view(target, "target"), view(alpha, "alpha"),
                                         view(out, "dlogits")};
  const encore::Status st = encore::run(args, to_int(ignore_index, "ignore_index"), stream_of(logits));
  if (!st.is_ok() && !in_place && st.code() == encore::StatusCode::kInvalidArgument && st.message().rfind("dlogits:", 0) == 0)
    TORCH_CHECK_VALUE(false, "out (dlogits)", st.message().substr(7));
  check(st);
}

at::Tensor cross_entropy_bwd(const at::Tensor& logits, const at::Tensor& lse, const at::Tensor& target, const OptTensor& alpha,
                             int64_t ignore_index) {
  // _core.empty_like: contiguous (a non-contiguous logits' layout is not kept)
  at::Tensor out = logits.is_contiguous() ? at::empty_like(logits) : at::empty_like(logits, at::MemoryFormat::Contiguous);
  cross_entropy_bwd_into(logits, lse, target, alpha, ignore_index, out, false);
  return out;
}

void cross_entropy_bwd_inplace(const at::Tensor& logits, const at::Tensor& lse, const at::Tensor& target, const OptTensor& alpha,
                               int64_t ignore_index) {
  cross_entropy_bwd_into(logits, lse, target, alpha, ignore_index, logits, true);
}

// --- QK-norm + RoPE after gemm_qkv_head_sqsum ---------------------------------------------------------------------

encore::QkNormRopeOptions qk_options(int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, double eps) {
  return {to_int(num_q_heads, "num_q_heads"), to_int(num_kv_heads, "num_kv_heads"), to_int(head_dim, "head_dim"), float(eps)};
}

void qk_norm_rope_(const at::Tensor& qkv, const at::Tensor& partials, const at::Tensor& q_weight, const at::Tensor& k_weight,
                   const at::Tensor& pos, const at::Tensor& freq, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, double eps) {
  const encore::QkNormRopeArgs args{view(qkv, "qkv"),           view(partials, "partials"), view(q_weight, "q_weight"),
                                    view(k_weight, "k_weight"), view(pos, "pos"),           view(freq, "freq")};
  check(encore::run(args, qk_options(num_q_heads, num_kv_heads, head_dim, eps), stream_of(qkv)));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> qk_norm_rope_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& partials,
                                                                     const at::Tensor& q_weight, const at::Tensor& k_weight,
                                                                     const at::Tensor& pos, const at::Tensor& freq, int64_t num_q_heads,
                                                                     int64_t num_kv_heads, int64_t head_dim, double eps) {
  check_dims(dy, "dy", 2, "[M, N]");
  const int64_t hd = std::max<int64_t>(head_dim, 0);  // a head_dim < 1 is refused by the op
  at::Tensor dx = new_empty(dy, dy.sizes()), dq = new_empty(dy, {hd}, at::kFloat), dk = new_empty(dy, {hd}, at::kFloat);
  const encore::QkNormRopeBwdArgs args{view(dy, "dy"),   view(x, "x"),       view(partials, "partials"), view(q_weight, "q_weight"),
                                       view(k_weight, "k_weight"), view(pos, "pos"), view(freq, "freq"), view(dx, "dx"),
                                       view(dq, "dq_weight"), view(dk, "dk_weight")};
  const encore::QkNormRopeOptions opts = qk_options(num_q_heads, num_kv_heads, head_dim, eps);
  const size_t nbytes = encore::workspace_bytes(args, opts);
  at::Tensor ws = nbytes ? new_empty(dy, {int64_t(nbytes)}, at::kByte) : at::Tensor();
  check(encore::run(args, opts, nbytes ? ws.data_ptr() : nullptr, stream_of(dy)));
  return {dx, dq, dk};
}

}  // namespace

TORCH_LIBRARY_IMPL(encore, CompositeExplicitAutograd, m) {
  m.impl("gemm_row_scale", &gemm_row_scale);
  m.impl("gemm_scalar_scale", &gemm_scalar_scale);
  m.impl("gemm_residual_rms_partial", &gemm_residual_rms_partial);
  m.impl("gemm_swiglu", &gemm_swiglu);
  m.impl("gemm_rope", &gemm_rope);
  m.impl("gemm_qkv_head_sqsum", &gemm_qkv_head_sqsum);
  m.impl("gemm_lse", &gemm_lse);
  m.impl("gemm_epilogue", &gemm_epilogue);
  m.impl("rms_final_reduce", &rms_final_reduce);
  m.impl("lse_finish", &lse_finish);
  m.impl("partials_sum", &partials_sum);
  m.impl("cross_entropy_bwd", &cross_entropy_bwd);
  m.impl("cross_entropy_bwd_", &cross_entropy_bwd_inplace);
  m.impl("qk_norm_rope_", &qk_norm_rope_);
  m.impl("qk_norm_rope_backward", &qk_norm_rope_backward);
}
