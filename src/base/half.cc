#include "base/half.h"

namespace strata {

// The loops below have no branches and no calls, so GCC and Clang
// vectorise them (see STRATA_VECTOR_CLONES in half.h).
STRATA_VECTOR_CLONES void HalfToFloat(const uint16_t* in, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = HalfToFloatScalar(in[i]);
}

STRATA_VECTOR_CLONES void FloatToHalf(const float* in, uint16_t* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = FloatToHalfScalar(in[i]);
}

STRATA_VECTOR_CLONES void BFloat16ToFloat(const uint16_t* in, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = BFloat16ToFloatScalar(in[i]);
}

STRATA_VECTOR_CLONES void FloatToBFloat16(const float* in, uint16_t* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = FloatToBFloat16Scalar(in[i]);
}

}  // namespace strata
