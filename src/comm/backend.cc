#include "strata/comm/backend.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/root_settings.h"
#include "comm/validate.h"
#include "strata/base/status.h"

#ifdef STRATA_HAVE_MPI
#include "comm/mpi/mpi_communicator.h"
#endif
#ifdef STRATA_HAVE_GLOO
#include "comm/gloo/gloo_communicator.h"
#endif
#ifdef STRATA_HAVE_NCCL
#include "comm/nccl/nccl_communicator.h"
#endif

namespace strata {
namespace {

bool Built(absl::string_view backend) {
  for (const std::string& b : AvailableBackends()) {
    if (b == backend) return true;
  }
  return false;
}

std::string List() {
  const std::vector<std::string> available = AvailableBackends();
  return available.empty() ? "none" : absl::StrJoin(available, ", ");
}

// Whether a CUDA device is visible (false without CUDA or NCCL in the build).
bool GpuVisible() {
#ifdef STRATA_HAVE_NCCL
  return nccl::VisibleDeviceCount() > 0;
#else
  return false;
#endif
}

absl::Status NotBuilt(absl::string_view backend) {
  const char* why = backend == "mpi" ? "built without Open MPI; configure with STRATA_WITH_MPI=ON"
                    : backend == "gloo" ? "built without Gloo (libgloo-dev); configure with "
                                          "STRATA_WITH_GLOO=ON"
                                        : "built without CUDA and NCCL; configure with "
                                          "STRATA_WITH_NCCL=ON";
  return absl::UnimplementedError(absl::StrCat("backend '", backend, "' is not in this build (",
                                               why, "); available: ", List()));
}

}  // namespace

namespace comm_internal {

absl::StatusOr<std::shared_ptr<Store>> ResolveStore(const RootOptions& options,
                                                    const Settings& settings) {
  if (options.store != nullptr) return options.store;
  if (settings.store.empty()) return std::shared_ptr<Store>();
  absl::StatusOr<std::shared_ptr<Store>> store = OpenStore(settings.store);
  if (!store.ok()) return internal::Annotate(store.status(), "STRATA_STORE");
  return store;
}

RootOptions ResolveRootOptions(RootOptions options, const Settings& settings) {
  if (!options.mpi.oversubscribed) options.mpi.oversubscribed = settings.oversubscribed;
  options.nccl.apply_profile = options.nccl.apply_profile && settings.nccl_profile;
  return options;
}

}  // namespace comm_internal

std::vector<std::string> AvailableBackends() {
  std::vector<std::string> backends;
#ifdef STRATA_HAVE_MPI
  backends.push_back("mpi");
#endif
#ifdef STRATA_HAVE_GLOO
  backends.push_back("gloo");
#endif
#ifdef STRATA_HAVE_NCCL
  backends.push_back("nccl");
#endif
  return backends;
}

absl::StatusOr<std::shared_ptr<Store>> BootstrapStore(const RootOptions& options) {
  if (options.store != nullptr) return options.store;
  STRATA_ASSIGN_OR_RETURN(const Settings settings, Settings::FromEnvironment());
  return comm_internal::ResolveStore(options, settings);
}

absl::StatusOr<std::string> ResolveBackend(const LaunchEnv& env, absl::string_view backend) {
  RootOptions options;
  options.backend = std::string(backend);
  return ResolveBackend(env, options);
}

absl::StatusOr<std::string> ResolveBackend(const LaunchEnv& env, const RootOptions& options) {
  const absl::string_view backend = options.backend;
  if (backend == "mpi" || backend == "gloo" || backend == "nccl") {
    if (!Built(backend)) return NotBuilt(backend);
    return std::string(backend);
  }
  if (backend != "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown backend '", backend, "' (available: ", List(), ", or auto)"));
  }
  if (options.memory == RootMemory::kDevice ||
      (options.memory == RootMemory::kAuto && Built("nccl") && GpuVisible())) {
    if (!Built("nccl")) return NotBuilt("nccl");
    return std::string("nccl");
  }
  const bool torchrun = env.launcher == Launcher::kTorchrun;
  if (torchrun || !Built("mpi")) {
    if (Built("gloo")) return std::string("gloo");
    if (torchrun) {
      return absl::UnimplementedError(absl::StrCat(
          "a torchrun launch needs a store-bootstrapped backend (gloo or nccl), and this build "
          "has neither (available: ",
          List(), "); configure with STRATA_WITH_GLOO=ON"));
    }
    return absl::UnimplementedError(
        "this build of strata has no host communication backend (configure with "
        "STRATA_WITH_MPI=ON or STRATA_WITH_GLOO=ON)");
  }
  return std::string("mpi");
}

absl::StatusOr<std::unique_ptr<Communicator>> CreateRootCommunicator(const LaunchEnv& env,
                                                                     const RootOptions& given) {
  if (given.version != RootOptions::kVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("RootOptions version ", given.version,
                     " is not supported (this build: ", RootOptions::kVersion, ")"));
  }
  // The one reading of strata's environment variables for this root and
  // every communicator split from it.
  STRATA_ASSIGN_OR_RETURN(const Settings settings, Settings::FromEnvironment());
  const RootOptions options = comm_internal::ResolveRootOptions(given, settings);
  // The one check of a root's options, whatever the backend (Communicator
  // checks those of splits and shrinks).
  STRATA_RETURN_IF_ERROR(comm_internal::CheckCommOptions(options.comm));
  STRATA_ASSIGN_OR_RETURN(std::string backend, ResolveBackend(env, options));
#ifdef STRATA_HAVE_MPI
  if (backend == "mpi") {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<mpi::MpiCommunicator> root,
                            mpi::MpiCommunicator::CreateRoot(options, env.rank, env.world_size));
    return std::unique_ptr<Communicator>(std::move(root));
  }
#endif
#ifdef STRATA_HAVE_GLOO
  if (backend == "gloo") {
    STRATA_ASSIGN_OR_RETURN(std::shared_ptr<Store> store,
                            comm_internal::ResolveStore(options, settings));
    if (store == nullptr && env.world_size > 1) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the gloo backend bootstraps through a store, and none was given (rank ", env.rank,
          " of ", env.world_size, " via ", LauncherName(env.launcher),
          "): from Python, strata.init() uses torchrun's store at MASTER_ADDR:MASTER_PORT; from "
          "C++, pass RootOptions::store (strata::torch::ConnectC10dStore when linking LibTorch) "
          "or set STRATA_STORE=file:/a/directory/every/rank/sees"));
    }
    STRATA_ASSIGN_OR_RETURN(
        std::unique_ptr<gloo::GlooCommunicator> root,
        gloo::GlooCommunicator::CreateRoot(options, std::move(store), env.rank, env.world_size));
    return std::unique_ptr<Communicator>(std::move(root));
  }
#endif
#ifdef STRATA_HAVE_NCCL
  if (backend == "nccl") {
    STRATA_ASSIGN_OR_RETURN(std::shared_ptr<Store> store,
                            comm_internal::ResolveStore(options, settings));
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> root,
                            nccl::CreateNcclRoot(env, options, std::move(store)));
    return root;
  }
#endif
  return absl::InternalError(absl::StrCat("backend '", backend, "' resolved but not built"));
}

}  // namespace strata
