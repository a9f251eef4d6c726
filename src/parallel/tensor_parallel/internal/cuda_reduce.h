// Device helpers of the CUDA tensor-parallel kernels that cuBLASLt does not
// provide (cuda_reduce.cu). Only compiled into builds with CUDA.
//
//   STRATA_CHECK(LaunchColumnSums(dy, DataType::kBFloat16, rows, cols, acc, stream) == 0, ...);
//
// Thread-safety: stateless launches.
#pragma once

#include <cstdint>

#include "strata/base/dtype.h"

namespace strata::tp_internal {

// acc[c] += sum over r of dy[r, c] (dy row-major, fp32/fp16/bf16; acc
// fp32), queued on `stream` (a cudaStream_t). Returns the cudaError_t of
// the launch (0 on success).
int LaunchColumnSums(const void* dy, DataType dtype, int64_t rows, int64_t cols, float* acc,
                     void* stream);

}  // namespace strata::tp_internal
