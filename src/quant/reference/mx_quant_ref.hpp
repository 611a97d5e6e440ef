// CPU reference of MXFP8 / NVFP4 quantization and dequantization (the definition the CUDA kernels are to match bit for bit).
#pragma once
#include "quant/problem.hpp"

namespace encore::reference {

void mx_quant(const quant::MxProblem& p);
void mx_dequant(const quant::MxProblem& p);

}  // namespace encore::reference
