// Internal entry points of the norm family for tests and benchmarks (never in include/): the
// problems and launch plans, and the CUDA launchers that take an explicit plan.
#pragma once
#include "norm/problem.hpp"
#ifdef ENCORE_WITH_CUDA
#include "norm/cuda/launch.hpp"
#endif
