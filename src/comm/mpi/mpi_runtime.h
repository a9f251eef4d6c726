// The process-wide side of MPI: initialisation (once per process, as MPI
// requires), finalisation at exit, the user-defined fp16/bf16 reduction
// ops, and the mapping from MPI error codes to absl::Status.
//
// This is the only process-wide state in strata, and it exists because MPI
// itself is process-wide: MPI_Init may run once, and MPI_Finalize once,
// per process. Everything else (communicators, progress engines) belongs
// to objects the user owns.
//
//   STRATA_ASSIGN_OR_RETURN(const mpi::RuntimeInfo* info, mpi::EnsureInitialized());
//   MPI_Op op = mpi::HalfReduceOp(DataType::kBFloat16, ReduceOp::kSum);
//
// Finalisation: if strata initialised MPI, an atexit handler first stops
// every live progress engine (failing their pending operations), then calls
// MPI_Finalize. If MPI was initialised by someone else (mpi4py, the
// application), strata leaves finalisation to them. Communicators destroyed
// after finalisation skip their MPI calls.
//
// Thread-safety: every function may be called from any thread.
#pragma once

#include <mpi.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "strata/comm/communicator.h"

namespace strata::mpi {

// Facts fixed once MPI is initialised.
struct RuntimeInfo {
  int world_rank = 0;
  int world_size = 1;
  // Built against an MPI with the ULFM extension (MPIX_Comm_revoke, ...).
  bool ulfm_built = false;
  // The job runs with fault tolerance on (mpirun --with-ft ulfm), so a
  // failed rank is reported to survivors instead of ending the job.
  bool fault_tolerant = false;
  // First line of MPI_Get_library_version.
  std::string library;
};

// Initialises MPI with MPI_THREAD_MULTIPLE on the first call; later calls
// return the same facts. FailedPrecondition when MPI was already initialised
// with a lower thread level, or was finalised.
absl::StatusOr<const RuntimeInfo*> EnsureInitialized();

// True once MPI_Finalize ran (after which no MPI call may be made).
bool Finalized();

// The user-defined MPI_Op that reduces fp16 or bf16 data (as MPI_UINT16_T)
// with fp32 accumulation. `op` is sum, prod, min or max (avg is a sum
// followed by a division). EnsureInitialized() must have succeeded.
MPI_Op HalfReduceOp(DataType dtype, ReduceOp op);

// Progress engines register so that the exit handler can stop them before
// MPI_Finalize. `stop` must return promptly and leave no MPI call running.
class ExitHook {
 public:
  virtual ~ExitHook() = default;
  virtual void StopBeforeFinalize() = 0;
};
void RegisterExitHook(ExitHook* hook);
void UnregisterExitHook(ExitHook* hook);

// Open MPI's nonblocking collectives (the libnbc component) choose their
// algorithm from the message size, and choose badly for large messages on
// shared memory (measured in docs/mpi.md). Their MCA variables are
// process-wide but writable at run time through MPI_T.
enum class NbcCollective { kIallreduce = 0, kIreduce = 1 };
// libnbc's numbering.
inline constexpr int kNbcAllreduceRing = 1;
inline constexpr int kNbcReduceBinomial = 2;
// Runs `start` (which starts the collective) while libnbc's algorithm for
// `collective` is `algorithm`, then restores libnbc's own choice. Calls are
// serialised process-wide, since the variable is. When the variable cannot
// be written (another MPI, or the user set it in the environment, which
// then wins), just runs `start`.
absl::Status WithNbcAlgorithm(NbcCollective collective, int algorithm,
                              const std::function<absl::Status()>& start);

// Keeps `object` alive until the process exits: memory that MPI may still
// write into after the engine that polled it has stopped.
void KeepUntilExit(std::shared_ptr<void> object);

// Maps an MPI return code to a status whose message is
// "<context>: <what happened>". A failed peer (ULFM) is Unavailable with
// the kRankFailurePayload naming the failed ranks of `comm`; a revoked
// communicator is Aborted (with the payload when failed ranks are known);
// a truncated receive is InvalidArgument; anything else is Internal with
// MPI's error string. `comm` may be MPI_COMM_NULL.
absl::Status FromMpi(int rc, MPI_Comm comm, absl::string_view context);

// The ranks of `comm` that MPI knows to have failed (ULFM); empty without it.
std::vector<int> FailedRanks(MPI_Comm comm);

}  // namespace strata::mpi
