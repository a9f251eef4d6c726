// Elementwise reductions of typed host arrays, for backends that reduce on
// the CPU themselves (the Gloo backend hands them to Gloo's algorithms).
//
//   ReduceInto(DataType::kBFloat16, ReduceOp::kSum, out, a, b, n);
//   // out[i] = bf16(float(a[i]) + float(b[i])): fp32 accumulation, one rounding
//
// fp16 and bf16 combine in fp32 and round once per combination (as
// half_reduce.h); integers wrap as in C++ unsigned arithmetic; avg combines
// as a sum (the caller divides at the end, DivideInPlace).
//
// Thread-safety: pure functions.
#pragma once

#include <cstddef>

#include "strata/comm/communicator.h"

namespace strata::comm_internal {

// out[i] = op(a[i], b[i]) for i < n; `out` may be `a` or `b` (or overlap
// neither). `op` is sum, prod, min, max or avg (a sum). CHECK-fails on bool
// or an out-of-range dtype (callers validate first).
void ReduceInto(DataType dtype, ReduceOp op, void* out, const void* a, const void* b, size_t n);

}  // namespace strata::comm_internal
