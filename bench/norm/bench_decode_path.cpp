// Suite "decode_path": RMSNorm / add-RMSNorm (bf16) at decode batches (1, 4, 16 rows) under the
// three CUDA paths: one team of warps per row (kRowPerBlock), split-row in two dependent launches,
// and split-row in one cooperative launch with a grid barrier. Its result decides kAuto
// (docs/norm.md). L2-flushed; device time per call from graph replays.
#include <cstdio>
#include <string>

#include "bench/suites_internal.hpp"
#include "encore/core/device_info.hpp"
#include "encore/norm.hpp"

namespace encore::bench {

void run_decode_path_suite(Report& report, const TimeOptions& topts, cudaStream_t stream) {
  const DeviceInfo* info = nullptr;
  if (!get_device_info(0, &info)) return;
  const Device dev{DeviceType::kCUDA, 0};
  const struct {
    RmsNormPath path;
    const char* name;
  } paths[] = {{RmsNormPath::kRowPerBlock, "row_per_block"},
               {RmsNormPath::kSplitRowTwoLaunch, "split_two_launch"},
               {RmsNormPath::kSplitRowBarrier, "split_grid_barrier"}};
  void* weight = nullptr;
  check_cuda(cudaMalloc(&weight, 16384 * 2), "cudaMalloc (weight)");
  fill_random(weight, 16384, FillKind::kBF16, 7, stream);
  for (bool add : {false, true}) {
    for (int64_t hidden : {int64_t(4096), int64_t(8192), int64_t(16384)}) {
      for (int64_t rows : {int64_t(1), int64_t(4), int64_t(16)}) {
        const size_t slot = (size_t(rows * hidden) * 2 + 255) / 256 * 256;
        const int tensors = add ? 4 : 2;
        Rotation rot = make_rotation(slot * tensors, info->l2_bytes, FillKind::kBF16);
        const TensorView w = TensorView::contiguous(weight, DType::kBF16, {hidden}, dev);
        auto view = [&](long long i, int k) { return TensorView::contiguous(rot.set(i) + k * slot, DType::kBF16, {rows, hidden}, dev); };
        double base_us = 0;
        for (const auto& path : paths) {
          const RmsNormOptions o{1e-6f, 0.f, path.path};
          const AddRmsNormArgs a0{view(0, 0), view(0, 1), w, view(0, 2), view(0, 3)};
          const RmsNormArgs p0{a0.x, w, a0.residual};
          const size_t ws = add ? workspace_bytes(a0, o) : workspace_bytes(p0, o);
          void* workspace = nullptr;
          if (ws) check_cuda(cudaMalloc(&workspace, ws), "cudaMalloc (workspace)");
          Status st = add ? initialize_workspace(a0, o, workspace, stream) : initialize_workspace(p0, o, workspace, stream);
          Timing t = time_launches([&](long long i) {
            if (st) st = add ? run(AddRmsNormArgs{view(i, 0), view(i, 1), w, view(i, 2), view(i, 3)}, o, workspace, stream)
                             : run(RmsNormArgs{view(i, 0), w, view(i, 1)}, o, workspace, stream);
          }, stream, topts, rot.sets);
          check_status(st, "decode_path");
          if (workspace) cudaFree(workspace);
          if (path.path == RmsNormPath::kRowPerBlock) base_us = t.median_us;
          Record r;
          r.suite = "decode_path";
          r.name = add ? "add_rms_norm" : "rms_norm";
          r.params = {{"dtype", "bf16"}, {"rows", std::to_string(rows)}, {"hidden", std::to_string(hidden)}, {"path", path.name}};
          r.metrics = {{"time_us", t.median_us}, {"vs_row_per_block", base_us / t.median_us}};
          report.records.push_back(r);
          std::printf("  %-13s %2lld x %5lld %-18s: %7.2f us (%.2fx of row_per_block)\n", r.name.c_str(), (long long)rows,
                      (long long)hidden, path.name, t.median_us, base_us / t.median_us);
          std::fflush(stdout);
        }
        free_rotation(rot);
      }
    }
  }
  cudaFree(weight);
}

}  // namespace encore::bench
