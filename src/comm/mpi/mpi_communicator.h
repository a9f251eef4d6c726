// The Open MPI backend of strata::Communicator (host memory).
//
// Each operation (its arguments validated and its options resolved by
// Communicator) starts the matching nonblocking MPI call(s) (MPI_Iallreduce, MPI_Ibcast, ...;
// several calls when a count exceeds MPI's int range) and hands the requests to the progress engine
// (mpi_engine.h), which completes them in issue order. Reductions of fp16
// and bf16 use user-defined MPI ops that accumulate in fp32; avg is a sum
// followed by a division on the receiving ranks.
//
// Structure and faults:
//   Split    MPI_Ibarrier (bounded by the new communicator's timeout), then
//            MPI_Comm_split, then MPI_Comm_idup for the control duplicate.
//   Revoke   MPIX_Comm_revoke (ULFM); Unimplemented without ULFM, and
//            FailedPrecondition in a job without fault tolerance (mpirun
//            --with-ft ulfm), where the revocation would reach no peer.
//   Shrink   works for failed and for live excluded ranks, on a revoked
//            communicator too, and only the survivors call it: they meet
//            on the control duplicate (never revoked) with point-to-point
//            messages bounded by the timeout, then create the new
//            communicator among themselves: under fault tolerance, or when
//            a survivor knows of a failed rank, MPI_Comm_create_from_group
//            (ULFM refuses create_group on a parent containing a failed
//            rank, on each survivor from the moment it learns of it, so
//            survivors that learn at different moments would part ways);
//            otherwise MPI_Comm_create_group on the control duplicate.
//            MPIX_Comm_shrink is not used: it
//            needs every live rank, live excluded ones included, to call it.
//            (Communicator checks the excluded ranks and keeps the excluded
//            ones out; the survivors and their hash come in the ShrinkPlan.)
//   Abort    local and immediate: pending operations fail with Aborted.
//
// Thread-safety: as Communicator (any thread; one order of collectives).
#pragma once

#include <mpi.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "comm/mpi/mpi_engine.h"
#include "strata/comm/backend.h"
#include "strata/comm/communicator.h"

namespace strata::mpi {

class MpiCommunicator final : public Communicator {
 public:
  // Duplicates MPI_COMM_WORLD (twice: operations and control) for a new
  // root communicator with its own progress engine. `expected_rank` and
  // `expected_size` come from the launch environment and must match MPI's.
  // options.comm has been checked (CreateRootCommunicator).
  static absl::StatusOr<std::unique_ptr<MpiCommunicator>> CreateRoot(const RootOptions& options,
                                                                     int expected_rank,
                                                                     int expected_size);

  MpiCommunicator(std::shared_ptr<Engine> engine, std::shared_ptr<CommState> state,
                  const CommOptions& options);

  absl::string_view backend() const override { return "mpi"; }
  MemoryKind memory() const override { return MemoryKind::kHost; }
  bool progresses_independently() const override { return true; }

 protected:
  absl::StatusOr<std::unique_ptr<Work>> DoAllReduce(ConstBuffer send, Buffer recv, ReduceOp op,
                                                    const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> DoBroadcast(Buffer buffer, int root,
                                                    const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> DoReduce(ConstBuffer send, Buffer recv, ReduceOp op,
                                                 int root, const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> DoAllGather(ConstBuffer send, Buffer recv,
                                                    const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> DoReduceScatter(ConstBuffer send, Buffer recv, ReduceOp op,
                                                        const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> DoAllToAll(ConstBuffer send, Buffer recv,
                                                   const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> DoAllToAllV(ConstBuffer send, Buffer recv,
                                                    const AllToAllCounts& counts,
                                                    const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> DoBarrier(const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> DoSend(ConstBuffer buffer, int peer,
                                               const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> DoRecv(Buffer buffer, int peer,
                                               const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Communicator>> DoSplit(int color, int key,
                                                        const CommOptions& options,
                                                        const ResolvedOptions& resolved) override;
  absl::StatusOr<std::unique_ptr<Communicator>> DoShrink(const ShrinkPlan& plan,
                                                         const CommOptions& options,
                                                         const ResolvedOptions& resolved) override;
  absl::Status DoAbort() override;
  absl::Status DoRevoke() override;
  absl::Status DoAsyncError() override;

 private:
  // Starts an operation: checks the communicator is usable, creates the
  // Op, lets `start` issue the MPI calls (under the issue lock), and
  // submits it.
  absl::StatusOr<std::unique_ptr<Work>> Start(const ResolvedOptions& options,
                                              const std::function<absl::Status(Op&)>& start);
  // Builds the communicator object around freshly created MPI handles.
  std::unique_ptr<MpiCommunicator> Wrap(MPI_Comm comm, MPI_Comm ctrl, const CommOptions& options,
                                        std::string uid);

  std::shared_ptr<Engine> engine_;
  std::shared_ptr<CommState> state_;
};

// The MPI datatype of `dtype`: fp16 and bf16 travel as MPI_UINT16_T.
MPI_Datatype MpiType(DataType dtype);
// The MPI op of `op` on `dtype` (avg reduces as a sum).
MPI_Op MpiReduceOp(DataType dtype, ReduceOp op);
// What this backend moves and reduces (every dtype; reductions of all but
// bool).
const CommCapabilities& MpiCapabilities();

}  // namespace strata::mpi
