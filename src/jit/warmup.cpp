// The warm-up config (jit/warmup.hpp): parsing and the per-family variant lists.
#include "jit/warmup.hpp"

#include <sstream>

#include "moe/jit.hpp"
#include "norm/jit.hpp"
#include "quant/jit.hpp"

namespace encore::jit {
namespace {

struct Form {
  const char* kernel;
  size_t dims;
  const char* usage;
  bool dtype = true;  // the dtype comes first
};
constexpr Form kForms[] = {
    {"rms_norm", 1, "rms_norm <bf16|fp16|fp32> <hidden> [add]"},
    {"qk_norm", 3, "qk_norm <bf16|fp16> <head_dim 64|128|256> <q_heads> <kv_heads> [offset]"},
    {"fp8_group_quant", 1, "fp8_group_quant <bf16|fp16|fp32> <K, a multiple of 128> [group_size: 128]"},
    {"mxfp8_quant", 1, "mxfp8_quant <bf16|fp16|fp32> <K, a multiple of 32>"},
    {"nvfp4_quant", 1, "nvfp4_quant <bf16|fp16|fp32> <K, a multiple of 16>"},
    {"moe_routing", 2, "moe_routing <bf16|fp16|fp32> <experts> <top_k> [<n_group> <topk_group>]"},
    {"moe_dispatch", 2, "moe_dispatch <experts> <top_k>", false},
    {"moe_combine", 2, "moe_combine <bf16|fp16|fp32> <hidden> <top_k> [<out dtype>]"},
};

bool is_number(const std::string& w) { return !w.empty() && w.size() < 12 && w.find_first_not_of("0123456789") == std::string::npos; }

moe::RoutingJitVariant routing_variant(const WarmupLine& l) {
  return {l.dtype, int(l.dims[0]), int(l.dims[1]), l.dims.size() > 2 ? int(l.dims[2]) : 1, l.dims.size() > 3 ? int(l.dims[3]) : 1};
}
moe::CombineJitVariant combine_variant(const WarmupLine& l) {
  return {l.dtype, l.out_dtype, l.dims[0] % 8 == 0 ? 8 : 1, int(l.dims[1]), l.dims[0]};
}

bool parse_dtype(const std::string& s, DType* t) {
  if (s == "bf16") *t = DType::kBF16;
  else if (s == "fp16") *t = DType::kFP16;
  else if (s == "fp32") *t = DType::kFP32;
  else return false;
  return true;
}

// The family's own limits, as its validate() states them; "" when the line is acceptable.
std::string check(const WarmupLine& l) {
  const auto& d = l.dims;
  if (l.kernel.rfind("moe_", 0) == 0)
    for (int64_t v : d)
      if (v < 0 || v > 0x7fffffff) return "sizes must be in [0, 2^31)";  // before the int casts below
  if (l.kernel == "moe_routing") return d.size() == 3 ? "n_group and topk_group are given together" : moe::routing_jit_check(routing_variant(l));
  if (l.kernel == "moe_dispatch") return moe::dispatch_jit_check(int(d[0]), int(d[1]));
  if (l.kernel == "moe_combine") return moe::combine_jit_check(combine_variant(l));
  if (l.kernel == "rms_norm") return d[0] > 0 ? "" : "hidden must be > 0";
  if (l.kernel == "qk_norm") {
    if (l.dtype == DType::kFP32) return "qk_norm takes bf16 or fp16";
    if (d[0] != 64 && d[0] != 128 && d[0] != 256) return "head_dim must be 64, 128 or 256";
    if (d[1] < 1 || d[2] < 1) return "q_heads and kv_heads must be >= 1";
    if (d[1] + d[2] > norm::kQkNormJitMaxHeads) return "q_heads + kv_heads above " + std::to_string(norm::kQkNormJitMaxHeads) + " stay ahead-of-time";
    return "";
  }
  if (l.kernel == "mxfp8_quant" || l.kernel == "nvfp4_quant") {
    const int64_t block = l.kernel == "mxfp8_quant" ? quant::kMxfp8Block : quant::kNvfp4Block;
    if (d[0] <= 0 || d[0] % block != 0) return "K must be a positive multiple of " + std::to_string(block);
    if (d[0] > quant::kMxQuantJitMaxCols) return "K above " + std::to_string(quant::kMxQuantJitMaxCols) + " stays ahead-of-time";
    return "";
  }
  if (d.size() < 2) return "internal: no group size";
  if (d[1] != quant::kFp8GroupSize) return "group_size must be 128";
  if (d[0] <= 0 || d[0] % quant::kFp8GroupSize != 0) return "K must be a positive multiple of 128";
  if (d[0] > quant::kFp8QuantJitMaxCols) return "K above " + std::to_string(quant::kFp8QuantJitMaxCols) + " stays ahead-of-time";
  return "";
}

}  // namespace

const char* default_warmup_config() {
  return "rms_norm bf16 5184\n"
         "rms_norm bf16 5184 add\n"
         "rms_norm bf16 3000\n"
         "qk_norm bf16 128 24 4\n"
         "fp8_group_quant bf16 5248\n"
         "mxfp8_quant bf16 5248\n"
         "nvfp4_quant bf16 5248\n"
         "moe_routing bf16 160 6\n"
         "moe_routing fp32 160 6 8 3\n"
         "moe_dispatch 160 6\n"
         "moe_combine bf16 5120 6\n";
}

Status parse_warmup_config(std::istream& in, std::vector<WarmupLine>* out) {
  std::string text;
  int n = 0;
  while (std::getline(in, text)) {
    ++n;
    if (auto h = text.find('#'); h != std::string::npos) text.resize(h);
    std::istringstream ls(text);
    WarmupLine l;
    l.line = n;
    if (!(ls >> l.kernel)) continue;
    const std::string at = "line " + std::to_string(n) + ": ";
    const Form* form = nullptr;
    for (const Form& f : kForms)
      if (l.kernel == f.kernel) form = &f;
    if (!form)
      return Status::invalid(at + "unknown kernel '" + l.kernel +
                             "' (rms_norm, qk_norm, fp8_group_quant, mxfp8_quant, nvfp4_quant, moe_routing, moe_dispatch, moe_combine)");
    std::string dt, word;
    if (form->dtype && (!(ls >> dt) || !parse_dtype(dt, &l.dtype)))
      return Status::invalid(at + "expected `" + form->usage + "`: bad dtype '" + dt + "'");
    l.out_dtype = l.dtype;
    bool out_given = false;
    l.dims.resize(form->dims);
    for (auto& d : l.dims)
      if (!(ls >> d)) return Status::invalid(at + "expected `" + form->usage + "`");
    ls.clear();
    while (ls >> word) {
      if (l.kernel == "rms_norm" && word == "add" && !l.add) l.add = true;
      else if (l.kernel == "qk_norm" && word == "offset" && !l.offset) l.offset = true;
      else if (l.kernel == "fp8_group_quant" && l.dims.size() == 1 && is_number(word)) l.dims.push_back(std::stoll(word));
      else if (l.kernel == "moe_routing" && l.dims.size() < 4 && is_number(word)) l.dims.push_back(std::stoll(word));
      else if (l.kernel == "moe_combine" && !out_given && parse_dtype(word, &l.out_dtype)) out_given = true;
      else return Status::invalid(at + "unexpected '" + word + "' in `" + form->usage + "`");
    }
    if (l.kernel == "fp8_group_quant" && l.dims.size() == 1) l.dims.push_back(quant::kFp8GroupSize);
    if (std::string e = check(l); !e.empty()) return Status::invalid(at + e);
    out->push_back(l);
  }
  return Status::ok();
}

std::vector<WarmupItem> warmup_items(const WarmupLine& l, int sm_count) {
  std::vector<WarmupItem> items;
  if (l.kernel == "rms_norm") {
    for (const auto& v : norm::rms_norm_jit_variants(l.dtype, l.dims[0], l.add, sm_count))
      items.push_back({norm::rms_norm_jit_spec(v).name, [v](int dev, const std::string& arch, Origin* o, double* ms) {
                         return norm::rms_norm_jit_warmup(v, dev, arch, o, ms);
                       }});
  } else if (l.kernel == "qk_norm") {
    for (const auto& v : norm::qk_norm_jit_variants(l.dtype, int(l.dims[0]), int(l.dims[1]), int(l.dims[2]), l.offset, sm_count))
      items.push_back({norm::qk_norm_jit_spec(v).name, [v](int dev, const std::string& arch, Origin* o, double* ms) {
                         return norm::qk_norm_jit_warmup(v, dev, arch, o, ms);
                       }});
  } else if (l.kernel == "fp8_group_quant") {
    for (const auto& v : quant::fp8_group_quant_jit_variants(l.dtype, l.dims[0], sm_count))
      items.push_back({quant::fp8_group_quant_jit_spec(v).name, [v](int dev, const std::string& arch, Origin* o, double* ms) {
                         return quant::fp8_group_quant_jit_warmup(v, dev, arch, o, ms);
                       }});
  } else if (l.kernel == "moe_routing") {
    const moe::RoutingJitVariant v = routing_variant(l);
    items.push_back({moe::routing_jit_spec(v).name, [v](int dev, const std::string& arch, Origin* o, double* ms) {
                       return moe::routing_jit_warmup(v, dev, arch, o, ms);
                     }});
  } else if (l.kernel == "moe_dispatch") {
    for (const auto& v : moe::dispatch_jit_variants(int(l.dims[0]), int(l.dims[1])))
      items.push_back({moe::dispatch_jit_spec(v).name, [v](int dev, const std::string& arch, Origin* o, double* ms) {
                         return moe::dispatch_jit_warmup(v, dev, arch, o, ms);
                       }});
  } else if (l.kernel == "moe_combine") {
    const moe::CombineJitVariant v = combine_variant(l);
    items.push_back({moe::combine_jit_spec(v).name, [v](int dev, const std::string& arch, Origin* o, double* ms) {
                       return moe::combine_jit_warmup(v, dev, arch, o, ms);
                     }});
  } else if (l.kernel == "mxfp8_quant" || l.kernel == "nvfp4_quant") {
    const quant::MxQuantJitVariant v{l.kernel == "mxfp8_quant" ? quant::MxKind::kMxfp8 : quant::MxKind::kNvfp4, l.dtype, l.dims[0]};
    items.push_back({quant::mx_quant_jit_spec(v).name, [v](int dev, const std::string& arch, Origin* o, double* ms) {
                       return quant::mx_quant_jit_warmup(v, dev, arch, o, ms);
                     }});
  }
  return items;
}

}  // namespace encore::jit
