// Argument checks shared by every op's validate(): each returns a Status whose message names the
// argument and the expectation, e.g. "x: expected 2 dimensions [rows, hidden], got [4]".
#pragma once
#include <initializer_list>
#include <string>

#include "encore/core/status.hpp"
#include "encore/core/tensor_view.hpp"

namespace encore::checks {

// Non-null data, at least one element per dimension, pointer aligned to the element size.
Status present(const char* name, const TensorView& t);
Status ndim(const char* name, const TensorView& t, int expected, const char* layout);
Status dtype_in(const char* name, const TensorView& t, std::initializer_list<DType> allowed);
Status same_dtype(const char* name, const TensorView& t, const char* ref_name, const TensorView& ref);
Status same_device(const char* name, const TensorView& t, const char* ref_name, const TensorView& ref);
Status unit_last_stride(const char* name, const TensorView& t);
Status dim_equals(const char* name, const TensorView& t, int dim, int64_t expected, const char* what);
// All rows of a 2-D view lie in memory without overlapping each other (row stride >= columns).
Status rows_disjoint(const char* name, const TensorView& t);
// The memory spans of a and b do not overlap.
Status no_overlap(const char* a_name, const TensorView& a, const char* b_name, const TensorView& b);
// The byte range [data, data + extent) spanned by a view.
size_t extent_bytes(const TensorView& t);
bool aligned(const void* p, size_t bytes);

}  // namespace encore::checks
