// CPU reference of FP8 e4m3 per-token-group quantization (the same formula as the CUDA kernel,
// so results agree bit for bit).
#pragma once
#include "quant/problem.hpp"

namespace encore::reference {

void fp8_group_quant(const quant::Fp8QuantProblem& p);

}  // namespace encore::reference
