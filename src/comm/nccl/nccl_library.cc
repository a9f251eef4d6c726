#include "comm/nccl/nccl_library.h"

#include <dlfcn.h>

#include <atomic>
#include <memory>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "strata/base/status.h"

namespace strata::nccl {
namespace {

std::string Paths(const std::vector<MappedLibrary>& mapped) {
  return absl::StrJoin(mapped, ", ", [](std::string* out, const MappedLibrary& m) {
    absl::StrAppend(out, m.real_path);
  });
}

template <typename F>
void Bind(void* handle, const char* name, F* slot) {
  *slot = reinterpret_cast<F>(dlsym(handle, name));
}

// Binds every entry point of an opened libnccl; an error when one that
// every supported NCCL has is missing.
absl::Status BindAll(void* handle, NcclApi* api) {
  Bind(handle, "ncclGetVersion", &api->GetVersion);
  Bind(handle, "ncclGetUniqueId", &api->GetUniqueId);
  Bind(handle, "ncclCommInitRankConfig", &api->CommInitRankConfig);
  Bind(handle, "ncclCommInitRankScalable", &api->CommInitRankScalable);
  Bind(handle, "ncclCommSplit", &api->CommSplit);
  Bind(handle, "ncclCommShrink", &api->CommShrink);
  Bind(handle, "ncclCommRevoke", &api->CommRevoke);
  Bind(handle, "ncclCommAbort", &api->CommAbort);
  Bind(handle, "ncclCommFinalize", &api->CommFinalize);
  Bind(handle, "ncclCommDestroy", &api->CommDestroy);
  Bind(handle, "ncclCommGetAsyncError", &api->CommGetAsyncError);
  Bind(handle, "ncclCommCount", &api->CommCount);
  Bind(handle, "ncclCommUserRank", &api->CommUserRank);
  Bind(handle, "ncclGetErrorString", &api->GetErrorString);
  Bind(handle, "ncclGetLastError", &api->GetLastError);
  Bind(handle, "ncclAllReduce", &api->AllReduce);
  Bind(handle, "ncclBroadcast", &api->Broadcast);
  Bind(handle, "ncclReduce", &api->Reduce);
  Bind(handle, "ncclAllGather", &api->AllGather);
  Bind(handle, "ncclReduceScatter", &api->ReduceScatter);
  Bind(handle, "ncclSend", &api->Send);
  Bind(handle, "ncclRecv", &api->Recv);
  Bind(handle, "ncclGroupStart", &api->GroupStart);
  Bind(handle, "ncclGroupEnd", &api->GroupEnd);
  // Everything but the newer fault-handling and init calls is in every
  // NCCL that has nonblocking communicators (2.14+).
  const bool complete = api->GetVersion && api->GetUniqueId && api->CommInitRankConfig &&
                        api->CommSplit && api->CommAbort && api->CommFinalize && api->CommDestroy &&
                        api->CommGetAsyncError && api->CommCount && api->CommUserRank &&
                        api->GetErrorString && api->AllReduce && api->Broadcast && api->Reduce &&
                        api->AllGather && api->ReduceScatter && api->Send && api->Recv &&
                        api->GroupStart && api->GroupEnd;
  if (!complete) {
    return absl::FailedPreconditionError(
        "lacks the NCCL calls strata needs (ncclCommInitRankConfig, ncclCommSplit, "
        "ncclSend/ncclRecv, ...); NCCL 2.18 or newer is required");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<NcclApi>> Open(const LibraryChoice& choice) {
  auto api = std::make_unique<NcclApi>();
  // The table is process-wide and never unloaded (see the header), so the
  // handle is intentionally kept open.
  STRATA_ASSIGN_OR_RETURN(OpenedLibrary opened, OpenNcclLibrary(choice, [&api](void* handle) {
                            return BindAll(handle, api.get());
                          }));
  api->path = opened.info.path;
  api->version = opened.info.version;
  api->source = opened.info.source;
  api->reason = opened.info.reason;
  return api;
}

// The process's table, once Load resolved it. Process-wide because the
// library is (one NCCL per process, never unloaded; see the header); the
// atomic lets reports (FindNcclLibrary) ask without taking the lock.
struct Resolved {
  std::mutex mu;
  std::atomic<const NcclApi*> api{nullptr};
};

Resolved& Process() {
  static Resolved* const r = new Resolved();
  return *r;
}

}  // namespace

const NcclApi* NcclApi::Loaded() { return Process().api.load(std::memory_order_acquire); }

absl::StatusOr<const NcclApi*> NcclApi::Load(const std::string& library) {
  // One table per process, since there is one libnccl per process.
  Resolved& process = Process();
  std::lock_guard<std::mutex> lock(process.mu);
  const NcclApi* loaded = process.api.load(std::memory_order_relaxed);
  const std::vector<MappedLibrary> mapped = MappedNcclLibraries();
  if (loaded != nullptr) {
    // A second copy may have been mapped since (a library imported later).
    if (mapped.size() > 1) {
      return absl::FailedPreconditionError(
          absl::StrCat("a second NCCL was loaded into this process after strata started using ",
                       loaded->path, " (now loaded: ", Paths(mapped),
                       "); one NCCL per process: import torch (or whatever "
                       "loads NCCL) before strata creates NCCL communicators"));
    }
    if (!library.empty() && RealPath(library) != loaded->path) {
      return absl::FailedPreconditionError(absl::StrCat(
          "NcclOptions::library asks for ", library, ", but this process already uses NCCL ",
          loaded->version.ToString(), " from ", loaded->path, "; one NCCL per process"));
    }
    return loaded;
  }
  absl::StatusOr<LibraryRequest> request = RequestFromEnvironment(library);
  if (!request.ok()) return request.status();
  absl::StatusOr<LibraryChoice> choice =
      ChooseNcclLibrary(MappedNcclLibraries(/*with_linkers=*/true), *request, &RealPath);
  if (!choice.ok()) return choice.status();
  absl::StatusOr<std::unique_ptr<NcclApi>> api = Open(*choice);
  if (!api.ok()) return api.status();
  // Loading may itself have mapped a second copy (a dependency of the file
  // asked for): check again.
  const std::vector<MappedLibrary> after = MappedNcclLibraries();
  if (after.size() > 1) {
    return absl::FailedPreconditionError(absl::StrCat("loading ", (*api)->path,
                                                      " left two copies of NCCL in this process (",
                                                      Paths(after), "); one NCCL per process"));
  }
  loaded = api->release();  // lives for the process, like the library
  process.api.store(loaded, std::memory_order_release);
  return loaded;
}

absl::Status CheckFeature(absl::string_view feature, const NcclVersion& since,
                          const NcclVersion& version, bool symbol_present, absl::string_view path) {
  if (version < since) {
    return absl::FailedPreconditionError(absl::StrCat(feature, " needs NCCL ", since.ToString(),
                                                      " or newer; the NCCL in use is ",
                                                      version.ToString(), " (", path, ")"));
  }
  if (!symbol_present) {
    return absl::UnimplementedError(absl::StrCat("the NCCL in use (", version.ToString(), ", ",
                                                 path, ") does not export ", feature));
  }
  return absl::OkStatus();
}

absl::Status NcclError(const NcclApi& api, ncclResult_t result, absl::string_view call,
                       ncclComm_t comm) {
  if (result == ncclSuccess) return absl::OkStatus();
  std::string message = absl::StrCat(call, ": ", api.GetErrorString(result));
  if (api.GetLastError != nullptr) {
    const char* last = api.GetLastError(comm);
    if (last != nullptr && *last != '\0') absl::StrAppend(&message, " (", last, ")");
  }
  switch (result) {
    case ncclRemoteError:
    case ncclSystemError:
      return absl::UnavailableError(message);
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace strata::nccl
