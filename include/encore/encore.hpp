// encore — umbrella header: every public header of the library (core types and the op families).
// Framework-free and CUDA-free; link encore::encore (find_package(encore CONFIG), docs/install.md).
#pragma once

#include "encore/core/device_info.hpp"
#include "encore/core/dtype.hpp"
#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"

#include "encore/blocks/llama.hpp"
#include "encore/blocks/llama_last.hpp"
#include "encore/gemm.hpp"
#include "encore/kda.hpp"
#include "encore/kda_serving.hpp"
#include "encore/moe.hpp"
#include "encore/moe_ep.hpp"
#include "encore/norm.hpp"
#include "encore/quant.hpp"
