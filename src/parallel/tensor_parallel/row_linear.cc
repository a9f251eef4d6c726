// RowParallelLinear's steps. Weight [out, in/tp]; this rank multiplies the
// input features [rank * in/tp, (rank + 1) * in/tp) and the partial
// products are summed over the group.
#include "parallel/tensor_parallel/internal/linear_engine.h"
#include "strata/base/status.h"

namespace strata::tp_internal {

absl::Status LinearEngine::RowForward(const LinearForward& a, const LinearShapes& s) {
  const int64_t rows = a.input.rows;
  ConstMatrixRef x = a.input;
  if (!options_.input_is_parallel) {
    // The forward of "scatter to the group" is a split: keep this rank's
    // input columns.
    STRATA_ASSIGN_OR_RETURN(MatrixRef mine, ScratchMatrix(kLocalInput, rows, local_));
    STRATA_RETURN_IF_ERROR(SliceColumns(*kernels_, a.input, rank_, mine));
    x = mine;
  }
  // The bias must be added once to the sum: rank 0 adds it to its partial
  // product inside the GEMM, which saves a pass over the output.
  const bool add_bias = options_.bias && !options_.skip_bias_add && rank_ == 0;
  const void* bias = add_bias ? a.bias : nullptr;
  if (options_.sequence_parallel) {
    STRATA_ASSIGN_OR_RETURN(MatrixRef partial,
                            ScratchMatrix(kLocalOutput, rows, options_.out_features));
    STRATA_RETURN_IF_ERROR(kernels_->Forward(x, a.weight, bias, partial));
    STRATA_ASSIGN_OR_RETURN(
        Pending p, ReduceScatterRows(ctx_, partial, a.output, "forward: reduce-scatter of output"));
    return p.Wait();
  }
  STRATA_RETURN_IF_ERROR(kernels_->Forward(x, a.weight, bias, a.output));
  STRATA_ASSIGN_OR_RETURN(Pending p, AllReduceSum(ctx_, a.output, "forward: all-reduce of output"));
  return p.Wait();
}

absl::Status LinearEngine::RowBackward(const LinearBackward& a, const LinearShapes& s) {
  const int64_t rows = a.input.rows;
  ConstMatrixRef dy = a.grad_output;
  if (options_.sequence_parallel) {
    // The reduce-scatter's backward is an all-gather; every GEMM below needs
    // it, so there is nothing to overlap it with.
    STRATA_ASSIGN_OR_RETURN(MatrixRef full,
                            ScratchMatrix(kGradOutput, rows, options_.out_features));
    STRATA_ASSIGN_OR_RETURN(
        Pending p, AllGatherRows(ctx_, a.grad_output, full, "backward: all-gather of grad_output"));
    STRATA_RETURN_IF_ERROR(p.Wait());
    dy = full;
  }
  ConstMatrixRef x = a.input;
  if (!options_.input_is_parallel && a.weight_main_grad != nullptr) {
    STRATA_ASSIGN_OR_RETURN(MatrixRef mine, ScratchMatrix(kLocalInput, rows, local_));
    STRATA_RETURN_IF_ERROR(SliceColumns(*kernels_, a.input, rank_, mine));
    x = mine;
  }
  Pending gather;
  MatrixRef gathered;
  if (a.grad_input.data != nullptr) {
    if (options_.input_is_parallel) {
      STRATA_RETURN_IF_ERROR(kernels_->GradInput(dy, a.weight, a.grad_input));
    } else {
      STRATA_ASSIGN_OR_RETURN(MatrixRef mine, ScratchMatrix(kGradInput, rows, local_));
      STRATA_RETURN_IF_ERROR(kernels_->GradInput(dy, a.weight, mine));
      STRATA_ASSIGN_OR_RETURN(gathered, ScratchMatrix(kGatheredGradInput, rows * size_, local_));
      STRATA_ASSIGN_OR_RETURN(
          gather, AllGatherRows(ctx_, mine, gathered, "backward: all-gather of grad_input"));
    }
  }
  // Overlapped with the all-gather of grad_input.
  if (a.weight_main_grad != nullptr) {
    STRATA_RETURN_IF_ERROR(kernels_->GradWeight(dy, x, a.weight_main_grad));
  }
  // dy holds every token here (gathered under sequence parallelism), so the
  // bias gradient is complete on every rank.
  if (a.bias_grad != nullptr) STRATA_RETURN_IF_ERROR(kernels_->ColumnSums(dy, a.bias_grad));
  STRATA_RETURN_IF_ERROR(gather.Wait());
  if (gathered.data != nullptr) {
    STRATA_RETURN_IF_ERROR(InterleaveColumns(*kernels_, gathered, size_, a.grad_input));
  }
  return absl::OkStatus();
}

}  // namespace strata::tp_internal
