#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "parallel/tensor_parallel/internal/cuda_reduce.h"

namespace strata::tp_internal {
namespace {

__device__ inline float Load(const float* p) { return *p; }
__device__ inline float Load(const __half* p) { return __half2float(*p); }
__device__ inline float Load(const __nv_bfloat16* p) { return __bfloat162float(*p); }

// Each block sums a tile of 32 columns x (rows / gridDim.y) rows: threads
// along x read consecutive columns (coalesced), threads along y stride over
// rows; the partial sums meet in shared memory and one atomic per column
// and block adds them to acc.
template <typename T>
__global__ void ColumnSumsKernel(const T* dy, int64_t rows, int64_t cols, float* acc) {
  __shared__ float partial[8][33];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float sum = 0.0f;
  if (col < cols) {
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; r < rows;
         r += static_cast<int64_t>(gridDim.y) * blockDim.y) {
      sum += Load(dy + r * cols + col);
    }
  }
  partial[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float total = 0.0f;
    for (int i = 0; i < 8; ++i) total += partial[i][threadIdx.x];
    atomicAdd(acc + col, total);
  }
}

}  // namespace

int LaunchColumnSums(const void* dy, DataType dtype, int64_t rows, int64_t cols, float* acc,
                     void* stream) {
  if (rows == 0 || cols == 0) return 0;
  const dim3 block(32, 8);
  const int64_t row_blocks = (rows + 255) / 256;
  const dim3 grid(static_cast<unsigned>((cols + 31) / 32),
                  static_cast<unsigned>(row_blocks < 64 ? row_blocks : 64));
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case DataType::kFloat32:
      ColumnSumsKernel<<<grid, block, 0, s>>>(static_cast<const float*>(dy), rows, cols, acc);
      break;
    case DataType::kFloat16:
      ColumnSumsKernel<<<grid, block, 0, s>>>(static_cast<const __half*>(dy), rows, cols, acc);
      break;
    case DataType::kBFloat16:
      ColumnSumsKernel<<<grid, block, 0, s>>>(static_cast<const __nv_bfloat16*>(dy), rows, cols,
                                              acc);
      break;
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace strata::tp_internal
