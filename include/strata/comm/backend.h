// Creating the root communicator (every rank of the job) on a backend.
//
// This is the one place that knows which backends exist; everything above
// it (the World, the elastic layer) sees only the Communicator interface.
//
//   absl::StatusOr<strata::LaunchEnv> env = strata::LaunchEnv::Detect();
//   strata::RootOptions options;            // backend "auto"
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
//   "gloo"  Gloo over TCP, host memory, bootstrapped from a Store: CPU jobs
//           under torchrun (or srun without PMIx). Gloo runs in a plugin,
//           libstrata_gloo.so, loaded beside libstrata (docs/nccl.md).
//   "nccl"  NCCL, CUDA device memory, one GPU per rank. The unique id goes
//           through the Store when there is one (torchrun, srun with
//           MASTER_ADDR/MASTER_PORT), else through MPI (mpirun). Uses the
//           libnccl already loaded in the process (torch's), else loads one.
//   "auto"  "nccl" when a GPU is visible and NCCL is built (unless
//           RootOptions::memory asks for host memory); otherwise "mpi" under
//           mpirun, Slurm or no launcher, "gloo" under torchrun (or when
//           there is no MPI in the build).
//
// The store (Gloo, and NCCL under torchrun): RootOptions::store, else
// $STRATA_STORE ("file:/shared/dir", see strata/comm/store.h). From Python,
// strata.init() passes torchrun's TCPStore; C++ trainers that link LibTorch
// can pass strata::torch::ConnectC10dStore(env) (strata/torch/c10d_store.h).
//
// Thread-safety: CreateRootCommunicator may be called from any thread; it
// is collective over every rank of the job.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "strata/base/export.h"
#include "strata/comm/communicator.h"
#include "strata/comm/launch_env.h"
#include "strata/comm/store.h"

namespace strata {

// Settings of the MPI backend's progress engine (one background thread per
// root communicator, shared by every communicator split from it).
struct STRATA_EXPORT MpiOptions {
  // While nobody waits on an operation, the progress thread polls MPI
  // continuously for this long after the last completion or start, then
  // sleeps between polls, doubling the pause up to `max_poll_interval`, so
  // ranks that compute while communication is in flight keep their CPU.
  // While a caller waits (Work::Wait), it polls without pausing, unless this
  // host runs more ranks than it has cores: then there is no busy polling
  // and a waiter's poll pauses 200 us between passes, so the cores go to the
  // ranks that compute.
  absl::Duration busy_poll = absl::Microseconds(200);
  absl::Duration max_poll_interval = absl::Milliseconds(1);
  // Whether this host runs more ranks than it has cores. Unset: the
  // environment STRATA_OVERSUBSCRIBED=1/0 if set, else detected (ranks on
  // the host from Open MPI, Slurm or torchrun; cores from the online CPUs,
  // the CPU affinity and the cgroup's CPU quota, so a container limited to
  // 2 CPUs on a 64-core host counts 2). docs/mpi.md.
  std::optional<bool> oversubscribed;
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

// Settings of the Gloo backend.
struct STRATA_EXPORT GlooOptions {
  // The network interface Gloo binds to ("eth0"); empty: $GLOO_SOCKET_IFNAME
  // if set, else the address of `hostname`.
  std::string iface;
  // The host name or address to bind to; empty: this host's name.
  std::string hostname;
  // The plugin (libstrata_gloo.so); empty: $STRATA_GLOO_PLUGIN, else beside
  // libstrata.
  std::string plugin_path;
};

// Settings of the NCCL backend.
struct STRATA_EXPORT NcclOptions {
  // The CUDA device of this rank; -1: the local rank modulo the number of
  // visible devices.
  int device = -1;
  // The libnccl to load when none is loaded yet; empty: $STRATA_NCCL_LIBRARY,
  // else "libnccl.so.2" from the library path, else the one strata was built
  // against. A libnccl already in the process (torch's) is always used.
  std::string library;
  // With more ranks than this, the root communicator is created from
  // several unique ids, one per this many ranks (ncclCommInitRankScalable,
  // NCCL >= 2.23), which spreads NCCL's bootstrap over several roots.
  int ranks_per_unique_id = 1024;
  // How often the watchdog polls communicators and operations.
  absl::Duration watchdog_interval = absl::Milliseconds(10);
  // Whether PrepareNcclCommunicator applies the topology profile
  // (strata/comm/nccl_profile.h); STRATA_NCCL_PROFILE=0 also turns it off.
  bool apply_profile = true;
};

// The memory a communicator's buffers live in.
enum class RootMemory : uint8_t { kAuto, kHost, kDevice };

// Options of the root communicator.
struct STRATA_EXPORT RootOptions {
  // Version 3 added `cancelled`.
  static constexpr int kVersion = 3;
  int version = kVersion;
  // "auto" or a backend name from AvailableBackends().
  std::string backend = "auto";
  // For "auto": kHost picks a host backend even where a GPU is visible;
  // kDevice insists on NCCL (FailedPrecondition without a GPU); kAuto takes
  // NCCL when a GPU is visible.
  RootMemory memory = RootMemory::kAuto;
  // Name and default operation timeout of the root communicator (splits
  // take their own CommOptions). The root's creation must complete within
  // `comm.timeout` on every rank.
  CommOptions comm;
  // The rendezvous of store-based bootstrap; null: $STRATA_STORE.
  std::shared_ptr<Store> store;
  MpiOptions mpi;
  GlooOptions gloo;
  NcclOptions nccl;
  // Gloo: polled while the ranks meet through the store and connect (the
  // connect's waits ask it from another thread, so it must be thread-safe);
  // true ends the creation with Cancelled or Aborted (the elastic layer's
  // fresh job communicator stops waiting for a joiner lost meanwhile).
  // Null: never.
  std::function<bool()> cancelled;
};

// The backends compiled into this build: "mpi" where Open MPI was found,
// "gloo" where Gloo was, "nccl" where CUDA and NCCL were (usable only where
// a GPU is).
STRATA_EXPORT std::vector<std::string> AvailableBackends();

// Resolves "auto" for a launch environment: the backend that
// CreateRootCommunicator would use. Unimplemented when none fits (the
// message says why), InvalidArgument for an unknown name.
STRATA_EXPORT absl::StatusOr<std::string> ResolveBackend(const LaunchEnv& env,
                                                         absl::string_view backend);
// The same, taking the memory kind and the store into account.
STRATA_EXPORT absl::StatusOr<std::string> ResolveBackend(const LaunchEnv& env,
                                                         const RootOptions& options);

// The store the bootstrap would use: options.store, else $STRATA_STORE,
// else null (no store).
STRATA_EXPORT absl::StatusOr<std::shared_ptr<Store>> BootstrapStore(const RootOptions& options);

// Creates the communicator of every rank of the job. Collective. The
// communicator's rank and size match `env` (FailedPrecondition naming both
// when the backend sees a different job, e.g. srun without PMIx).
STRATA_EXPORT absl::StatusOr<std::unique_ptr<Communicator>> CreateRootCommunicator(
    const LaunchEnv& env, const RootOptions& options);

}  // namespace strata
