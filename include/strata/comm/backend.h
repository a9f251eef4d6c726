// Creating the root communicator (every rank of the job) on a backend.
//
// This is the one place that knows which backends exist; everything above
// it (the World, the elastic layer) sees only the Communicator interface.
//
//   absl::StatusOr<strata::LaunchEnv> env = strata::LaunchEnv::Detect();
//   strata::RootOptions options;            // backend "auto": MPI on CPUs
//   options.comm.timeout = absl::Minutes(5);
//   absl::StatusOr<std::unique_ptr<strata::Communicator>> world =
//       strata::CreateRootCommunicator(*env, options);
//
// Backends:
//   "mpi"   Open MPI, host memory. The job is launched by mpirun (or srun
//           with Slurm's PMIx support), or is a single process without a
//           launcher (a world of 1). MPI is initialised on first use with
//           MPI_THREAD_MULTIPLE and stays initialised for the life of the
//           process (MPI cannot be initialised twice); root communicators
//           can be created and destroyed any number of times. strata calls
//           MPI_Finalize at process exit if it initialised MPI.
//   "auto"  "mpi" when built with it and the launcher is mpirun, Slurm or
//           none; torchrun jobs need the store-bootstrapped backends that a
//           later release adds (Unimplemented until then).
//
// Thread-safety: CreateRootCommunicator may be called from any thread; it
// is collective over every rank of the job.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "strata/base/export.h"
#include "strata/comm/communicator.h"
#include "strata/comm/launch_env.h"

namespace strata {

// Settings of the MPI backend's progress engine (one background thread per
// root communicator, shared by every communicator split from it).
struct STRATA_EXPORT MpiOptions {
  // While nobody waits on an operation, the progress thread polls MPI
  // continuously for this long after the last completion or start, then
  // sleeps between polls, doubling the pause up to `max_poll_interval`, so
  // ranks that compute while communication is in flight keep their CPU.
  // While a caller waits (Work::Wait), it polls without pausing.
  absl::Duration busy_poll = absl::Microseconds(200);
  absl::Duration max_poll_interval = absl::Milliseconds(1);
  // Algorithm choices for large messages, in bytes per rank (0 turns a
  // choice off). Open MPI's nonblocking collectives pick algorithms that are
  // slow for large messages on shared memory (docs/mpi.md has the numbers);
  // from these sizes strata asks for others:
  //   allreduce       a ring
  //   reduce          a binomial tree
  //   reduce_scatter  one binomial reduce to each rank, all in flight, in
  //                   groups of at most `per_root_reduce_scatter_max_ranks`
  //                   (it costs O(size) operations per rank)
  // An algorithm chosen in the environment (OMPI_MCA_coll_libnbc_*) wins.
  size_t ring_allreduce_min_bytes = size_t{2} << 20;
  size_t binomial_reduce_min_bytes = size_t{64} << 10;
  size_t per_root_reduce_scatter_min_bytes = size_t{64} << 10;
  int per_root_reduce_scatter_max_ranks = 16;
  // The most elements one MPI call may carry. MPI counts are `int`, so
  // larger operations are split into several calls; the default is INT_MAX.
  // Tests lower it to exercise the splitting with small buffers. Every
  // rank must use the same value.
  size_t max_elements_per_call = 0;  // 0: INT_MAX
};

// Options of the root communicator.
struct STRATA_EXPORT RootOptions {
  static constexpr int kVersion = 1;
  int version = kVersion;
  // "auto" or a backend name from AvailableBackends().
  std::string backend = "auto";
  // Name and default operation timeout of the root communicator (splits
  // take their own CommOptions). The root's creation must complete within
  // `comm.timeout` on every rank.
  CommOptions comm;
  MpiOptions mpi;
};

// The backends compiled into this build ("mpi" where Open MPI was found).
STRATA_EXPORT std::vector<std::string> AvailableBackends();

// Resolves "auto" for a launch environment: the backend that
// CreateRootCommunicator would use. Unimplemented when none fits (the
// message says why), InvalidArgument for an unknown name.
STRATA_EXPORT absl::StatusOr<std::string> ResolveBackend(const LaunchEnv& env,
                                                         absl::string_view backend);

// Creates the communicator of every rank of the job. Collective. The
// communicator's rank and size match `env` (FailedPrecondition naming both
// when the backend sees a different job, e.g. srun without PMIx).
STRATA_EXPORT absl::StatusOr<std::unique_ptr<Communicator>> CreateRootCommunicator(
    const LaunchEnv& env, const RootOptions& options);

}  // namespace strata
