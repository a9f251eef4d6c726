// The kernels' conversions, on the library's fp16/bf16 helpers (base/half.h).
#include "parallel/tensor_parallel/internal/convert.h"

#include <cstring>

#include "base/half.h"
#include "strata/base/status.h"

namespace strata::tp_internal {

bool IsKernelDataType(DataType t) {
  return t == DataType::kFloat32 || t == DataType::kFloat16 || t == DataType::kBFloat16;
}

float HalfBitsToFloat(uint16_t bits, DataType dtype) {
  return dtype == DataType::kBFloat16 ? BFloat16ToFloatScalar(bits) : HalfToFloatScalar(bits);
}

uint16_t FloatToHalfBits(float value, DataType dtype) {
  return dtype == DataType::kBFloat16 ? FloatToBFloat16Scalar(value) : FloatToHalfScalar(value);
}

void ToFloat(const void* in, DataType dtype, float* out, size_t n) {
  switch (dtype) {
    case DataType::kFloat32:
      if (n > 0) std::memcpy(out, in, n * sizeof(float));
      return;
    case DataType::kBFloat16:
      BFloat16ToFloat(static_cast<const uint16_t*>(in), out, n);
      return;
    case DataType::kFloat16:
      HalfToFloat(static_cast<const uint16_t*>(in), out, n);
      return;
    default:
      STRATA_CHECK(false, "ToFloat on ", DataTypeName(dtype));
  }
}

void FromFloat(const float* in, void* out, DataType dtype, size_t n) {
  switch (dtype) {
    case DataType::kFloat32:
      if (n > 0) std::memcpy(out, in, n * sizeof(float));
      return;
    case DataType::kBFloat16:
      FloatToBFloat16(in, static_cast<uint16_t*>(out), n);
      return;
    case DataType::kFloat16:
      FloatToHalf(in, static_cast<uint16_t*>(out), n);
      return;
    default:
      STRATA_CHECK(false, "FromFloat to ", DataTypeName(dtype));
  }
}

}  // namespace strata::tp_internal
