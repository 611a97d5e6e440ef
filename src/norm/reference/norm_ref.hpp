// CPU references for the norm family (no CUDA). fp32 element math, fp64 accumulation of sums.
#pragma once
#include "norm/problem.hpp"
#include "norm/problem.hpp"

namespace encore::reference {

// y = h * rsqrt(mean(h^2) + eps) * (w + offset), h = x (+ residual, rounded to dtype and stored).
void rms_norm(const norm::RmsNormProblem& p);

// Per-head RMSNorm of the Q and K heads of a fused QKV buffer, in place.
void qk_norm(const norm::QkNormProblem& p);

}  // namespace encore::reference
