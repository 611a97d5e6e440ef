// Internal entry points of the quant family for tests and benchmarks (never in include/): the
// problem, the launch plan and the CUDA launcher that takes an explicit plan.
#pragma once
#include "quant/problem.hpp"
#ifdef ENCORE_WITH_CUDA
#include "quant/cuda/launch.hpp"
#endif
