// Conversions between the 16-bit floating-point formats (IEEE fp16, bf16)
// and fp32, for code that computes on 16-bit data in fp32: the fp16/bf16
// reductions of the communicators, and the tensor-parallel kernels.
//
// Private to the library (src/base/); not a public header.
//
//   uint16_t h[n];  float f[n];
//   strata::HalfToFloat(h, f, n);          // exact
//   strata::FloatToHalf(f, h, n);          // round to nearest even
//
// The array functions are branch-free loops over plain integer and float
// operations, so the compiler vectorises them (they are built with AVX2
// clones where the CPU has it); the scalar functions are the same code for
// one element. Semantics:
//   - fp16/bf16 -> fp32 is exact for every input, including subnormals,
//     infinities and NaNs (the payload is kept).
//   - fp32 -> fp16/bf16 rounds to nearest, ties to even; values past the
//     largest finite value become infinity; NaNs stay NaNs (quietened, sign
//     and the top payload bits kept).
//   - No function reads or changes the floating-point environment, and no
//     subnormal arithmetic is used, so flush-to-zero modes set by other
//     libraries do not change the results.
//
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

// Marks a function to be built twice, for AVX2 and for the baseline, with
// the right one picked when the library loads (GCC function multiversioning
// through an ifunc). Off under sanitizers: an instrumented ifunc resolver
// runs before the sanitizer runtime is up and crashes (TSan).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_THREAD__) && !defined(__SANITIZE_ADDRESS__)
#define STRATA_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define STRATA_VECTOR_CLONES
#endif

namespace strata {

namespace half_internal {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// `cond ? a : b` as bit operations: the vectorisers turn ternaries with
// computed operands into branches, but not these.
inline uint32_t Select(bool cond, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(cond);
  return (a & mask) | (b & ~mask);
}

}  // namespace half_internal

// fp16 (1 sign, 5 exponent, 10 mantissa bits) to fp32, exactly.
inline float HalfToFloatScalar(uint16_t h) {
  using half_internal::BitsFloat;
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t magnitude = h & 0x7fffu;
  const uint32_t exponent = magnitude >> 10;
  // Normal numbers: move exponent and mantissa into place and rebias the
  // exponent from 15 to 127 (112 << 23).
  const uint32_t normal = (magnitude << 13) + (112u << 23);
  // Infinity and NaN: all-ones exponent, mantissa (payload) kept.
  const uint32_t special = (magnitude << 13) | 0x7f800000u;
  // Subnormals (and zero): mantissa * 2^-24, computed from an exact integer
  // conversion rather than from fp32 subnormals.
  const uint32_t subnormal = half_internal::FloatBits(
      static_cast<float>(static_cast<int32_t>(magnitude)) * 5.9604644775390625e-8f);
  using half_internal::Select;
  const uint32_t bits = Select(exponent == 0, subnormal, Select(exponent == 31, special, normal));
  return BitsFloat(bits | sign);
}

// fp32 to fp16, round to nearest even.
inline uint16_t FloatToHalfScalar(float f) {
  using half_internal::FloatBits;
  const uint32_t x = FloatBits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t a = x & 0x7fffffffu;
  // Normal fp16 range (|f| >= 2^-14): rebias the exponent, then add half an
  // fp16 ulp minus one plus the lowest kept bit, so ties go to even. A carry
  // out of the mantissa correctly bumps the exponent; anything at or past
  // the infinity encoding is clamped to infinity.
  const uint32_t rebased = a - (112u << 23);
  const uint32_t rounded = (rebased + 0x0fffu + ((a >> 13) & 1u)) >> 13;
  using half_internal::Select;
  const uint32_t normal = Select(rounded > 0x7c00u, 0x7c00u, rounded);
  // Subnormal fp16 range (|f| < 2^-14): |f| * 2^24 rounded to an integer.
  // Adding 2^23 to a non-negative float below 2^23 rounds it to an integer
  // (nearest even) and leaves that integer in the low mantissa bits.
  const float scaled = half_internal::BitsFloat(a) * 16777216.0f;
  const uint32_t subnormal = FloatBits(scaled + 8388608.0f) - 0x4b000000u;
  // NaN: quiet it and keep the top payload bits.
  const uint32_t nan = 0x7e00u | ((a >> 13) & 0x03ffu);
  const uint32_t h = Select(a > 0x7f800000u, nan, Select(a < 0x38800000u, subnormal, normal));
  return static_cast<uint16_t>(h | sign);
}

// bf16 (the top 16 bits of an fp32) to fp32, exactly.
inline float BFloat16ToFloatScalar(uint16_t b) {
  return half_internal::BitsFloat(static_cast<uint32_t>(b) << 16);
}

// fp32 to bf16, round to nearest even.
inline uint16_t FloatToBFloat16Scalar(float f) {
  const uint32_t x = half_internal::FloatBits(f);
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  const uint32_t nan = (x >> 16) | 0x0040u;
  return static_cast<uint16_t>(
      half_internal::Select((x & 0x7fffffffu) > 0x7f800000u, nan, rounded));
}

// Array versions: n elements from `in` to `out` (which must not overlap).
void HalfToFloat(const uint16_t* in, float* out, size_t n);
void FloatToHalf(const float* in, uint16_t* out, size_t n);
void BFloat16ToFloat(const uint16_t* in, float* out, size_t n);
void FloatToBFloat16(const float* in, uint16_t* out, size_t n);

}  // namespace strata
