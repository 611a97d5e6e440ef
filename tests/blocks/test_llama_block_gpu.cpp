// LLaMA shifted-block forward on CUDA (bf16 and fp16) against the textbook block: every output
// meets the 2x rule (docs/blocks.md, "Numerics"), max|out − ref_hi| <= 2·max|ref_lo − ref_hi| + 1e-6, with
// ref_hi the exact block in double and ref_lo the same unfused computation storing every op's
// result in the dtype (what cuBLAS + eager ops do). Outputs poisoned first; M, d, F not tile
// multiples.
#include <gtest/gtest.h>

#include <cmath>

#include "encore/blocks/llama.hpp"
#include "tests/common/device_buffer.hpp"
#include "tests/blocks/llama_block_case.hpp"

namespace encore::test {
namespace {

TEST(LlamaBlockGpu, TwoXRuleAgainstUnfusedBlock) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  auto rng = make_rng(77);
  // The second shape has F >= 12288: the down projection's partials go per 256 columns (cooperative
  // tile, gemm_partial_tile_n), the first's per 128 (ping-pong).
  for (const int64_t F : {int64_t(392), int64_t(12296)})
  for (DType t : {DType::kBF16, DType::kFP16}) {
    SCOPED_TRACE(std::string(dtype_name(t)) + " F " + std::to_string(F));
    BlockCase c(F > 1000 ? 77 : 300, 264, F, 8, 6, 64, t, rng);
    BlockTensors out(c);
    std::vector<const HostTensor*> ins = {&c.y0, &c.x0, &c.w0, &c.w1, &c.w2, &c.w3, &c.g0, &c.g1, &c.pos, &c.freq};
    std::vector<HostTensor*> outs = {&out.x1, &out.x2, &out.z1, &out.qkv, &out.r1, &out.r2};
    std::vector<std::unique_ptr<DeviceBuffer>> bufs;
    std::vector<TensorView> views;
    for (const HostTensor* h : ins) {
      bufs.push_back(std::make_unique<DeviceBuffer>(h->storage_bytes()));
      views.push_back(to_device(*h, *bufs.back()));
    }
    for (HostTensor* h : outs) {
      bufs.push_back(std::make_unique<DeviceBuffer>(h->storage_bytes()));
      views.push_back(to_device(*h, *bufs.back()));  // poisoned
    }
    LlamaBlockArgs a{views[0], views[1], views[2], views[3], views[4], views[5], views[6], views[7], views[8], views[9],
                     views[10], views[11], views[12], views[13], views[14], views[15]};
    LlamaBlockOptions o;
    const size_t ws_bytes = workspace_bytes(a, o);
    ASSERT_GT(ws_bytes, 0u);
    DeviceBuffer ws(ws_bytes);
    Status st = run(a, o, ws.ptr);
    ASSERT_TRUE(st) << st.to_string();
    ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
    for (size_t i = 0; i < outs.size(); ++i) from_device(*outs[i], *bufs[ins.size() + i]);
    const BlockOutputs hi = unfused_block(c, std::nullopt, o.eps), lo = unfused_block(c, t, o.eps);
    const std::pair<const char*, std::pair<const HostTensor*, std::pair<const std::vector<double>*, const std::vector<double>*>>> cmp[] = {
        {"x1", {&out.x1, {&hi.x1, &lo.x1}}}, {"x2", {&out.x2, {&hi.x2, &lo.x2}}}, {"z1", {&out.z1, {&hi.z1, &lo.z1}}},
        {"qkv", {&out.qkv, {&hi.qkv, &lo.qkv}}}, {"r1", {&out.r1, {&hi.r1, &lo.r1}}}, {"r2", {&out.r2, {&hi.r2, &lo.r2}}}};
    for (const auto& [name, v] : cmp) {
      const double err = max_abs_diff(*v.first, *v.second.first), base = max_abs_diff(*v.second.second, *v.second.first);
      EXPECT_LE(err, 2.0 * base + 1e-6) << name << ": fused error " << err << " vs unfused " << dtype_name(t) << " error " << base;
      std::printf("  %s %-3s fused max err %.3e, unfused %s max err %.3e (ratio %.2f)\n", dtype_name(t), name, err, dtype_name(t), base,
                  base > 0 ? err / base : 0.0);
    }
  }
}

}  // namespace
}  // namespace encore::test
