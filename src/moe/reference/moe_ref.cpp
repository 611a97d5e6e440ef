// CPU reference of MoE routing (softmax / sigmoid, optional bias and grouped top-k), dispatch (counts,
// padded offsets, slot maps, gather), the per-expert SwiGLU MLP and the fixed-order weighted combine.
#include "moe/reference/moe_ref.hpp"

#include <cmath>
#include <cstring>
#include <vector>

#include "core/fp8.hpp"

namespace encore::reference {
namespace {

// Index of the largest v[i] with allowed[i], the lowest such index on ties; -1 when none is allowed.
int best_allowed(const std::vector<double>& v, const std::vector<char>& allowed) {
  int best = -1;
  for (int i = 0; i < int(v.size()); ++i)
    if (allowed[size_t(i)] && (best < 0 || v[size_t(i)] > v[size_t(best)])) best = i;
  return best;
}


void zero_row(void* base, DType t, int64_t row, int64_t stride, int64_t cols) {
  std::memset(static_cast<char*>(base) + size_t(row * stride) * dtype_size(t), 0, size_t(cols) * dtype_size(t));
}

}  // namespace

void moe_routing(const moe::RoutingProblem& p) {
  const int E = p.num_experts;
  std::vector<double> s(static_cast<size_t>(E)), c(static_cast<size_t>(E)), gscore(static_cast<size_t>(p.n_group));
  std::vector<char> allowed(static_cast<size_t>(E)), gallowed(static_cast<size_t>(p.n_group));
  for (int64_t t = 0; t < p.tokens; ++t) {
    const int64_t row = t * p.logits_stride;
    if (p.sigmoid) {
      for (int e = 0; e < E; ++e) s[size_t(e)] = 1.0 / (1.0 + std::exp(-load_as_double(p.logits, p.logits_dtype, row + e)));
    } else {
      double m = -INFINITY, sum = 0;
      for (int e = 0; e < E; ++e) m = std::fmax(m, load_as_double(p.logits, p.logits_dtype, row + e));
      for (int e = 0; e < E; ++e) sum += s[size_t(e)] = std::exp(load_as_double(p.logits, p.logits_dtype, row + e) - m);
      for (int e = 0; e < E; ++e) s[size_t(e)] /= sum;
    }
    for (int e = 0; e < E; ++e)
      c[size_t(e)] = s[size_t(e)] + (p.bias ? load_as_double(p.bias, p.bias_dtype, e * p.bias_stride) : 0.0);
    std::fill(allowed.begin(), allowed.end(), char(1));
    if (p.n_group > 1) {
      const int size = E / p.n_group;
      for (int g = 0; g < p.n_group; ++g) gscore[size_t(g)] = moe::group_score(&c[size_t(g * size)], size, p.bias != nullptr);
      std::fill(gallowed.begin(), gallowed.end(), char(1));
      std::vector<char> kept(size_t(p.n_group), 0);
      for (int i = 0; i < p.topk_group; ++i) {
        const int g = best_allowed(gscore, gallowed);
        gallowed[size_t(g)] = 0;
        kept[size_t(g)] = 1;
      }
      for (int e = 0; e < E; ++e) allowed[size_t(e)] = kept[size_t(e / size)];
    }
    double wsum = 0;
    std::vector<double> w(size_t(p.top_k));
    for (int j = 0; j < p.top_k; ++j) {
      const int e = best_allowed(c, allowed);
      allowed[size_t(e)] = 0;
      p.topk_ids[t * p.ids_stride + j] = e;
      wsum += w[size_t(j)] = s[size_t(e)];
    }
    const double norm = p.renormalize && wsum > 0 ? wsum : 1.0;
    for (int j = 0; j < p.top_k; ++j)
      p.topk_weights[t * p.weights_stride + j] = float(w[size_t(j)] / norm * double(p.routed_scaling_factor));
  }
}

void moe_dispatch(const moe::DispatchProblem& p) {
  const int E = p.num_experts, k = p.top_k;
  for (int e = 0; e < E; ++e) p.counts[e] = 0;
  for (int64_t t = 0; t < p.tokens; ++t)
    for (int j = 0; j < k; ++j) ++p.counts[p.topk_ids[t * p.ids_stride + j]];
  p.offsets[0] = 0;
  for (int e = 0; e < E; ++e) {
    const int32_t padded = (p.counts[e] + p.align_m - 1) / p.align_m * p.align_m;
    p.offsets[e + 1] = p.offsets[e] + padded;
    p.cursors[e] = p.offsets[e];
  }
  for (int64_t r = 0; r < p.rows; ++r) p.row_slots[r] = -1;
  const size_t row_bytes = size_t(p.hidden) * dtype_size(p.dtype);
  for (int64_t t = 0; t < p.tokens; ++t)
    for (int j = 0; j < k; ++j) {
      const int32_t r = p.cursors[p.topk_ids[t * p.ids_stride + j]]++;
      p.slot_rows[t * p.slot_stride + j] = r;
      p.row_slots[r] = int32_t(t * k + j);
      if (p.x && !p.x_scales)
        std::memcpy(static_cast<char*>(p.x_permuted) + size_t(r * p.xp_stride) * dtype_size(p.dtype),
                    static_cast<const char*>(p.x) + size_t(t * p.x_stride) * dtype_size(p.dtype), row_bytes);
    }
  if (p.x && !p.x_scales)
    for (int e = 0; e < E; ++e)
      for (int32_t r = p.offsets[e] + p.counts[e]; r < p.offsets[e + 1]; ++r) zero_row(p.x_permuted, p.dtype, r, p.xp_stride, p.hidden);
  if (p.x && p.x_scales) {  // the fused FP8 gather: each row's groups of 128 as fp8_group_quant; padding rows as zero rows
    auto* q = static_cast<uint8_t*>(p.x_permuted);
    for (int32_t r = 0; r < p.offsets[E]; ++r) {
      const int32_t slot = p.row_slots[r];
      const int64_t t = slot >= 0 ? slot / k : -1;
      for (int64_t c0 = 0; c0 < p.hidden; c0 += 128)
        p.x_scales[r * p.scales_stride + c0 / 128] = fp8_quantize_group(
            128, [&](int64_t i) { return t < 0 ? 0.f : float(load_as_double(p.x, p.dtype, t * p.x_stride + c0 + i)); },
            [&](int64_t i, float v) { q[r * p.xp_stride + c0 + i] = e4m3_encode(v); }, p.fp8_power_of_two, p.fp8_eps);
    }
  }
}

void moe_expert_mlp(const moe::ExpertMlpProblem& p) {
  const int64_t D = p.hidden, F = p.intermediate;
  std::vector<double> xr(static_cast<size_t>(D)), ar(static_cast<size_t>(F));
  for (int e = 0; e < p.num_experts; ++e) {
    const int64_t w13e = e * p.w13_stride_e, w2e = e * p.w2_stride_e;
    for (int32_t r = p.offsets[e]; r < p.offsets[e] + p.counts[e]; ++r) {
      for (int64_t d = 0; d < D; ++d) xr[size_t(d)] = load_as_double(p.x_permuted, p.dtype, r * p.xp_stride + d);
      for (int64_t f = 0; f < F; ++f) {
        double g = 0, u = 0;
        for (int64_t d = 0; d < D; ++d) {
          g += xr[size_t(d)] * load_as_double(p.w13, p.dtype, w13e + f * p.w13_stride_n + d);
          u += xr[size_t(d)] * load_as_double(p.w13, p.dtype, w13e + (F + f) * p.w13_stride_n + d);
        }
        store_from_double(p.act, p.dtype, r * p.act_stride + f, g / (1.0 + std::exp(-g)) * u);
        ar[size_t(f)] = load_as_double(p.act, p.dtype, r * p.act_stride + f);  // the rounded activation
      }
      for (int64_t d = 0; d < D; ++d) {
        double y = 0;
        for (int64_t f = 0; f < F; ++f) y += ar[size_t(f)] * load_as_double(p.w2, p.dtype, w2e + d * p.w2_stride_n + f);
        store_from_double(p.y, p.dtype, r * p.y_stride + d, y);
      }
    }
    for (int32_t r = p.offsets[e] + p.counts[e]; r < p.offsets[e + 1]; ++r) {
      zero_row(p.act, p.dtype, r, p.act_stride, F);
      zero_row(p.y, p.dtype, r, p.y_stride, D);
    }
  }
}

void moe_combine(const moe::CombineProblem& p) {
  for (int64_t t = 0; t < p.tokens; ++t)
    for (int64_t d = 0; d < p.hidden; ++d) {
      float acc = 0.0f;
      for (int j = 0; j < p.top_k; ++j) {
        const int64_t r = p.slot_rows[t * p.slot_stride + j];
        acc = std::fma(p.weights[t * p.weights_stride + j], float(load_as_double(p.expert_out, p.eo_dtype, r * p.eo_stride + d)), acc);
      }
      store_from_double(p.out, p.out_dtype, t * p.out_stride + d, double(acc));
    }
}

}  // namespace encore::reference
