#include "strata/comm/backend.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "strata/base/status.h"

#ifdef STRATA_HAVE_MPI
#include "comm/mpi/mpi_communicator.h"
#endif

namespace strata {

std::vector<std::string> AvailableBackends() {
  std::vector<std::string> backends;
#ifdef STRATA_HAVE_MPI
  backends.push_back("mpi");
#endif
  return backends;
}

absl::StatusOr<std::string> ResolveBackend(const LaunchEnv& env, absl::string_view backend) {
  const std::vector<std::string> available = AvailableBackends();
  const bool have_mpi = !available.empty() && available.front() == "mpi";
  const std::string list = available.empty() ? "none" : absl::StrJoin(available, ", ");
  if (backend == "auto") {
    if (env.launcher == Launcher::kTorchrun) {
      return absl::UnimplementedError(
          "a torchrun launch needs a store-bootstrapped backend (gloo or nccl), which this "
          "release does not have yet; launch with mpirun (or srun with PMIx) for the mpi backend");
    }
    if (!have_mpi) {
      return absl::UnimplementedError(
          "this build of strata has no communication backend (it was built without Open MPI; "
          "configure with STRATA_WITH_MPI=ON)");
    }
    return std::string("mpi");
  }
  if (backend == "mpi") {
    if (!have_mpi) {
      return absl::UnimplementedError(
          "backend 'mpi' is not in this build (built without Open MPI; configure with "
          "STRATA_WITH_MPI=ON)");
    }
    return std::string("mpi");
  }
  if (backend == "nccl" || backend == "gloo") {
    return absl::UnimplementedError(absl::StrCat(
        "backend '", backend, "' is not available in this release (available: ", list, ")"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown backend '", backend, "' (available: ", list, ", or auto)"));
}

absl::StatusOr<std::unique_ptr<Communicator>> CreateRootCommunicator(const LaunchEnv& env,
                                                                     const RootOptions& options) {
  if (options.version != RootOptions::kVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("RootOptions version ", options.version,
                     " is not supported (this build: ", RootOptions::kVersion, ")"));
  }
  STRATA_ASSIGN_OR_RETURN(std::string backend, ResolveBackend(env, options.backend));
#ifdef STRATA_HAVE_MPI
  if (backend == "mpi") {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<mpi::MpiCommunicator> root,
                            mpi::MpiCommunicator::CreateRoot(options, env.rank, env.world_size));
    return std::unique_ptr<Communicator>(std::move(root));
  }
#endif
  return absl::InternalError(absl::StrCat("backend '", backend, "' resolved but not built"));
}

}  // namespace strata
