// The fp16/bf16 reduction kernels behind the MPI and Gloo backends'
// reductions: each element is combined in fp32 and rounded once, for every op,
// across block boundaries.
#include "comm/half_reduce.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "base/half.h"

namespace strata::comm_internal {
namespace {

float Decode(DataType t, uint16_t v) {
  return t == DataType::kFloat16 ? HalfToFloatScalar(v) : BFloat16ToFloatScalar(v);
}
uint16_t Encode(DataType t, float v) {
  return t == DataType::kFloat16 ? FloatToHalfScalar(v) : FloatToBFloat16Scalar(v);
}

float Apply(ReduceOp op, float a, float b) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return a + b;
    case ReduceOp::kProd:
      return a * b;
    case ReduceOp::kMin:
      return a < b ? a : b;
    case ReduceOp::kMax:
      return a > b ? a : b;
  }
  return 0;
}

TEST(HalfReduceTest, CombinesInFp32AndRoundsOnce) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> value(-100.0f, 100.0f);
  for (DataType t : {DataType::kFloat16, DataType::kBFloat16}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax}) {
      // 2500 elements: two full blocks of 1024 and a partial one.
      const size_t n = 2500;
      std::vector<uint16_t> in(n), inout(n), want(n);
      for (size_t i = 0; i < n; ++i) {
        in[i] = Encode(t, value(rng));
        inout[i] = Encode(t, value(rng));
        want[i] = Encode(t, Apply(op, Decode(t, in[i]), Decode(t, inout[i])));
      }
      HalfReduce(t, op, in.data(), inout.data(), n);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(inout[i], want[i]) << DataTypeName(t) << " " << ReduceOpName(op) << " at " << i;
      }
    }
  }
}

TEST(HalfReduceTest, RoundsEachCombinationToNearestEven) {
  // 2048 + 1 = 2049 lies halfway between the fp16 neighbours 2048 and 2050:
  // a single round-to-nearest-even gives 2048.
  uint16_t a = FloatToHalfScalar(2048.0f), one = FloatToHalfScalar(1.0f);
  HalfReduce(DataType::kFloat16, ReduceOp::kSum, &one, &a, 1);
  EXPECT_EQ(HalfToFloatScalar(a), 2048.0f);
  // 300 * 300 = 90000 is past fp16's largest value (65504): infinity.
  uint16_t x = FloatToHalfScalar(300.0f), y = FloatToHalfScalar(300.0f);
  HalfReduce(DataType::kFloat16, ReduceOp::kProd, &x, &y, 1);
  EXPECT_TRUE(std::isinf(HalfToFloatScalar(y)));
  // bf16 has fp32's range: the same product is finite, rounded once.
  uint16_t bx = FloatToBFloat16Scalar(300.0f), by = FloatToBFloat16Scalar(300.0f);
  HalfReduce(DataType::kBFloat16, ReduceOp::kProd, &bx, &by, 1);
  EXPECT_EQ(by, FloatToBFloat16Scalar(90000.0f));
}

TEST(HalfReduceTest, DivideForAverage) {
  std::vector<float> f = {3.0f, -7.0f, 1.0f};
  DivideInPlace(DataType::kFloat32, f.data(), f.size(), 2);
  EXPECT_EQ(f, (std::vector<float>{1.5f, -3.5f, 0.5f}));
  std::vector<double> d = {1.0, 2.0};
  DivideInPlace(DataType::kFloat64, d.data(), d.size(), 3);
  EXPECT_EQ(d[0], 1.0 / 3.0);
  std::vector<uint16_t> h = {FloatToHalfScalar(5.0f), FloatToHalfScalar(1.0f)};
  DivideInPlace(DataType::kFloat16, h.data(), h.size(), 3);
  EXPECT_EQ(h[0], FloatToHalfScalar(5.0f / 3.0f));
  EXPECT_EQ(h[1], FloatToHalfScalar(1.0f / 3.0f));
  std::vector<uint16_t> b(3000, FloatToBFloat16Scalar(9.0f));
  DivideInPlace(DataType::kBFloat16, b.data(), b.size(), 4);
  for (uint16_t v : b) ASSERT_EQ(BFloat16ToFloatScalar(v), 2.25f);
}

}  // namespace
}  // namespace strata::comm_internal
