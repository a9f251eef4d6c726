// Tensor-parallel linear layers: the kernels of Megatron-style column- and
// row-parallel GEMMs with their communication, on host memory (OpenBLAS
// sgemm; fp16/bf16 computed in fp32) or CUDA memory (cuBLASLt).
//
// A layer holds no weights: the caller owns every tensor and passes views
// (MatrixRef) to Forward and Backward; the layer owns only its scratch
// buffers and, on GPU, its communication stream. Sizes are the global
// (unsharded) ones; each rank holds a contiguous shard:
//
//   ColumnParallelLinear   weight [out/tp, in]   bias [out/tp]
//   RowParallelLinear      weight [out, in/tp]   bias [out] (whole, added after the reduction)
//
// Communication on the tp group (`rows` are tokens, see matrix.h):
//
//   column input    forward identity,       backward all-reduce of grad_input
//     sequence_parallel: forward all-gather of the [rows/tp, in] input,
//                        backward reduce-scatter of grad_input
//   gather_output   forward all-gather of the output columns, backward split
//   row input       input_is_parallel: none; else forward split of the input
//                   columns, backward all-gather of grad_input columns
//   row output      forward all-reduce, backward identity
//     sequence_parallel: forward reduce-scatter to [rows/tp, out],
//                        backward all-gather of grad_output
//
// Backward overlaps the input-gradient communication with the
// weight-gradient GEMM: it computes grad_input, starts its collective, then
// computes the weight and bias gradients, then waits (on GPU the collective
// runs on the layer's communication stream). The weight gradient is
// accumulated in fp32 into a caller-owned main-gradient buffer
// (Megatron's gradient-accumulation fusion), the bias gradient likewise.
// Under sequence parallelism the row-parallel bias gradient is complete on
// every rank (it is summed over the all-gathered grad_output), so no
// separate all-reduce of it is needed.
//
//   strata::LinearOptions o;
//   o.in_features = 1024; o.out_features = 4096; o.sequence_parallel = true;
//   auto fc1 = strata::ColumnParallelLinear::Create(o, world->Handle("tp").value());  // StatusOr
//   STRATA_ASSIGN_OR_RETURN(strata::LinearShapes s, (*fc1)->Shapes(local_rows));
//   strata::LinearForward f{input, weight, bias, output};
//   STRATA_RETURN_IF_ERROR((*fc1)->Forward(f));
//   strata::LinearBackward b{grad_output, input, weight, grad_input, w_main_grad, b_grad};
//   STRATA_RETURN_IF_ERROR((*fc1)->Backward(b));
//
// Errors: an invalid combination of options or sizes (sequence_parallel on
// a row-parallel layer without input_is_parallel, gather_output with
// sequence_parallel, features or rows not divisible by the group size, an
// option of the other layer kind), a view whose shape or dtype is not the
// expected one, or a null view are InvalidArgument naming the sizes;
// CUDA memory in a build without CUDA is Unimplemented; a collective's
// failure is returned with the layer and step prepended.
//
// The group: a layer holds a handle (strata/parallel/group_handle.h), pinned
// at Create to this rank's rank and the group's size (the weights are
// sharded for them), and resolves it at each Forward and Backward. It
// follows a World rebuild that keeps its layout (other replicas left); one
// that changes it fails Forward/Backward with FailedPrecondition naming both
// generations and both layouts (build a new layer and load its shards). A
// communicator without a World: GroupHandle::Fixed(&comm), which must then
// outlive the layer.
//
// Thread-safety: a layer is not thread-safe (its scratch buffers are reused
// by every call); distinct layers may run concurrently on distinct
// communicators.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "strata/base/dtype.h"
#include "strata/base/export.h"
#include "strata/comm/communicator.h"
#include "strata/parallel/group_handle.h"
#include "strata/parallel/tensor_parallel/matrix.h"

namespace strata {

namespace tp_internal {
class LinearEngine;
}

// What a linear layer computes and how it communicates. The option names
// are Megatron-Core's.
struct STRATA_EXPORT LinearOptions {
  // Global (unsharded) sizes.
  int64_t in_features = 0;
  int64_t out_features = 0;
  // dtype of input, weight, bias, output and input gradient: fp32, fp16 or
  // bf16 (the main gradients are always fp32).
  DataType dtype = DataType::kFloat32;
  // The layer has a bias.
  bool bias = true;
  // ColumnParallelLinear only: all-gather the output columns so every rank
  // gets [rows, out]. Not with sequence_parallel.
  bool gather_output = false;
  // RowParallelLinear only: the input is already split by columns
  // ([rows, in/tp], e.g. a column-parallel layer's output).
  bool input_is_parallel = false;
  // Activations outside the layer are split by rows (sequence) across the
  // group: all-gather / reduce-scatter replace identity / all-reduce.
  bool sequence_parallel = false;
  // Do not add the bias; the caller adds it (e.g. fused into the next
  // operation) and so also owns its gradient.
  bool skip_bias_add = false;
  // Where the tensors live. kCuda needs a build with CUDA and, for a group
  // of more than one rank, a communicator on device memory.
  MemoryKind memory = MemoryKind::kHost;
  // Deadline of each collective the layer waits for.
  absl::Duration timeout = absl::Minutes(5);
};

// The shapes one call expects, for a given number of local input rows.
struct STRATA_EXPORT LinearShapes {
  int64_t input_rows = 0, input_cols = 0;
  int64_t weight_rows = 0, weight_cols = 0;
  int64_t bias = 0;  // 0 when the layer has no bias
  int64_t output_rows = 0, output_cols = 0;
};

struct STRATA_EXPORT LinearForward {
  ConstMatrixRef input;
  ConstMatrixRef weight;
  // Bias vector of the weight's dtype; null when the layer has none (and
  // ignored under skip_bias_add).
  const void* bias = nullptr;
  MatrixRef output;
  // cudaStream_t to compute on (kCuda only; null is the default stream).
  void* stream = nullptr;
};

struct STRATA_EXPORT LinearBackward {
  ConstMatrixRef grad_output;
  // The input and weight the forward pass saw.
  ConstMatrixRef input;
  ConstMatrixRef weight;
  // Input gradient, shaped like the input; data == nullptr skips it (and
  // its communication), e.g. for the first layer.
  MatrixRef grad_input;
  // fp32 weight gradient, the weight's shape: += dW. Null skips it.
  float* weight_main_grad = nullptr;
  // fp32 bias gradient: += db. Null skips it; must be null under
  // skip_bias_add or without a bias.
  float* bias_grad = nullptr;
  void* stream = nullptr;
};

// Column-parallel linear: Y = X A^T + b with A split by rows (output
// features) across the group.
class STRATA_EXPORT ColumnParallelLinear {
 public:
  static absl::StatusOr<std::unique_ptr<ColumnParallelLinear>> Create(const LinearOptions& options,
                                                                      const GroupHandle& group);
  ~ColumnParallelLinear();

  absl::StatusOr<LinearShapes> Shapes(int64_t input_rows) const;
  absl::Status Forward(const LinearForward& args);
  absl::Status Backward(const LinearBackward& args);

  const LinearOptions& options() const;
  // out_features / group size.
  int64_t local_out_features() const;

 private:
  explicit ColumnParallelLinear(std::unique_ptr<tp_internal::LinearEngine> engine);
  std::unique_ptr<tp_internal::LinearEngine> engine_;
};

// Row-parallel linear: Y = X A^T + b with A split by columns (input
// features) across the group; the partial products are summed over it.
class STRATA_EXPORT RowParallelLinear {
 public:
  static absl::StatusOr<std::unique_ptr<RowParallelLinear>> Create(const LinearOptions& options,
                                                                   const GroupHandle& group);
  ~RowParallelLinear();

  absl::StatusOr<LinearShapes> Shapes(int64_t input_rows) const;
  absl::Status Forward(const LinearForward& args);
  absl::Status Backward(const LinearBackward& args);

  const LinearOptions& options() const;
  // in_features / group size.
  int64_t local_in_features() const;

 private:
  explicit RowParallelLinear(std::unique_ptr<tp_internal::LinearEngine> engine);
  std::unique_ptr<tp_internal::LinearEngine> engine_;
};

}  // namespace strata
