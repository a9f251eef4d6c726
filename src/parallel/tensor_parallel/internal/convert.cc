#include "parallel/tensor_parallel/internal/convert.h"

#include <cmath>
#include <cstring>

#include "strata/base/status.h"

namespace strata::tp_internal {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    // Zero and subnormals: mantissa * 2^-24 is exact in fp32.
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return FromBits(Bits(magnitude) | sign);
  }
  if (exponent == 31) return FromBits(sign | 0x7f800000u | (mantissa << 13));
  return FromBits(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

uint16_t FloatToFp16(float f) {
  const uint32_t x = Bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  // 65520 and above round to infinity (65504 is the largest finite fp16).
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (a < 0x38800000u) {
    // Below 2^-14 the result is subnormal: |f| * 2^24 rounded to an integer
    // (the default rounding mode is to nearest, ties to even). 0x400 is the
    // smallest normal, which is also its correct encoding.
    const float scaled = FromBits(a) * 16777216.0f;
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(scaled)));
  }
  const uint32_t rebased = a - (112u << 23);
  return static_cast<uint16_t>(sign | ((rebased + 0x0fffu + ((rebased >> 13) & 1u)) >> 13));
}

float Bf16ToFloat(uint16_t b) { return FromBits(static_cast<uint32_t>(b) << 16); }

uint16_t FloatToBf16(float f) {
  const uint32_t x = Bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

}  // namespace

bool IsKernelDataType(DataType t) {
  return t == DataType::kFloat32 || t == DataType::kFloat16 || t == DataType::kBFloat16;
}

float HalfBitsToFloat(uint16_t bits, DataType dtype) {
  return dtype == DataType::kBFloat16 ? Bf16ToFloat(bits) : Fp16ToFloat(bits);
}

uint16_t FloatToHalfBits(float value, DataType dtype) {
  return dtype == DataType::kBFloat16 ? FloatToBf16(value) : FloatToFp16(value);
}

void ToFloat(const void* in, DataType dtype, float* out, size_t n) {
  switch (dtype) {
    case DataType::kFloat32:
      if (n > 0) std::memcpy(out, in, n * sizeof(float));
      return;
    case DataType::kBFloat16: {
      const auto* p = static_cast<const uint16_t*>(in);
      for (size_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(p[i]);
      return;
    }
    case DataType::kFloat16: {
      const auto* p = static_cast<const uint16_t*>(in);
      for (size_t i = 0; i < n; ++i) out[i] = Fp16ToFloat(p[i]);
      return;
    }
    default:
      STRATA_CHECK(false, "ToFloat on ", DataTypeName(dtype));
  }
}

void FromFloat(const float* in, void* out, DataType dtype, size_t n) {
  switch (dtype) {
    case DataType::kFloat32:
      if (n > 0) std::memcpy(out, in, n * sizeof(float));
      return;
    case DataType::kBFloat16: {
      auto* p = static_cast<uint16_t*>(out);
      for (size_t i = 0; i < n; ++i) p[i] = FloatToBf16(in[i]);
      return;
    }
    case DataType::kFloat16: {
      auto* p = static_cast<uint16_t*>(out);
      for (size_t i = 0; i < n; ++i) p[i] = FloatToFp16(in[i]);
      return;
    }
    default:
      STRATA_CHECK(false, "FromFloat to ", DataTypeName(dtype));
  }
}

}  // namespace strata::tp_internal
