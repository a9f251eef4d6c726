// The collectives of the tensor-parallel layers, on row-major matrices:
// all-reduce in place, all-gather and reduce-scatter along rows (the
// sequence dimension), each started asynchronously and waited for with the
// layer's deadline. A group of one rank communicates nothing (a gather or
// scatter is then a copy). On device memory each collective is issued on
// the kernels' communication stream after the compute queued before it.
//
//   CommContext ctx{&group, kernels, absl::Minutes(5), "column-parallel linear"};
//   STRATA_ASSIGN_OR_RETURN(Pending p, AllReduceSum(ctx, grad_input, "backward: grad_input"));
//   ... compute that overlaps ...
//   STRATA_RETURN_IF_ERROR(p.Wait());
//
// Thread-safety: as the communicator and kernels used.
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "parallel/tensor_parallel/internal/kernels.h"
#include "strata/comm/communicator.h"

namespace strata::tp_internal {

struct CommContext {
  Communicator* comm = nullptr;
  Kernels* kernels = nullptr;
  absl::Duration timeout = absl::Minutes(5);
  // Prepended to errors: "column-parallel linear".
  const char* layer = "";
};

// A started collective (or none). Wait() must be called before the buffers
// are reused; it returns the collective's error with the layer and step.
class Pending {
 public:
  Pending() = default;
  Pending(const CommContext& ctx, std::unique_ptr<Work> work, std::string what);
  Pending(Pending&&) = default;
  Pending& operator=(Pending&&) = default;
  // Waits for the collective; a no-op when there is none or it was waited for.
  absl::Status Wait();

 private:
  CommContext ctx_;
  std::unique_ptr<Work> work_;
  absl::Time deadline_;
  std::string what_;
};

// Sums `m` over the group, in place.
absl::StatusOr<Pending> AllReduceSum(const CommContext& ctx, const MatrixRef& m, const char* what);
// full [size * local.rows, cols] = every rank's local, in rank order.
absl::StatusOr<Pending> AllGatherRows(const CommContext& ctx, const ConstMatrixRef& local,
                                      const MatrixRef& full, const char* what);
// local [full.rows / size, cols] = this rank's block of the sum of full.
absl::StatusOr<Pending> ReduceScatterRows(const CommContext& ctx, const ConstMatrixRef& full,
                                          const MatrixRef& local, const char* what);
// Max-reduction in place, for the vocab-parallel cross-entropy.
absl::StatusOr<Pending> AllReduce(const CommContext& ctx, const MatrixRef& m, ReduceOp op,
                                  const char* what);

// Column blocks: dst [rows, size * cols] from the blocks of src
// [size * rows, cols] (rank r's block becomes columns [r * cols, (r+1) * cols)).
absl::Status InterleaveColumns(Kernels& k, const ConstMatrixRef& src, int size,
                               const MatrixRef& dst);
// dst [rows, cols] = columns [index * cols, (index + 1) * cols) of src.
absl::Status SliceColumns(Kernels& k, const ConstMatrixRef& src, int index, const MatrixRef& dst);

}  // namespace strata::tp_internal
