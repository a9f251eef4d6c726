#include "comm/half_reduce.h"

#include <algorithm>

#include "base/half.h"
#include "strata/base/status.h"

namespace strata::comm_internal {
namespace {

// Elements widened at a time: two fp32 blocks of 4 KiB stay in L1.
constexpr size_t kBlock = 1024;

// The combining loops; plain enough for the vectoriser (min/max as
// selects, which become vminps/vmaxps).
STRATA_VECTOR_CLONES void Combine(ReduceOp op, const float* a, float* b, size_t n) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      for (size_t i = 0; i < n; ++i) b[i] = a[i] + b[i];
      return;
    case ReduceOp::kProd:
      for (size_t i = 0; i < n; ++i) b[i] = a[i] * b[i];
      return;
    case ReduceOp::kMin:
      for (size_t i = 0; i < n; ++i) b[i] = a[i] < b[i] ? a[i] : b[i];
      return;
    case ReduceOp::kMax:
      for (size_t i = 0; i < n; ++i) b[i] = a[i] > b[i] ? a[i] : b[i];
      return;
  }
}

template <typename T>
void Divide(T* x, size_t n, T divisor) {
  for (size_t i = 0; i < n; ++i) x[i] = x[i] / divisor;
}

}  // namespace

void HalfReduce(DataType dtype, ReduceOp op, const uint16_t* in, uint16_t* inout, size_t n) {
  STRATA_CHECK(dtype == DataType::kFloat16 || dtype == DataType::kBFloat16, "HalfReduce on dtype ",
               DataTypeName(dtype));
  const bool half = dtype == DataType::kFloat16;
  float a[kBlock];
  float b[kBlock];
  for (size_t start = 0; start < n; start += kBlock) {
    const size_t m = std::min(kBlock, n - start);
    if (half) {
      HalfToFloat(in + start, a, m);
      HalfToFloat(inout + start, b, m);
    } else {
      BFloat16ToFloat(in + start, a, m);
      BFloat16ToFloat(inout + start, b, m);
    }
    Combine(op, a, b, m);
    if (half) {
      FloatToHalf(b, inout + start, m);
    } else {
      FloatToBFloat16(b, inout + start, m);
    }
  }
}

void DivideInPlace(DataType dtype, void* data, size_t n, int divisor) {
  switch (dtype) {
    case DataType::kFloat32:
      Divide(static_cast<float*>(data), n, static_cast<float>(divisor));
      return;
    case DataType::kFloat64:
      Divide(static_cast<double*>(data), n, static_cast<double>(divisor));
      return;
    case DataType::kFloat16:
    case DataType::kBFloat16: {
      uint16_t* x = static_cast<uint16_t*>(data);
      const bool half = dtype == DataType::kFloat16;
      float f[kBlock];
      for (size_t start = 0; start < n; start += kBlock) {
        const size_t m = std::min(kBlock, n - start);
        if (half) {
          HalfToFloat(x + start, f, m);
        } else {
          BFloat16ToFloat(x + start, f, m);
        }
        Divide(f, m, static_cast<float>(divisor));
        if (half) {
          FloatToHalf(f, x + start, m);
        } else {
          FloatToBFloat16(f, x + start, m);
        }
      }
      return;
    }
    default:
      STRATA_CHECK(false, "DivideInPlace on dtype ", DataTypeName(dtype));
  }
}

}  // namespace strata::comm_internal
