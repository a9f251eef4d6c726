// The fp16/bf16 <-> fp32 conversions, exhaustively over every 16-bit input
// and against an independent reference for the rounding direction.
#include "base/half.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace strata {
namespace {

// Reference fp16 decoding from the definition: (-1)^s * 2^(e-15) * 1.m, or
// 2^-14 * 0.m for subnormals.
double DecodeHalf(uint16_t h) {
  const int sign = (h >> 15) ? -1 : 1;
  const int e = (h >> 10) & 31;
  const int m = h & 1023;
  if (e == 31) {
    return m == 0 ? sign * std::numeric_limits<double>::infinity()
                  : std::numeric_limits<double>::quiet_NaN();
  }
  if (e == 0) return sign * std::ldexp(m, -24);
  return sign * std::ldexp(1024 + m, e - 25);
}

double DecodeBFloat16(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Reference rounding: the nearest of the two neighbouring encodings of a
// finite non-negative value, ties to the even encoding. `decode` maps a
// 15-bit magnitude encoding to its value; `max_finite` is the largest
// finite magnitude encoding.
template <typename Decode>
uint16_t RoundReference(double v, Decode decode, uint16_t max_finite) {
  const double a = std::fabs(v);
  const uint16_t sign = std::signbit(v) ? 0x8000 : 0;
  // Binary search for the largest encoding whose value is <= a.
  uint32_t lo = 0, hi = max_finite;
  if (a >= decode(max_finite)) {
    lo = max_finite;
  } else {
    while (lo < hi) {
      uint32_t mid = (lo + hi + 1) / 2;
      if (decode(static_cast<uint16_t>(mid)) <= a) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
  }
  const double below = decode(static_cast<uint16_t>(lo));
  if (below == a) return static_cast<uint16_t>(lo | sign);
  // Next encoding up; past the largest finite value it is infinity, reached
  // when a is at least halfway to the next (virtual) step.
  const uint32_t up = lo + 1;
  const double above = lo == max_finite
                           ? decode(max_finite) + (decode(max_finite) - decode(max_finite - 1))
                           : decode(static_cast<uint16_t>(up));
  const double d_below = a - below, d_above = above - a;
  uint32_t pick;
  if (d_below < d_above) {
    pick = lo;
  } else if (d_above < d_below) {
    pick = up;
  } else {
    pick = (lo % 2 == 0) ? lo : up;
  }
  return static_cast<uint16_t>(pick | sign);
}

TEST(HalfTest, EveryHalfDecodesExactly) {
  std::vector<uint16_t> in(65536);
  for (uint32_t i = 0; i < 65536; ++i) in[i] = static_cast<uint16_t>(i);
  std::vector<float> out(65536);
  HalfToFloat(in.data(), out.data(), in.size());
  for (uint32_t i = 0; i < 65536; ++i) {
    const double ref = DecodeHalf(static_cast<uint16_t>(i));
    if (std::isnan(ref)) {
      EXPECT_TRUE(std::isnan(out[i])) << std::hex << i;
    } else {
      EXPECT_EQ(static_cast<double>(out[i]), ref) << std::hex << i;
      EXPECT_EQ(std::signbit(out[i]), (i & 0x8000) != 0) << std::hex << i;
    }
    const float scalar = HalfToFloatScalar(static_cast<uint16_t>(i));
    EXPECT_EQ(std::memcmp(&scalar, &out[i], 4), 0) << std::hex << i;
  }
}

TEST(HalfTest, EveryHalfRoundTrips) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t h = static_cast<uint16_t>(i);
    const uint16_t back = FloatToHalfScalar(HalfToFloatScalar(h));
    if ((h & 0x7c00) == 0x7c00 && (h & 0x03ff) != 0) {
      // NaN: stays NaN, quiet bit set, sign and payload top bits kept.
      EXPECT_EQ(back, h | 0x0200) << std::hex << i;
    } else {
      EXPECT_EQ(back, h) << std::hex << i;
    }
  }
}

TEST(HalfTest, RoundsToNearestEven) {
  auto decode = [](uint16_t h) { return DecodeHalf(h); };
  std::vector<float> values;
  // Every midpoint between neighbouring fp16 values, and points just either
  // side of it, over the whole range including subnormals and overflow.
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    const double lo = DecodeHalf(static_cast<uint16_t>(h));
    const double hi = h + 1 < 0x7c00 ? DecodeHalf(static_cast<uint16_t>(h + 1)) : 65536.0;
    const float mid = static_cast<float>((lo + hi) / 2);
    values.push_back(mid);
    values.push_back(std::nextafter(mid, 0.0f));
    values.push_back(std::nextafter(mid, 1e30f));
    values.push_back(static_cast<float>(lo));
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> log2(-30.0f, 20.0f);
  for (int i = 0; i < 200000; ++i) values.push_back(std::exp2(log2(rng)));
  values.push_back(1e30f);
  values.push_back(std::numeric_limits<float>::denorm_min());
  values.push_back(std::numeric_limits<float>::infinity());
  std::vector<float> in;
  for (float v : values) {
    in.push_back(v);
    in.push_back(-v);
  }
  std::vector<uint16_t> out(in.size());
  FloatToHalf(in.data(), out.data(), in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    uint16_t ref = std::isinf(in[i]) ? static_cast<uint16_t>(std::signbit(in[i]) ? 0xfc00 : 0x7c00)
                                     : RoundReference(in[i], decode, 0x7bff);
    ASSERT_EQ(out[i], ref) << "value " << in[i];
  }
}

TEST(HalfTest, NanStaysNan) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(HalfToFloatScalar(FloatToHalfScalar(nan))));
  EXPECT_TRUE(std::isnan(HalfToFloatScalar(FloatToHalfScalar(-nan))));
  uint32_t snan_bits = 0x7f800001u;  // signalling NaN, payload only in low bits
  float snan;
  std::memcpy(&snan, &snan_bits, 4);
  EXPECT_EQ(FloatToHalfScalar(snan), 0x7e00);
  EXPECT_EQ(FloatToBFloat16Scalar(snan), 0x7fc0);
}

TEST(BFloat16Test, EveryBFloat16RoundTrips) {
  std::vector<uint16_t> in(65536), back(65536);
  std::vector<float> f(65536);
  for (uint32_t i = 0; i < 65536; ++i) in[i] = static_cast<uint16_t>(i);
  BFloat16ToFloat(in.data(), f.data(), in.size());
  FloatToBFloat16(f.data(), back.data(), f.size());
  for (uint32_t i = 0; i < 65536; ++i) {
    const bool nan = (i & 0x7f80) == 0x7f80 && (i & 0x7f) != 0;
    EXPECT_EQ(back[i], nan ? (i | 0x40) : i) << std::hex << i;
  }
}

TEST(BFloat16Test, RoundsToNearestEven) {
  auto decode = [](uint16_t b) { return DecodeBFloat16(b); };
  std::mt19937 rng(11);
  std::uniform_int_distribution<uint32_t> bits(0, 0x7f7fffffu);
  std::vector<float> in;
  for (int i = 0; i < 300000; ++i) {
    uint32_t u = bits(rng);
    // Bias towards exact ties every eighth value.
    if (i % 8 == 0) u = (u & 0xffff0000u) | 0x8000u;
    float v;
    std::memcpy(&v, &u, 4);
    in.push_back(v);
    in.push_back(-v);
  }
  std::vector<uint16_t> out(in.size());
  FloatToBFloat16(in.data(), out.data(), in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    ASSERT_EQ(out[i], RoundReference(in[i], decode, 0x7f7f)) << "value " << in[i];
  }
}

}  // namespace
}  // namespace strata
