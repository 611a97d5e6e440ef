// Suite functions called by run_suites; each appends its records to the report.
#pragma once
#include <cuda_runtime.h>

#include "bench/harness.hpp"
#include "bench/report.hpp"

namespace encore::bench {

void run_norm_suite(Report& report, const TimeOptions& topts, cudaStream_t stream);
void run_norm_plans_suite(Report& report, const TimeOptions& topts, cudaStream_t stream);
void run_norm_jit_suite(Report& report, const TimeOptions& topts, cudaStream_t stream);
void run_qk_norm_suite(Report& report, const TimeOptions& topts, cudaStream_t stream);
void run_qk_norm_plans_suite(Report& report, const TimeOptions& topts, cudaStream_t stream);
void run_quant_suite(Report& report, const TimeOptions& topts, cudaStream_t stream);
void run_decode_path_suite(Report& report, const TimeOptions& topts, cudaStream_t stream);
void run_gemm_epilogue_suite(Report& report, const TimeOptions& topts, cudaStream_t stream);
void run_kda_suite(Report& report, const TimeOptions& topts, cudaStream_t stream);
void run_kda_phases_suite(Report& report, const TimeOptions& topts, cudaStream_t stream);
void run_kda_plans_suite(Report& report, const TimeOptions& topts, cudaStream_t stream);
void run_kda_bwd_suite(Report& report, const TimeOptions& topts, cudaStream_t stream);
void run_kda_decode_suite(Report& report, const TimeOptions& topts, cudaStream_t stream);  // bench/kda/bench_kda_decode.cpp
void run_kda_decode_plans_suite(Report& report, const TimeOptions& topts, cudaStream_t stream);  // bench/kda/bench_kda_decode.cpp
void run_quant_plans_suite(Report& report, const TimeOptions& topts, cudaStream_t stream);
void run_host_overhead_suite(Report& report, const TimeOptions& topts, cudaStream_t stream);
void run_moe_suite(Report& report, const TimeOptions& topts, cudaStream_t stream);
// The JIT suites of the families beyond RMSNorm: JIT against AOT on the same buffers
// (bench/norm/bench_qk_norm_jit.cpp, bench/quant/bench_fp8_group_quant_jit.cpp, bench/moe/bench_moe_jit.cpp).
void run_qk_norm_jit_suite(Report& report, const TimeOptions& topts, cudaStream_t stream);
void run_quant_jit_suite(Report& report, const TimeOptions& topts, cudaStream_t stream);
void run_moe_jit_suite(Report& report, const TimeOptions& topts, cudaStream_t stream);

}  // namespace encore::bench
