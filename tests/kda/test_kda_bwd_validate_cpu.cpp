// KDA backward argument checks that need no device: views that claim a CUDA device over host memory
// (never read: every case here is refused before a launch), and CPU-backend gradient shapes. The
// CUDA backward's refusals: missing residuals (naming the missing ones), residual dtypes, shapes of
// the residuals of a forward with other cu_seqlens, gradient dtypes and layouts, fp32-only states,
// K, V > 256, the workspace size query.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "encore/kda.hpp"

namespace encore::test {
namespace {

constexpr Device kCuda{DeviceType::kCUDA, 0};

// Host storage behind "CUDA" views: contiguous tensors of the given shapes.
struct FakeCuda {
  std::vector<std::vector<float>> store;
  TensorView t(DType dt, std::initializer_list<int64_t> shape) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    store.emplace_back(size_t(n) * 2 + 4, 0.f);  // fp64 fits too
    return TensorView::contiguous(store.back().data(), dt, shape, kCuda);
  }
};

struct BwdArgs {
  FakeCuda mem;
  KdaBackwardArgs b;
  KdaOptions o;
  int64_t T = 130, H = 2, K = 64, V = 32;
  std::vector<int64_t> cu = {0, 60, 130};
  // in: the dtype of q, k, v, beta, d_o and the gradients (bf16: the second backward; fp32: the first)
  explicit BwdArgs(int64_t k = 64, int64_t v = 32, DType in = DType::kBF16) : K(k), V(v) {
    const DType bf = in;
    b.fwd.q = mem.t(bf, {1, T, H, K});
    b.fwd.k = mem.t(bf, {1, T, H, K});
    b.fwd.v = mem.t(bf, {1, T, H, V});
    b.fwd.g = mem.t(DType::kFP32, {1, T, H, K});
    b.fwd.beta = mem.t(bf, {1, T, H});
    b.fwd.cu_seqlens = TensorView::contiguous(cu.data(), DType::kInt64, {3});
    b.fwd.residuals.G = mem.t(DType::kFP32, {1, T, H, K});
    b.fwd.residuals.Aqk = mem.t(DType::kBF16, {1, T, H, 64});
    b.fwd.residuals.Akk = mem.t(DType::kBF16, {1, T, H, 64});
    b.fwd.residuals.h = mem.t(DType::kBF16, {3, H, K, V});  // chunks: 1 + 2
    b.d_o = mem.t(bf, {1, T, H, V});
    b.dq = mem.t(bf, {1, T, H, K});
    b.dk = mem.t(bf, {1, T, H, K});
    b.dv = mem.t(bf, {1, T, H, V});
    b.dg = mem.t(bf, {1, T, H, K});
    b.dbeta = mem.t(bf, {1, T, H});
  }
  // The status of run() with a (never touched) 16-byte aligned workspace.
  std::string refusal() {
    alignas(16) static unsigned char ws[16];
    const Status s = run(b, o, ws);
    EXPECT_FALSE(s.is_ok()) << "accepted";
    return s.to_string();
  }
};

#define EXPECT_REFUSED(setup, text) \
  do {                              \
    const std::string r_ = (setup).refusal(); \
    EXPECT_NE(r_.find(text), std::string::npos) << r_; \
  } while (0)

// The first backward (fp32 inputs; fp16 without h) reads the caller's Aqk and Akk: their absence is named.
TEST(KdaBwdValidate, MissingResidualsNamed) {
  BwdArgs s(64, 32, DType::kFP32);
  s.b.fwd.residuals = {};
  EXPECT_REFUSED(s, "residuals: the CUDA backward needs the forward's residuals Aqk, Akk for fp32 inputs");
  EXPECT_REFUSED(s, "missing: Aqk, Akk");
  BwdArgs s2(64, 32, DType::kFP32);
  s2.b.fwd.residuals.Aqk = TensorView{};
  EXPECT_REFUSED(s2, "missing: Aqk");
  BwdArgs s3(64, 32, DType::kFP16);  // fp16 without h: the first backward
  s3.b.fwd.residuals.h = TensorView{};
  s3.b.fwd.residuals.Akk = TensorView{};
  EXPECT_REFUSED(s3, "missing: Akk");
}

// The second backward (bf16 inputs; fp16 with h) re-runs the forward for absent Aqk, Akk and h: no residual is
// refused for its absence (these host views are then refused as not device memory, or the build has no CUDA).
TEST(KdaBwdValidate, SecondBackwardTakesAbsentResiduals) {
  for (DType in : {DType::kBF16, DType::kFP16}) {
    BwdArgs s(64, 32, in);
    const TensorView h = s.b.fwd.residuals.h;
    s.b.fwd.residuals = {};
    if (in == DType::kFP16) s.b.fwd.residuals.h = h;
    const std::string r = s.refusal();
    EXPECT_EQ(r.find("residuals"), std::string::npos) << r;
  }
}

TEST(KdaBwdValidate, ResidualShapesAndDtypes) {
  {
    BwdArgs s;  // h of a forward with other cu_seqlens (2 chunks instead of 3)
    s.b.fwd.residuals.h = s.mem.t(DType::kBF16, {2, s.H, s.K, s.V});
    EXPECT_REFUSED(s, "residuals.h");
  }
  {
    BwdArgs s;
    s.b.fwd.residuals.Aqk = s.mem.t(DType::kBF16, {1, s.T, s.H, 32});
    EXPECT_REFUSED(s, "residuals.Aqk");
  }
  {
    BwdArgs s;
    s.b.fwd.residuals.Akk = s.mem.t(DType::kFP64, {1, s.T, s.H, 64});
    EXPECT_REFUSED(s, "residuals.Akk");
  }
  {
    BwdArgs s;
    s.b.fwd.residuals.G = s.mem.t(DType::kBF16, {1, s.T, s.H, s.K});
    EXPECT_REFUSED(s, "residuals.G");
  }
}

TEST(KdaBwdValidate, GradientShapesDtypesDevices) {
  {
    BwdArgs s;
    s.b.dq = s.mem.t(DType::kBF16, {1, s.T, s.H, s.K + 1});
    EXPECT_REFUSED(s, "dq");
  }
  {
    BwdArgs s;
    s.b.dk = s.mem.t(DType::kFP64, {1, s.T, s.H, s.K});
    EXPECT_REFUSED(s, "dk");
  }
  {
    BwdArgs s;  // dv on the host while q is on CUDA
    static std::vector<float> host(size_t(130 * 2 * 32));
    s.b.dv = TensorView::contiguous(host.data(), DType::kFP32, {1, s.T, s.H, s.V});
    EXPECT_REFUSED(s, "dv");
  }
  {
    BwdArgs s;
    s.b.d_o = s.mem.t(DType::kFP64, {1, s.T, s.H, s.V});
    EXPECT_REFUSED(s, "d_o");
  }
  {
    BwdArgs s;
    s.b.dbeta = s.mem.t(DType::kBF16, {1, s.T, s.H + 1});
    EXPECT_REFUSED(s, "dbeta");
  }
  {
    BwdArgs s;  // a non-unit last stride
    TensorView g = s.mem.t(DType::kBF16, {1, s.T, s.H, 2 * s.K});
    g.shape = {1, s.T, s.H, s.K};
    g.strides = {s.T * s.H * 2 * s.K, s.H * 2 * s.K, 2 * s.K, 2};
    s.b.dg = g;
    EXPECT_REFUSED(s, "dg");
  }
  {
    BwdArgs s;  // dh0 without an initial state
    s.b.dh0 = s.mem.t(DType::kFP32, {2, s.H, s.K, s.V});
    EXPECT_REFUSED(s, "dh0");
  }
  {
    BwdArgs s;  // states are fp32 on CUDA
    s.b.d_final_state = s.mem.t(DType::kFP64, {2, s.H, s.K, s.V});
    EXPECT_REFUSED(s, "d_final_state");
  }
}

TEST(KdaBwdValidate, HeadDimLimitAndWorkspace) {
  BwdArgs big(300, 32);  // 128 < K, V <= 256 take the token-recurrent path (kda_recurrent_bwd.cu)
  big.b.fwd.residuals.h = big.mem.t(DType::kBF16, {3, big.H, big.K, big.V});
  EXPECT_REFUSED(big, "exceeds 256");
  BwdArgs s;
  const Status st = run(s.b, s.o, nullptr);
  EXPECT_FALSE(st.is_ok());
#ifdef ENCORE_WITH_CUDA
  EXPECT_NE(st.to_string().find("workspace"), std::string::npos) << st.to_string();
  const size_t saved = workspace_bytes(s.b, s.o);
  s.b.fwd.residuals.h = TensorView{};
  const size_t remat = workspace_bytes(s.b, s.o);
  EXPECT_GT(saved, size_t(0));  // bf16 with saved states: the second backward's bf16 intermediates
  EXPECT_GT(remat, size_t(0));  // rematerializing: the first backward's records and the chunk-start states
  EXPECT_NE(remat, saved);      // two backwards, two workspace layouts (kda_backward_kernels)
#endif
}

TEST(KdaBwdValidate, CpuWorkspaceQueryIsZero) {
  std::vector<double> x(64, 0.0);
  KdaBackwardArgs b;
  b.fwd.q = TensorView::contiguous(x.data(), DType::kFP64, {1, 1, 1, 8});
  EXPECT_EQ(workspace_bytes(b, KdaOptions{}), size_t(0));
}

}  // namespace
}  // namespace encore::test
