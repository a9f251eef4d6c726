// The implementation behind ColumnParallelLinear and RowParallelLinear:
// option and shape validation (linear.cc) and the forward and backward
// steps of each kind (column_linear.cc, row_linear.cc), written against
// the Kernels interface and the collectives of collectives.h.
//
// Thread-safety: not thread-safe (see linear.h).
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "parallel/tensor_parallel/internal/collectives.h"
#include "parallel/tensor_parallel/internal/kernels.h"
#include "strata/parallel/tensor_parallel/linear.h"

namespace strata::tp_internal {

enum class LinearKind { kColumn, kRow };

class LinearEngine {
 public:
  static absl::StatusOr<std::unique_ptr<LinearEngine>> Create(LinearKind kind,
                                                              const LinearOptions& options,
                                                              const GroupHandle& group);

  absl::StatusOr<LinearShapes> Shapes(int64_t input_rows) const;
  absl::Status Forward(const LinearForward& args);
  absl::Status Backward(const LinearBackward& args);

  const LinearOptions& options() const { return options_; }
  // out/tp (column) or in/tp (row).
  int64_t local_features() const { return local_; }

 private:
  // Scratch slots of the kernels.
  enum Slot : int {
    kGatheredInput,
    kLocalInput,
    kLocalOutput,
    kGatheredOutput,
    kGradOutput,
    kGradInput,
    kGatheredGradInput,
  };

  // `group` is pinned; `comm` is what it resolved to at creation.
  LinearEngine(LinearKind kind, const LinearOptions& options, GroupHandle group,
               const Communicator& comm, std::unique_ptr<Kernels> kernels);

  // Resolves the group (at each Forward and Backward) into ctx_.comm.
  absl::Status ResolveGroup();

  absl::Status CheckForward(const LinearForward& args, LinearShapes* shapes) const;
  absl::Status CheckBackward(const LinearBackward& args, LinearShapes* shapes) const;
  absl::StatusOr<MatrixRef> ScratchMatrix(Slot slot, int64_t rows, int64_t cols);

  absl::Status ColumnForward(const LinearForward& args, const LinearShapes& s);
  absl::Status ColumnBackward(const LinearBackward& args, const LinearShapes& s);
  absl::Status RowForward(const LinearForward& args, const LinearShapes& s);
  absl::Status RowBackward(const LinearBackward& args, const LinearShapes& s);

  const char* name() const;

  const LinearKind kind_;
  const LinearOptions options_;
  const GroupHandle group_;  // pinned
  const int size_;
  const int rank_;
  const int64_t local_;
  std::unique_ptr<Kernels> kernels_;
  CommContext ctx_;
};

}  // namespace strata::tp_internal
