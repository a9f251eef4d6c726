// Element conversions for the CPU tensor-parallel kernels (over base/half.h), which compute
// fp16 and bf16 data in fp32: widen the operands, run the fp32 BLAS GEMM,
// narrow the result once (round to nearest even).
//
//   std::vector<float> x(n);
//   tp_internal::ToFloat(input.data, input.dtype, x.data(), n);
//   tp_internal::FromFloat(x.data(), output.data, output.dtype, n);
//
// Private to the library. Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>

#include "strata/base/dtype.h"

namespace strata::tp_internal {

// True for the dtypes the kernels compute on: fp32, fp16, bf16.
bool IsKernelDataType(DataType t);

// n elements of `in` (fp32, fp16 or bf16) widened to fp32 (exactly).
void ToFloat(const void* in, DataType dtype, float* out, size_t n);
// n fp32 values narrowed to `dtype` (fp32: copied), round to nearest even.
void FromFloat(const float* in, void* out, DataType dtype, size_t n);

// One element of a 16-bit type, for loops that read a single value.
float HalfBitsToFloat(uint16_t bits, DataType dtype);
uint16_t FloatToHalfBits(float value, DataType dtype);

}  // namespace strata::tp_internal
