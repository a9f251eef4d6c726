// The local compute of the tensor-parallel layers, behind one interface
// with a host implementation (OpenBLAS sgemm; fp16/bf16 widened to fp32)
// and a CUDA one (cuBLASLt with the bias in the epilogue), so the layers'
// communication logic is written once.
//
// The three GEMMs of a linear layer, row-major, with the weight stored
// [n, k] as torch.nn.Linear stores it:
//   Forward     out[m, n]  = x[m, k] . w[n, k]^T (+ bias[n])
//   GradInput   out[m, k]  = dy[m, n] . w[n, k]
//   GradWeight  acc[n, k] += dy[m, n]^T . x[m, k]        (fp32 accumulator)
//
//   std::unique_ptr<Kernels> k = MakeCpuKernels();
//   STRATA_RETURN_IF_ERROR(k->Forward(x, w, bias, y));
//
// Callers validate shapes and dtypes before calling (a mismatch here is a
// CHECK failure). Thread-safety: not thread-safe (scratch buffers).
#pragma once

#include <cstddef>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "strata/comm/communicator.h"
#include "strata/parallel/tensor_parallel/matrix.h"

namespace strata::tp_internal {

class Kernels {
 public:
  virtual ~Kernels() = default;

  virtual MemoryKind memory() const = 0;
  // The stream later calls queue their work on (cudaStream_t; CUDA only).
  virtual void SetStream(void* stream) = 0;

  virtual absl::Status Forward(const ConstMatrixRef& x, const ConstMatrixRef& w, const void* bias,
                               const MatrixRef& out) = 0;
  virtual absl::Status GradInput(const ConstMatrixRef& dy, const ConstMatrixRef& w,
                                 const MatrixRef& out) = 0;
  virtual absl::Status GradWeight(const ConstMatrixRef& dy, const ConstMatrixRef& x,
                                  float* acc) = 0;
  // acc[n] += sum over the rows of dy[m, n].
  virtual absl::Status ColumnSums(const ConstMatrixRef& dy, float* acc) = 0;
  // `height` rows of `width` bytes from src (rows `src_pitch` bytes apart)
  // to dst (rows `dst_pitch` bytes apart).
  virtual absl::Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                              size_t width, size_t height) = 0;
  // At least `bytes` of this memory for `slot`, valid until the next call
  // for the same slot. Slots are small integers chosen by the caller.
  virtual absl::StatusOr<void*> Scratch(int slot, size_t bytes) = 0;

  // Ordering with collectives on device memory: BeginComm returns the
  // stream a collective must be issued on so that it starts after the work
  // queued so far (nullptr on host); EndComm makes work queued afterwards
  // wait for the collectives issued since. Host: no-ops.
  virtual absl::StatusOr<void*> BeginComm() = 0;
  virtual absl::Status EndComm() = 0;
};

std::unique_ptr<Kernels> MakeCpuKernels();
// Unimplemented in a build without CUDA, or when no device is visible.
absl::StatusOr<std::unique_ptr<Kernels>> MakeCudaKernels();
// The kernels for `memory`.
absl::StatusOr<std::unique_ptr<Kernels>> MakeKernels(MemoryKind memory);

}  // namespace strata::tp_internal
