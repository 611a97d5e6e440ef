// The fused FP8 dispatch on CUDA (dispatch_fp8_gather.cuh) against the CPU backend's, which
// test_moe_dispatch_fp8_cpu.cpp checks against the plain dispatch + fp8_group_quant: every output
// buffer byte for byte, poison included (x_permuted 0xab, x_scales NaN past offsets[E]), on the decode
// (one block) and prefill (count then scatter) map paths, bf16 and fp32 x, power-of-two scales, a NaN
// element; rerun identity; misaligned rows refused.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "tests/common/aot_kernels.hpp"
#include "tests/common/device_buffer.hpp"
#include "tests/moe/fp8_dispatch_case.hpp"

namespace encore::test {
namespace {

class MoeDispatchFp8Gpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
    pin_aot_kernels(true);
  }
  void TearDown() override { pin_aot_kernels(false); }
};

// A device copy of each buffer of `h`, the arguments over them, and the copy back.
struct DeviceCase {
  std::vector<std::pair<void*, size_t>> host;  // (host pointer, bytes) of ids, x, counts, offsets, slot_rows, row_slots, q, scales
  DeviceBuffer mem;
  std::vector<size_t> off;
  static size_t total(const std::vector<std::pair<void*, size_t>>& h) {
    size_t n = 0;
    for (const auto& [p, b] : h) n += (b + 255) / 256 * 256 + 256;  // + 256: room for a shifted start
    return n;
  }
  explicit DeviceCase(Fp8DispatchHost& h, size_t x_shift = 0)
      : host{{h.ids.data(), h.ids.size() * 4},
             {h.x_data(), h.xf.size() * dtype_size(h.c.dtype)},
             {h.counts.data(), h.counts.size() * 4},
             {h.offsets.data(), h.offsets.size() * 4},
             {h.slot_rows.data(), h.slot_rows.size() * 4},
             {h.row_slots.data(), h.row_slots.size() * 4},
             {h.q.data(), h.q.size()},
             {h.scales.data(), h.scales.size() * 4}},
        mem(total(host) + 256) {
    size_t at = 0;
    for (size_t i = 0; i < host.size(); ++i) {
      off.push_back(at + (i == 1 ? x_shift : 0));
      at += (host[i].second + 255) / 256 * 256 + 256;
    }
    for (size_t i = 0; i < host.size(); ++i) cudaMemcpy(mem.at(off[i]), host[i].first, host[i].second, cudaMemcpyHostToDevice);
  }
  MoeDispatchArgs args(const MoeDispatchArgs& a) const {
    MoeDispatchArgs d = a;
    TensorView* v[] = {&d.topk_ids, &d.x, &d.expert_counts, &d.expert_offsets, &d.slot_rows, &d.row_slots, &d.x_permuted, &d.x_scales};
    for (size_t i = 0; i < host.size(); ++i) {
      v[i]->data = mem.at(off[i]);
      v[i]->device = Device{DeviceType::kCUDA, 0};
    }
    return d;
  }
  // The outputs back into another host case's buffers (same shapes).
  void fetch(Fp8DispatchHost& h) const {
    void* dst[] = {h.ids.data(), h.x_data(), h.counts.data(), h.offsets.data(), h.slot_rows.data(), h.row_slots.data(), h.q.data(), h.scales.data()};
    for (size_t i = 2; i < host.size(); ++i) cudaMemcpy(dst[i], mem.at(off[i]), host[i].second, cudaMemcpyDeviceToHost);
  }
};

TEST_F(MoeDispatchFp8Gpu, MatchesCpuByteForByte) {
  for (const Fp8DispatchCase& c : fp8_dispatch_cases()) {
    SCOPED_TRACE(c.name);
    const uint64_t seed = uint64_t(c.T * 7 + c.D);
    Fp8DispatchHost cpu(c, seed);
    const MoeDispatchOptions o = cpu.options();
    MoeDispatchArgs ca = cpu.args();
    cpu.ws.assign(workspace_bytes(ca, o) / 4 + 4, 0);
    ASSERT_TRUE(run(ca, o, cpu.ws.data()));

    Fp8DispatchHost gpu(c, seed);  // the same inputs, poisoned outputs
    DeviceCase dc(gpu);
    const MoeDispatchArgs ga = dc.args(gpu.args());
    DeviceBuffer ws(workspace_bytes(ga, o) + 16);
    for (int rep = 0; rep < 2; ++rep) {
      const Status st = run(ga, o, ws.ptr);
      ASSERT_TRUE(st) << st.to_string();
      ENCORE_ASSERT_CUDA(cudaDeviceSynchronize());
      Fp8DispatchHost got(c, seed);
      dc.fetch(got);
      EXPECT_EQ(got.counts, cpu.counts);
      EXPECT_EQ(got.offsets, cpu.offsets);
      EXPECT_EQ(got.slot_rows, cpu.slot_rows);
      EXPECT_EQ(got.row_slots, cpu.row_slots);
      size_t first = got.q.size();
      for (size_t i = 0; i < got.q.size() && first == got.q.size(); ++i)
        if (got.q[i] != cpu.q[i]) first = i;
      EXPECT_EQ(first, got.q.size()) << "x_permuted differs first at byte " << first << " (row " << first / size_t(c.D) << "), rep " << rep;
      EXPECT_EQ(0, std::memcmp(got.scales.data(), cpu.scales.data(), cpu.scales.size() * 4)) << "x_scales, rep " << rep;
    }
  }
}

TEST_F(MoeDispatchFp8Gpu, MisalignedRowsRefused) {
  Fp8DispatchHost h({"misaligned", 6, 2, 4, 8, 256, DType::kBF16, false}, 3);
  DeviceCase dc(h, /*x_shift=*/8);  // x starts 8 bytes into a 16-byte unit
  const MoeDispatchArgs a = dc.args(h.args());
  const Status st = validate(a, h.options());
  EXPECT_EQ(st.code(), StatusCode::kUnsupported) << st.to_string();
  EXPECT_NE(st.to_string().find("x: the fused FP8 gather on CUDA needs 16-byte aligned rows"), std::string::npos) << st.to_string();
}

}  // namespace
}  // namespace encore::test
