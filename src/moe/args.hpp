// Argument checks and problem builders shared by the moe family's dispatch files (routing.cpp,
// dispatch.cpp, combine.cpp, moe.cpp): the layer validates its buffers through the same functions as
// the standalone ops.
#pragma once
#include <initializer_list>
#include <utility>

#include "encore/moe.hpp"
#include "moe/problem.hpp"

namespace encore::moe {

// An int32 or fp32 [rows, cols] map with a unit last stride, disjoint rows, on ref's device.
Status check_map(const char* name, const TensorView& t, DType dtype, int64_t rows, int64_t cols, const char* layout,
                 const char* ref_name, const TensorView& ref);
// A contiguous 1-D [n] vector of `dtype` (at least n elements when at_least) on ref's device.
Status check_vector(const char* name, const TensorView& t, DType dtype, int64_t n, bool at_least, const char* what,
                    const char* ref_name, const TensorView& ref);
// A [rows, cols] bf16/fp16/fp32 matrix (dtype given: must match) with a unit last stride and disjoint rows.
Status check_rows(const char* name, const TensorView& t, int64_t rows, int64_t cols, const char* layout, const char* ref_name,
                  const TensorView& ref, const DType* dtype = nullptr);
// Pairwise no_overlap over named views (undefined views skipped).
Status no_overlaps(std::initializer_list<std::pair<const char*, const TensorView*>> views);
// The view's first n rows (dimension 0).
TensorView first_rows(TensorView t, int64_t n);

Status validate_routing_options(const MoeRoutingOptions& o, int64_t num_experts);
// Everything but the data-dependent checks (ids in range), which the layer cannot make before routing.
Status validate_dispatch_shapes(const MoeDispatchArgs& a, const MoeDispatchOptions& o);
Status validate_combine_shapes(const MoeCombineArgs& a);

RoutingProblem make_routing_problem(const MoeRoutingArgs& a, const MoeRoutingOptions& o);
DispatchProblem make_dispatch_problem(const MoeDispatchArgs& a, const MoeDispatchOptions& o, void* workspace);
CombineProblem make_combine_problem(const MoeCombineArgs& a);

}  // namespace encore::moe
