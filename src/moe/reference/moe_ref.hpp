// CPU reference of the moe family (routing in fp64, dispatch as exact data movement, the per-expert
// SwiGLU MLP in fp64 with the activation rounded to the storage dtype, combine in fp32 with one fma per
// slot in slot order): the semantics the CUDA kernels are to reproduce (include/encore/moe.hpp).
#pragma once
#include "moe/problem.hpp"

namespace encore::reference {

void moe_routing(const moe::RoutingProblem& p);
void moe_dispatch(const moe::DispatchProblem& p);
void moe_expert_mlp(const moe::ExpertMlpProblem& p);
void moe_combine(const moe::CombineProblem& p);

}  // namespace encore::reference
