// Reductions of fp16 and bf16 arrays with fp32 accumulation: the kernels
// behind the MPI backend's user-defined reduction ops (MPI has no bf16,
// and its fp16 support is an extension without fp32 accumulation) and the
// Gloo backend's reduce functions (reduce.h).
//
//   HalfReduce(DataType::kBFloat16, ReduceOp::kSum, in, inout, n);
//   // inout[i] = bf16(float(in[i]) + float(inout[i])), rounded to nearest even
//
// Each call widens blocks of both inputs to fp32 with the vectorised
// conversions of base/half.h, combines them in fp32 and rounds back once,
// so a reduction over n ranks rounds n-1 times, as NCCL's does.
//
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>

#include "strata/comm/communicator.h"

namespace strata::comm_internal {

// inout[i] = op(in[i], inout[i]) for fp16 or bf16 data; `op` is sum, prod,
// min or max. CHECK-fails on other dtypes or ops (an internal error).
void HalfReduce(DataType dtype, ReduceOp op, const uint16_t* in, uint16_t* inout, size_t n);

// x[i] = x[i] / divisor, in the dtype's arithmetic (fp16/bf16 through fp32),
// for the avg reduction. Floating-point dtypes only.
void DivideInPlace(DataType dtype, void* data, size_t n, int divisor);

}  // namespace strata::comm_internal
