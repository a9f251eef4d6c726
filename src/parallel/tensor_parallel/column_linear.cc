// ColumnParallelLinear's steps. Weight [out/tp, in]; this rank computes the
// output features [rank * out/tp, (rank + 1) * out/tp).
#include "parallel/tensor_parallel/internal/linear_engine.h"
#include "strata/base/status.h"

namespace strata::tp_internal {

absl::Status LinearEngine::ColumnForward(const LinearForward& a, const LinearShapes& s) {
  const bool sp = options_.sequence_parallel;
  ConstMatrixRef x = a.input;
  if (sp) {
    // Sequence parallelism: each rank holds rows/tp tokens; the GEMM needs
    // all of them.
    STRATA_ASSIGN_OR_RETURN(MatrixRef full,
                            ScratchMatrix(kGatheredInput, s.output_rows, options_.in_features));
    STRATA_ASSIGN_OR_RETURN(Pending p,
                            AllGatherRows(ctx_, a.input, full, "forward: all-gather of input"));
    STRATA_RETURN_IF_ERROR(p.Wait());
    x = full;
  }
  const void* bias = options_.bias && !options_.skip_bias_add ? a.bias : nullptr;
  if (!options_.gather_output) return kernels_->Forward(x, a.weight, bias, a.output);

  STRATA_ASSIGN_OR_RETURN(MatrixRef local, ScratchMatrix(kLocalOutput, s.output_rows, local_));
  STRATA_RETURN_IF_ERROR(kernels_->Forward(x, a.weight, bias, local));
  STRATA_ASSIGN_OR_RETURN(MatrixRef gathered,
                          ScratchMatrix(kGatheredOutput, s.output_rows * size_, local_));
  STRATA_ASSIGN_OR_RETURN(Pending p,
                          AllGatherRows(ctx_, local, gathered, "forward: all-gather of output"));
  STRATA_RETURN_IF_ERROR(p.Wait());
  return InterleaveColumns(*kernels_, gathered, size_, a.output);
}

absl::Status LinearEngine::ColumnBackward(const LinearBackward& a, const LinearShapes& s) {
  const bool sp = options_.sequence_parallel;
  const int64_t rows = s.output_rows;  // all tokens (gathered under sequence parallelism)
  ConstMatrixRef dy = a.grad_output;
  if (options_.gather_output) {
    // The forward all-gather's backward is a split: keep this rank's columns.
    STRATA_ASSIGN_OR_RETURN(MatrixRef mine, ScratchMatrix(kGradOutput, rows, local_));
    STRATA_RETURN_IF_ERROR(SliceColumns(*kernels_, a.grad_output, rank_, mine));
    dy = mine;
  }
  // Under sequence parallelism the weight gradient needs the gathered input
  // again (it is not kept from the forward pass, as in Megatron-Core): start
  // gathering it now, so it overlaps with the input-gradient GEMM.
  ConstMatrixRef x = a.input;
  Pending gather_x;
  if (sp && a.weight_main_grad != nullptr) {
    STRATA_ASSIGN_OR_RETURN(MatrixRef full,
                            ScratchMatrix(kGatheredInput, rows, options_.in_features));
    STRATA_ASSIGN_OR_RETURN(gather_x,
                            AllGatherRows(ctx_, a.input, full, "backward: all-gather of input"));
    x = full;
  }
  Pending grad_comm;
  if (a.grad_input.data != nullptr) {
    if (sp) {
      STRATA_ASSIGN_OR_RETURN(MatrixRef full,
                              ScratchMatrix(kGradInput, rows, options_.in_features));
      STRATA_RETURN_IF_ERROR(kernels_->GradInput(dy, a.weight, full));
      STRATA_ASSIGN_OR_RETURN(
          grad_comm,
          ReduceScatterRows(ctx_, full, a.grad_input, "backward: reduce-scatter of grad_input"));
    } else {
      STRATA_RETURN_IF_ERROR(kernels_->GradInput(dy, a.weight, a.grad_input));
      STRATA_ASSIGN_OR_RETURN(
          grad_comm, AllReduceSum(ctx_, a.grad_input, "backward: all-reduce of grad_input"));
    }
  }
  // The weight and bias gradients overlap with the input-gradient collective.
  if (a.weight_main_grad != nullptr) {
    STRATA_RETURN_IF_ERROR(gather_x.Wait());
    STRATA_RETURN_IF_ERROR(kernels_->GradWeight(dy, x, a.weight_main_grad));
  }
  if (a.bias_grad != nullptr) STRATA_RETURN_IF_ERROR(kernels_->ColumnSums(dy, a.bias_grad));
  STRATA_RETURN_IF_ERROR(gather_x.Wait());
  return grad_comm.Wait();
}

}  // namespace strata::tp_internal
