// The JIT pin of the ahead-of-time GPU suites of the JIT families (norm, quant, MoE): their fixtures
// run every JIT family's dispatcher on the ahead-of-time kernels (JIT is on by default for shapes
// outside the AOT lists); tests/jit covers the JIT path against these kernels and the CPU reference.
#pragma once
#include "moe/jit.hpp"
#include "norm/jit.hpp"
#include "quant/jit.hpp"

namespace encore::test {

// on: every family kOff (AOT kernels only); off: back to kEnv (ENCORE_JIT).
inline void pin_aot_kernels(bool on) {
  const jit::JitPolicy p = on ? jit::JitPolicy::kOff : jit::JitPolicy::kEnv;
  norm::set_rms_norm_jit_policy(p);
  norm::set_qk_norm_jit_policy(p);
  quant::set_fp8_group_quant_jit_policy(p);
  quant::set_mx_quant_jit_policy(p);
  moe::set_routing_jit_policy(p);
  moe::set_dispatch_jit_policy(p);
  moe::set_combine_jit_policy(p);
}

}  // namespace encore::test
