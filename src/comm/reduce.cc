#include "comm/reduce.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "comm/half_reduce.h"
#include "strata/base/status.h"

namespace strata::comm_internal {
namespace {

template <typename T>
T Combine(ReduceOp op, T x, T y) {
  // Integer sums and products wrap (computed unsigned: no UB), as on every
  // other backend.
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        return static_cast<T>(static_cast<U>(x) + static_cast<U>(y));
      case ReduceOp::kProd:
        return static_cast<T>(static_cast<U>(x) * static_cast<U>(y));
      case ReduceOp::kMin:
        return x < y ? x : y;
      case ReduceOp::kMax:
        return x > y ? x : y;
    }
  } else {
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        return x + y;
      case ReduceOp::kProd:
        return x * y;
      case ReduceOp::kMin:
        return x < y ? x : y;
      case ReduceOp::kMax:
        return x > y ? x : y;
    }
  }
  return x;
}

template <typename T>
void Loop(ReduceOp op, void* out, const void* a, const void* b, size_t n) {
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  switch (op) {  // one loop per op, so each vectorises
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      for (size_t i = 0; i < n; ++i) o[i] = Combine(ReduceOp::kSum, x[i], y[i]);
      return;
    case ReduceOp::kProd:
      for (size_t i = 0; i < n; ++i) o[i] = Combine(ReduceOp::kProd, x[i], y[i]);
      return;
    case ReduceOp::kMin:
      for (size_t i = 0; i < n; ++i) o[i] = Combine(ReduceOp::kMin, x[i], y[i]);
      return;
    case ReduceOp::kMax:
      for (size_t i = 0; i < n; ++i) o[i] = Combine(ReduceOp::kMax, x[i], y[i]);
      return;
  }
}

void Half(DataType dtype, ReduceOp op, void* out, const void* a, const void* b, size_t n) {
  // HalfReduce is inout = op(in, inout); the ops are commutative.
  const ReduceOp o = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  uint16_t* dst = static_cast<uint16_t*>(out);
  if (out == b) {
    HalfReduce(dtype, o, static_cast<const uint16_t*>(a), dst, n);
  } else if (out == a) {
    HalfReduce(dtype, o, static_cast<const uint16_t*>(b), dst, n);
  } else {
    std::memmove(out, b, n * sizeof(uint16_t));
    HalfReduce(dtype, o, static_cast<const uint16_t*>(a), dst, n);
  }
}

}  // namespace

void ReduceInto(DataType dtype, ReduceOp op, void* out, const void* a, const void* b, size_t n) {
  switch (dtype) {
    case DataType::kFloat32:
      return Loop<float>(op, out, a, b, n);
    case DataType::kFloat64:
      return Loop<double>(op, out, a, b, n);
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return Half(dtype, op, out, a, b, n);
    case DataType::kInt8:
      return Loop<int8_t>(op, out, a, b, n);
    case DataType::kUInt8:
      return Loop<uint8_t>(op, out, a, b, n);
    case DataType::kInt16:
      return Loop<int16_t>(op, out, a, b, n);
    case DataType::kInt32:
      return Loop<int32_t>(op, out, a, b, n);
    case DataType::kInt64:
      return Loop<int64_t>(op, out, a, b, n);
    case DataType::kBool:
      break;
  }
  STRATA_CHECK(false, "ReduceInto on dtype ", DataTypeName(dtype));
}

}  // namespace strata::comm_internal
