// The NCCL root communicator: choosing the device, loading NCCL, agreeing
// on the unique ids (store or MPI), nonblocking initialisation.
#include "comm/nccl/nccl_bootstrap.h"

#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "comm/nccl/nccl_communicator.h"
#include "strata/base/status.h"
#include "strata/comm/nccl_profile.h"

#ifdef STRATA_HAVE_MPI
#include "comm/mpi/mpi_communicator.h"
#endif

namespace strata::nccl {

absl::StatusOr<int> UniqueIdCount(int world_size, int ranks_per_id, bool scalable_init) {
  if (ranks_per_id < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("NcclOptions::ranks_per_unique_id ", ranks_per_id, " must be at least 1"));
  }
  if (!scalable_init || world_size <= ranks_per_id) return 1;
  return (world_size + ranks_per_id - 1) / ranks_per_id;
}

int UniqueIdOwner(int index, int count, int world_size) {
  return static_cast<int>(static_cast<int64_t>(index) * world_size / count);
}

absl::StatusOr<std::vector<std::string>> ExchangeUniqueIds(
    Store& store, int rank, int world_size, int count,
    const std::function<absl::StatusOr<std::string>()>& make_id, absl::Time deadline) {
  // Every rank of one initialisation adds 1, so ranks of the g-th
  // initialisation through this store see values in (g*N, (g+1)*N]: a key
  // prefix no earlier or later root shares. A rank cannot start the next
  // initialisation before every rank has read this one's ids, hence has
  // added, so the ranges never interleave.
  STRATA_ASSIGN_OR_RETURN(const int64_t joined, store.Add("strata/nccl/joined", 1, deadline));
  const int64_t generation = (joined - 1) / world_size;
  auto key = [&](int index) { return absl::StrCat("strata/nccl/", generation, "/id/", index); };
  std::vector<std::string> ids(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) {
    if (UniqueIdOwner(i, count, world_size) != rank) continue;
    STRATA_ASSIGN_OR_RETURN(ids[static_cast<size_t>(i)], make_id());
    STRATA_RETURN_IF_ERROR_CTX(store.Set(key(i), ids[static_cast<size_t>(i)], deadline), "rank ",
                               rank, " publishing NCCL unique id ", i);
  }
  for (int i = 0; i < count; ++i) {
    if (UniqueIdOwner(i, count, world_size) == rank) continue;
    absl::StatusOr<std::string> id = store.Get(key(i), deadline);
    if (!id.ok()) {
      return internal::Annotate(
          id.status(),
          absl::StrCat("rank ", rank, " of ", world_size, " waiting for NCCL unique id ", i,
                       " from rank ", UniqueIdOwner(i, count, world_size), " (key '", key(i),
                       "' in ", store.Describe(), ")"));
    }
    ids[static_cast<size_t>(i)] = *std::move(id);
  }
  return ids;
}

namespace {

absl::StatusOr<std::string> MakeUniqueId(const NcclApi& api) {
  ncclUniqueId id;
  STRATA_RETURN_IF_ERROR(NcclError(api, api.GetUniqueId(&id), "ncclGetUniqueId"));
  return std::string(id.internal, sizeof(id.internal));
}

}  // namespace

absl::StatusOr<std::vector<std::string>> UniqueIdsOverMpi(
    const LaunchEnv& env, const RootOptions& options, int count,
    const std::function<absl::StatusOr<std::string>()>& make_id) {
#ifdef STRATA_HAVE_MPI
  RootOptions mpi_options = options;
  mpi_options.backend = "mpi";
  mpi_options.comm.name = "nccl-bootstrap";
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<mpi::MpiCommunicator> mpi,
                          mpi::MpiCommunicator::CreateRoot(mpi_options, env.rank, env.world_size));
  std::string bytes(static_cast<size_t>(count) * NCCL_UNIQUE_ID_BYTES, '\0');
  if (env.rank == 0) {
    for (int i = 0; i < count; ++i) {
      STRATA_ASSIGN_OR_RETURN(std::string id, make_id());
      if (id.size() != NCCL_UNIQUE_ID_BYTES) {
        return absl::InternalError(absl::StrCat("a unique id of ", id.size(), " bytes"));
      }
      std::memcpy(&bytes[static_cast<size_t>(i) * NCCL_UNIQUE_ID_BYTES], id.data(), id.size());
    }
  }
  Buffer buffer{bytes.data(), bytes.size(), DataType::kUInt8};
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Work> work, mpi->Broadcast(buffer, 0, OpOptions()));
  STRATA_RETURN_IF_ERROR_CTX(work->Wait(absl::Now() + options.comm.timeout),
                             "broadcasting the NCCL unique id over MPI");
  std::vector<std::string> ids;
  for (int i = 0; i < count; ++i) {
    ids.push_back(
        bytes.substr(static_cast<size_t>(i) * NCCL_UNIQUE_ID_BYTES, NCCL_UNIQUE_ID_BYTES));
  }
  return ids;
#else
  return absl::FailedPreconditionError(absl::StrCat(
      "the nccl backend needs a store for its unique id (rank ", env.rank, " of ", env.world_size,
      " via ", LauncherName(env.launcher),
      "), and this build has no MPI to use instead: from Python, strata.init() uses torchrun's "
      "store; from C++ pass RootOptions::store or set STRATA_STORE=file:/shared/dir"));
#endif
}

namespace {

int ChooseDevice(const LaunchEnv& env, const NcclOptions& options, int visible) {
  return options.device >= 0 ? options.device : env.local_rank % visible;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclRoot(const LaunchEnv& env,
                                                             const RootOptions& options,
                                                             std::shared_ptr<Store> store) {
  const std::string who = absl::StrCat("rank ", env.rank, " of ", env.world_size);
  STRATA_RETURN_IF_ERROR(CheckNcclOptions(options.nccl, who));
  STRATA_RETURN_IF_ERROR(
      UniqueIdCount(env.world_size, options.nccl.ranks_per_unique_id, true).status());
  const int visible = VisibleDeviceCount();
  if (visible == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the nccl backend needs a CUDA device: no CUDA device is visible to ", who,
        " (CUDA_VISIBLE_DEVICES, driver); use backend 'mpi' or 'gloo' for CPU tensors"));
  }
  const int device = ChooseDevice(env, options.nccl, visible);
  if (device >= visible) {
    return absl::InvalidArgumentError(absl::StrCat("NcclOptions::device ", device, " on ", who,
                                                   ": only ", visible, " devices are visible"));
  }
  STRATA_ASSIGN_OR_RETURN(const NcclApi* api, NcclApi::Load(options.nccl.library));
  // This root's family, with a watchdog of its own at this root's interval.
  STRATA_ASSIGN_OR_RETURN(std::shared_ptr<NcclFamily> family,
                          NcclFamily::Create(options.nccl, env.rank));
  family->api = api;
  family->device = device;

  // The topology profile: environment variables before NCCL's first use,
  // config fields for every communicator. Detection failing is not fatal.
  NcclCommSetupOptions setup_options;
  setup_options.apply_profile = options.nccl.apply_profile;
  setup_options.comm_name = options.comm.name;
  setup_options.nccl_version = api->version;
  setup_options.nccl_library = NcclLibraryInfo{api->path, api->version, api->source, api->reason};
  absl::StatusOr<NcclCommSetup> setup = PrepareNcclCommunicator(setup_options);
  if (setup.ok()) {
    family->profile = setup->config;
    if (setup->first_in_process && env.rank == 0) {
      std::fprintf(stderr, "strata: NCCL %s from %s (%s)\n", api->version.ToString().c_str(),
                   api->path.c_str(), api->reason.c_str());
    }
  } else if (env.rank == 0) {
    std::fprintf(stderr, "strata: NCCL profile not applied: %s\n",
                 std::string(setup.status().message()).c_str());
  }

  const bool scalable = api->CommInitRankScalable != nullptr && api->version >= kScalableInitSince;
  STRATA_ASSIGN_OR_RETURN(
      const int count, UniqueIdCount(env.world_size, options.nccl.ranks_per_unique_id, scalable));
  const absl::Time deadline = absl::Now() + options.comm.timeout;
  std::vector<std::string> ids;
  DeviceGuard guard(device);
  if (env.world_size == 1) {
    STRATA_ASSIGN_OR_RETURN(std::string id, MakeUniqueId(*api));
    ids.push_back(std::move(id));
  } else if (store != nullptr) {
    STRATA_ASSIGN_OR_RETURN(ids, ExchangeUniqueIds(
                                     *store, env.rank, env.world_size, count,
                                     [api] { return MakeUniqueId(*api); }, deadline));
  } else {
    STRATA_ASSIGN_OR_RETURN(
        ids, UniqueIdsOverMpi(env, options, count, [api] { return MakeUniqueId(*api); }));
  }
  std::vector<ncclUniqueId> raw(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i].size() != sizeof(raw[i].internal)) {
      return absl::InternalError(absl::StrCat("NCCL unique id ", i, " has ", ids[i].size(),
                                              " bytes, expected ", sizeof(raw[i].internal)));
    }
    std::memcpy(raw[i].internal, ids[i].data(), sizeof(raw[i].internal));
  }

  ConfigOptions config_options;
  config_options.comm_name = options.comm.name;
  config_options.runtime = api->version;
  NcclConfig config = BuildNcclConfig(family->profile, config_options);
  if (!config.ignored_by_runtime().empty() && env.rank == 0) {
    std::fprintf(stderr, "strata: NCCL %s may ignore these config fields: %s\n",
                 api->version.ToString().c_str(),
                 absl::StrJoin(config.ignored_by_runtime(), ", ").c_str());
  }
  ncclComm_t comm = nullptr;
  const ncclResult_t rc =
      raw.size() > 1
          ? api->CommInitRankScalable(&comm, env.world_size, env.rank, static_cast<int>(raw.size()),
                                      raw.data(), config.get())
          : api->CommInitRankConfig(&comm, env.world_size, raw[0], env.rank, config.get());
  const std::string what = absl::StrCat("NCCL initialisation of ", options.comm.name, " on ", who,
                                        " (device ", device, ", ", raw.size(), " unique ids)");
  absl::Status s = rc == ncclSuccess || rc == ncclInProgress
                       ? WaitNcclReady(*api, comm, deadline, what)
                       : NcclError(*api, rc, what, comm);
  if (!s.ok()) {
    if (comm != nullptr) api->CommAbort(comm);
    return s;
  }
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<NcclCommunicator> root,
                          NcclCommunicator::Wrap(family, comm, options.comm));
  if (root->rank() != env.rank || root->size() != env.world_size) {
    return absl::FailedPreconditionError(absl::StrCat("NCCL sees rank ", root->rank(), " of ",
                                                      root->size(), ", the launcher says ", who));
  }
  return std::unique_ptr<Communicator>(std::move(root));
}

}  // namespace strata::nccl
