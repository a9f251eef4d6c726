// Typed buffers and exact references for collective tests (the conformance
// suite and the multirank tests).
//
// Inputs are small integers (or +-1 and 2 for products), so every sum,
// product, min and max is exact in every dtype, including fp16, bf16 and
// int8; avg is checked against the sum divided in double and rounded to the
// dtype, which equals the backend's fp32 (or fp64) division exactly. So
// results are compared for equality, element by element.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "base/half.h"
#include "strata/comm/communicator.h"

namespace strata::testing {

inline constexpr DataType kTestedDataTypes[] = {
    DataType::kFloat32, DataType::kFloat64, DataType::kFloat16, DataType::kBFloat16,
    DataType::kInt8,    DataType::kUInt8,   DataType::kInt32,   DataType::kInt64};
inline constexpr ReduceOp kAllReduceOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin,
                                             ReduceOp::kMax, ReduceOp::kAvg};

// A buffer of `count` elements of `dtype`.
class TypedBuffer {
 public:
  TypedBuffer(DataType dtype, size_t count)
      : dtype_(dtype), count_(count), bytes_(count * DataTypeSize(dtype) + 1) {}
  DataType dtype() const { return dtype_; }
  size_t count() const { return count_; }
  void* data() { return bytes_.data(); }
  Buffer buffer() { return Buffer{data(), count_, dtype_}; }
  // A view of elements [offset, offset + n).
  Buffer slice(size_t offset, size_t n) {
    return Buffer{bytes_.data() + offset * DataTypeSize(dtype_), n, dtype_};
  }

  void Set(size_t i, double v) {
    char* p = bytes_.data() + i * DataTypeSize(dtype_);
    switch (dtype_) {
      case DataType::kFloat32:
        Store(p, static_cast<float>(v));
        break;
      case DataType::kFloat64:
        Store(p, v);
        break;
      case DataType::kFloat16:
        Store(p, FloatToHalfScalar(static_cast<float>(v)));
        break;
      case DataType::kBFloat16:
        Store(p, FloatToBFloat16Scalar(static_cast<float>(v)));
        break;
      case DataType::kInt8:
        Store(p, static_cast<int8_t>(v));
        break;
      case DataType::kUInt8:
        Store(p, static_cast<uint8_t>(v));
        break;
      case DataType::kInt32:
        Store(p, static_cast<int32_t>(v));
        break;
      case DataType::kInt64:
        Store(p, static_cast<int64_t>(v));
        break;
      case DataType::kInt16:
        Store(p, static_cast<int16_t>(v));
        break;
      case DataType::kBool:
        Store(p, static_cast<uint8_t>(v != 0));
        break;
    }
  }
  double Get(size_t i) const {
    const char* p = bytes_.data() + i * DataTypeSize(dtype_);
    switch (dtype_) {
      case DataType::kFloat32:
        return Load<float>(p);
      case DataType::kFloat64:
        return Load<double>(p);
      case DataType::kFloat16:
        return HalfToFloatScalar(Load<uint16_t>(p));
      case DataType::kBFloat16:
        return BFloat16ToFloatScalar(Load<uint16_t>(p));
      case DataType::kInt8:
        return Load<int8_t>(p);
      case DataType::kUInt8:
        return Load<uint8_t>(p);
      case DataType::kInt32:
        return Load<int32_t>(p);
      case DataType::kInt64:
        return static_cast<double>(Load<int64_t>(p));
      case DataType::kInt16:
        return Load<int16_t>(p);
      case DataType::kBool:
        return Load<uint8_t>(p);
    }
    return 0;
  }

 private:
  template <typename T>
  static void Store(char* p, T v) {
    std::memcpy(p, &v, sizeof(T));
  }
  template <typename T>
  static T Load(const char* p) {
    T v;
    std::memcpy(&v, p, sizeof(T));
    return v;
  }

  DataType dtype_;
  size_t count_;
  std::vector<char> bytes_;  // one spare byte so that count 0 has a non-null pointer
};

// The input of `rank` at element `i` for reductions with `op`.
inline double InputValue(int rank, int size, size_t i, ReduceOp op, DataType dtype) {
  const bool is_unsigned = dtype == DataType::kUInt8;
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: {
      const long v = static_cast<long>((static_cast<size_t>(rank) * 7 + i * 13) % 7);
      return is_unsigned ? v % 4 : v - 3;
    }
    case ReduceOp::kProd: {
      // One rank contributes 2, the others +-1: the product is +-2 or +-1.
      if (i % static_cast<size_t>(size) == static_cast<size_t>(rank)) return 2;
      return (!is_unsigned && (static_cast<size_t>(rank) + i) % 3 == 0) ? -1 : 1;
    }
    case ReduceOp::kMin:
    case ReduceOp::kMax: {
      const long v = static_cast<long>((static_cast<size_t>(rank) * 5 + i * 3) % 11);
      return is_unsigned ? v : v - 5;
    }
  }
  return 0;
}

// A distinct value per (rank, element), exact in every dtype (for data
// movement: broadcast, gather, all-to-all, p2p).
inline double MoveValue(int rank, size_t i, DataType dtype) {
  const long v = static_cast<long>((static_cast<size_t>(rank) * 31 + i * 7) % 101);
  return dtype == DataType::kUInt8 ? v : v - 50;
}

// The value `x` rounded to `dtype` as the backend's arithmetic would.
inline double RoundTo(double x, DataType dtype) {
  TypedBuffer b(dtype, 1);
  b.Set(0, x);
  return b.Get(0);
}

// The reduction of InputValue over `size` ranks at element `i`.
inline double Reference(int size, size_t i, ReduceOp op, DataType dtype) {
  double acc = InputValue(0, size, i, op, dtype);
  for (int r = 1; r < size; ++r) {
    const double v = InputValue(r, size, i, op, dtype);
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        acc += v;
        break;
      case ReduceOp::kProd:
        acc *= v;
        break;
      case ReduceOp::kMin:
        acc = v < acc ? v : acc;
        break;
      case ReduceOp::kMax:
        acc = v > acc ? v : acc;
        break;
    }
  }
  if (op == ReduceOp::kAvg) {
    // fp16/bf16 divide in fp32: round to fp32 first (exact double rounding
    // for these operands), then to the dtype.
    const double q = acc / size;
    return RoundTo(dtype == DataType::kFloat64 ? q : static_cast<double>(static_cast<float>(q)),
                   dtype);
  }
  return acc;
}

inline bool IsInteger(DataType t) { return !IsFloatingPoint(t); }

// Compares got(i) with want(i) for every i < n and reports the first
// mismatch. Use with EXPECT_TRUE, not ASSERT: a rank that leaves a test
// early would stop issuing the collectives the others wait in.
template <typename Got, typename Want>
::testing::AssertionResult AllEqual(size_t n, Got got, Want want) {
  for (size_t i = 0; i < n; ++i) {
    const double g = got(i), w = want(i);
    if (g != w) {
      return ::testing::AssertionFailure() << "element " << i << ": got " << g << ", want " << w;
    }
  }
  return ::testing::AssertionSuccess();
}

// "allreduce fp16 sum n=1023 in-place" for failure messages.
inline std::string Case(const char* op, DataType t, size_t n, const char* extra = "") {
  return std::string(op) + " " + DataTypeName(t) + " n=" + std::to_string(n) + " " + extra;
}

}  // namespace strata::testing
