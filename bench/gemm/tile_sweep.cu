// Experiment (not in the default build): the mainloop on tile configurations encore does not ship,
// against cuBLAS and the shipped ones, on the LLaMA block's GEMM shapes, with the lightest epilogue
// (D = alpha·acc, ScalarScale) and, on the shapes they serve, the shipped epilogue kernels (residual,
// row scale, SwiGLU, RoPE, LSE) timed the same way: what each epilogue costs over the bare
// mainloop. bf16. Each (shape, contender) runs kIters launches between two events on the same
// buffers (no rotation, unlike the harness); contenders rotate each round; medians over rounds. The
// plain-epilogue contenders' D is checked against cuBLAS's.
// Build: cmake --build build-cuda --target encore_tile_sweep (bench/CMakeLists.txt, EXCLUDE_FROM_ALL);
// run: build-cuda/bench/encore_tile_sweep [rounds] > out.json 2> table.txt
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "gemm/cuda/launch.hpp"
#include "gemm/cuda/programs.cuh"
#include "gemm/cuda/sm90_gemm.cuh"

using namespace encore;
using namespace encore::cuda;
namespace s = encore::cuda::sm90;

using T = cutlass::bfloat16_t;
using Coop256x128c21 = s::TileConfig<256, 128, 64, 2, 1, true>;
using Coop256x192c21 = s::TileConfig<256, 192, 64, 2, 1, true>;
using Coop256x128c11 = s::TileConfig<256, 128, 64, 1, 1, true>;

template <class Config>
Status launch_tile(const GemmProblem& p, cudaStream_t st) {
  using G = s::Sm90Gemm<T, Config, s::ScalarScale<T>>;
  return s::run_gemm<G>(p, [&] { return G::arguments(p, s::ScalarScale<T>::template arguments<typename G::Fusion>(p)); }, st, "sweep");
}

__global__ void fill(__nv_bfloat16* x, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    unsigned h = unsigned(i) * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    x[i] = __float2bfloat16((h & 0xffff) / 32768.0f - 1.0f);
  }
}

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? atoi(argv[1]) : 5;
  constexpr int kIters = 4;
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cublasHandle_t h;
  cublasCreate(&h);
  cudaStream_t st;
  cudaStreamCreate(&st);
  cublasSetStream(h, st);
  // The epilogue a shape serves in the block (besides the plain one every shape runs).
  enum Kind { kPlain, kResidual, kGateUp, kQkv, kLmHead };
  struct Shape { const char* name; int M, N, K; Kind kind; };
  const std::vector<Shape> shapes = {
      {"8B o-proj", 8192, 4096, 4096, kResidual},   {"8B gate/up", 8192, 28672, 4096, kGateUp}, {"8B down", 8192, 4096, 14336, kResidual},
      {"8B qkv", 8192, 6144, 4096, kQkv},           {"8B o-proj", 16384, 4096, 4096, kResidual}, {"8B gate/up", 16384, 28672, 4096, kGateUp},
      {"8B down", 16384, 4096, 14336, kResidual},   {"8B qkv", 16384, 6144, 4096, kQkv},         {"70B gate/up", 8192, 57344, 8192, kGateUp},
      {"70B down", 8192, 8192, 28672, kResidual},   {"LM head", 8192, 128256, 4096, kLmHead}};
  size_t maxA = 0, maxW = 0, maxD = 0;
  for (auto& sh : shapes) {
    maxA = std::max(maxA, size_t(sh.M) * sh.K), maxW = std::max(maxW, size_t(sh.N) * sh.K), maxD = std::max(maxD, size_t(sh.M) * sh.N);
  }
  __nv_bfloat16 *A, *W, *D, *R;
  float* alpha;
  cudaMalloc(&A, maxA * 2), cudaMalloc(&W, maxW * 2), cudaMalloc(&D, maxD * 2), cudaMalloc(&R, maxD * 2), cudaMalloc(&alpha, 4);
  fill<<<1024, 256, 0, st>>>(A, maxA, 1), fill<<<1024, 256, 0, st>>>(W, maxW, 2);
  // Operands of the shipped epilogues (residual C, aux, gamma, partials, pos, freq, r).
  __nv_bfloat16 *C, *Aux, *gamma;
  float *parts, *freq, *rs;
  int* pos;
  const size_t maxM = 16384, maxN = 128256;
  cudaMalloc(&C, maxD * 2), cudaMalloc(&Aux, maxD * 2), cudaMalloc(&gamma, maxN * 2), cudaMalloc(&parts, maxM * ((maxN + 127) / 128) * 4);
  cudaMalloc(&freq, maxN * 4), cudaMalloc(&rs, maxM * 4), cudaMalloc(&pos, maxM * 4);
  fill<<<1024, 256, 0, st>>>(C, maxD, 3), fill<<<1024, 256, 0, st>>>(gamma, maxN, 4);
  cudaMemsetAsync(freq, 0, maxN * 4, st), cudaMemsetAsync(pos, 0, maxM * 4, st);
  {
    std::vector<float> ones(maxM, 1.0f);
    cudaMemcpy(rs, ones.data(), maxM * 4, cudaMemcpyHostToDevice);
  }
  const float one = 1.0f, zero = 0.0f;
  cudaMemcpy(alpha, &one, 4, cudaMemcpyHostToDevice);
  cudaEvent_t e0, e1;  // around each timed batch of launches
  cudaEventCreate(&e0), cudaEventCreate(&e1);

  // A contender runs on the shapes of its kind (kPlain: all, checked against cuBLAS); tile_n: the
  // partials' column tile of the residual and LSE epilogues; swiglu: aux at half width.
  struct Contender {
    std::string name;
    std::function<Status(const GemmProblem&, cudaStream_t)> fn;
    int raster;
    Kind kind;
    int tile_n;
    bool swiglu;
  };
  std::vector<Contender> cs;
  auto add = [&](const std::string& n, std::function<Status(const GemmProblem&, cudaStream_t)> fn, Kind kind = kPlain, int tile_n = 0,
                 bool swiglu = false) {  // CUTLASS's raster heuristic and along N
    cs.push_back({n + " heur", fn, 0, kind, tile_n, swiglu});
    cs.push_back({n + " alongN", fn, 2, kind, tile_n, swiglu});
  };
  add("coop128x256 c2x1 (shipped)", launch_tile<s::Cooperative128x256>);
  add("pp128x128 c2x1 (shipped)", launch_tile<s::Pingpong128x128>);
  add("coop256x128 c2x1", launch_tile<Coop256x128c21>);
  add("coop256x192 c2x1", launch_tile<Coop256x192c21>);
  add("coop256x128 c1x1", launch_tile<Coop256x128c11>);
  auto shipped = [](Epilogue e, GemmTile t) {  // the catalogue's launcher of (epilogue, tile)
    const GemmLauncher fn = gemm_launcher(e, t);
    return [fn](const GemmProblem& q, cudaStream_t s2) { return fn(q, static_cast<Stream>(s2)); };
  };
  add("residual_sqsum_aux pp128", shipped(Epilogue::kResidualSqsumAux, GemmTile::kPingpong128x128), kResidual, 128);
  add("residual_sqsum_aux coop256", shipped(Epilogue::kResidualSqsumAux, GemmTile::kCooperative128x256), kResidual, 256);
  add("row_scale pp128", shipped(Epilogue::kRowScale, GemmTile::kPingpong128x128), kGateUp);
  add("row_scale coop256", shipped(Epilogue::kRowScale, GemmTile::kCooperative128x256), kGateUp);
  add("swiglu pp128", shipped(Epilogue::kSwiglu, GemmTile::kPingpong128x128), kGateUp, 0, true);
  add("swiglu coop256", shipped(Epilogue::kSwiglu, GemmTile::kCooperative128x256), kGateUp, 0, true);
  add("rope pp128", shipped(Epilogue::kRope, GemmTile::kPingpong128x128), kQkv);
  add("rope coop256", shipped(Epilogue::kRope, GemmTile::kCooperative128x256), kQkv);
  add("lse no D pp128", shipped(Epilogue::kLse, GemmTile::kPingpong128x128), kLmHead, 128);
  add("lse no D coop256", shipped(Epilogue::kLse, GemmTile::kCooperative128x256), kLmHead, 256);

  printf("{\"experiment\": \"tile_sweep\", \"epilogue\": \"scalar_scale\", \"iters\": %d, \"rounds\": %d, \"results\": [\n", kIters, rounds);
  bool first = true;
  for (auto& sh : shapes) {
    GemmProblem p;
    p.a = A, p.lda = sh.K, p.w = W, p.ldw = sh.K, p.d = D, p.ldd = sh.N, p.M = sh.M, p.N = sh.N, p.K = sh.K;
    p.alpha = alpha, p.swizzle = 8, p.device = 0, p.sm_count = sms;
    auto problem_for = [&](const Contender& c) {
      GemmProblem q = p;
      q.raster = c.raster;
      if (c.kind == kPlain) return q;
      q.alpha = nullptr;
      if (c.kind == kResidual) q.c = C, q.ldc = sh.N, q.aux = Aux, q.ld_aux = sh.N, q.gamma = gamma;
      if (c.kind == kGateUp || c.kind == kQkv) q.row_scale = rs;
      if (c.swiglu) q.aux = Aux, q.ld_aux = sh.N / 2;
      if (c.kind == kQkv) q.pos = pos, q.freq = freq;
      if (c.kind == kLmHead) q.d = nullptr, q.ldd = 0;
      if (c.tile_n > 0) q.partials = parts, q.ld_partials = (sh.N + c.tile_n - 1) / c.tile_n;
      return q;
    };
    auto cublas = [&](__nv_bfloat16* out) {
      cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, sh.N, sh.M, sh.K, &one, W, CUDA_R_16BF, sh.K, A, CUDA_R_16BF, sh.K, &zero, out, CUDA_R_16BF,
                   sh.N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    };
    cublas(R);
    cudaStreamSynchronize(st);
    const size_t n = size_t(sh.M) * sh.N;
    std::vector<__nv_bfloat16> ref(std::min(n, size_t(1) << 24)), got(ref.size());
    cudaMemcpy(ref.data(), R, ref.size() * 2, cudaMemcpyDeviceToHost);
    std::vector<std::string> status(cs.size(), "ok");
    for (size_t c = 0; c < cs.size(); ++c) {  // correctness, once per contender
      if (cs[c].kind != kPlain && cs[c].kind != sh.kind) { status[c] = "skip"; continue; }
      cudaMemset(D, 0xff, n * 2);
      Status s0 = cs[c].fn(problem_for(cs[c]), st);
      cudaStreamSynchronize(st);
      if (!s0.is_ok()) { status[c] = s0.message(); continue; }
      if (cs[c].kind != kPlain) continue;  // other epilogues: timed only (the library's GPU tests check them)
      cudaMemcpy(got.data(), D, got.size() * 2, cudaMemcpyDeviceToHost);
      double maxd = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        const double d = fabs(double(__bfloat162float(got[i])) - __bfloat162float(ref[i]));
        maxd = d == d ? std::max(maxd, d) : 1e30;
      }
      if (maxd > 0.5) status[c] = "WRONG max diff " + std::to_string(maxd);
    }
    std::vector<std::vector<double>> t(cs.size() + 1);
    for (int r = 0; r < rounds; ++r)
      for (size_t k = 0; k <= cs.size(); ++k) {
        const size_t c = (k + r) % (cs.size() + 1);  // contenders rotate; index cs.size() = cuBLAS
        if (c < cs.size() && status[c] != "ok") continue;
        const GemmProblem q = c < cs.size() ? problem_for(cs[c]) : p;
        auto once = [&] { c < cs.size() ? (void)cs[c].fn(q, st) : cublas(D); };
        once();  // warm-up
        cudaEventRecord(e0, st);
        for (int i = 0; i < kIters; ++i) once();
        cudaEventRecord(e1, st);
        cudaEventSynchronize(e1);
        float ms = 0;
        cudaEventElapsedTime(&ms, e0, e1);
        t[c].push_back(ms * 1000.0 / kIters);
      }
    auto med = [](std::vector<double> v) { if (v.empty()) return 0.0; std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
    const double cub = med(t[cs.size()]);
    for (size_t c = 0; c <= cs.size(); ++c) {
      if (c < cs.size() && status[c] == "skip") continue;
      const double m = med(t[c]);
      const std::string name = c < cs.size() ? cs[c].name : "cublas";
      printf("%s  {\"shape\": \"%s\", \"M\": %d, \"N\": %d, \"K\": %d, \"contender\": \"%s\", \"status\": \"%s\", \"median_us\": %.1f, \"ratio_to_cublas\": %.4f, \"rounds_us\": [",
             first ? "" : ",\n", sh.name, sh.M, sh.N, sh.K, name.c_str(), c < cs.size() ? status[c].c_str() : "ok", m, cub > 0 ? m / cub : 0.0);
      for (size_t i = 0; i < t[c].size(); ++i) printf("%s%.1f", i ? ", " : "", t[c][i]);
      printf("]}");
      first = false;
      fprintf(stderr, "%-12s M%-6d %-34s %10.1f us  %.4f  %s\n", sh.name, sh.M, name.c_str(), m, cub > 0 ? m / cub : 0.0,
              c < cs.size() ? status[c].c_str() : "");
    }
  }
  printf("\n]}\n");
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  return 0;
}
