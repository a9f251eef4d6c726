// The libnccl this process uses, resolved at run time, and the NCCL API as a
// table of function pointers into it.
//
// One NCCL per process (DESIGN.md): two copies of NCCL in one process keep
// two sets of globals (the bootstrap network, the proxy threads, the
// plugin state) and break in ways that are hard to trace. So strata does not
// link libnccl; it resolves it when the first NCCL communicator is made:
//   1. a libnccl already mapped into the process (torch's, from the
//      nvidia/nccl wheel) is used, opened with RTLD_NOLOAD;
//   2. else NcclOptions::library, else $STRATA_NCCL_LIBRARY, else
//      "libnccl.so.2" from the library search path, else the library strata
//      was built against.
// The rule itself, and the reason each file gets, are in comm/nccl_locate.h,
// which reports of the NCCL version share.
// Two different libnccl files mapped at once (distinct real paths), or an
// explicit request for a library other than the one in use, is refused with
// FailedPrecondition naming both paths.
//
//   STRATA_ASSIGN_OR_RETURN(const NcclApi* api, NcclApi::Load(options.nccl.library));
//   std::printf("NCCL %s from %s\n", api->version.ToString().c_str(), api->path.c_str());
//
// The table is process-wide because the library is: once resolved it stays
// loaded for the life of the process (NCCL cannot be unloaded safely while
// its proxy threads may run).
//
// Thread-safety: Load is thread-safe; the table is immutable once returned.
#pragma once

#include <nccl.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "comm/nccl_locate.h"
#include "strata/comm/nccl.h"
#include "strata/comm/nccl_settings.h"

namespace strata::nccl {

// The NCCL entry points strata calls. Those that an older NCCL lacks
// (revoke, shrink, scalable init) are null there.
struct NcclApi {
  std::string path;     // the file in use
  NcclVersion version;  // ncclGetVersion()
  NcclLibrarySource source = NcclLibrarySource::kSearchPath;
  std::string reason;  // why this file (see comm/nccl_locate.h)

  decltype(&::ncclGetVersion) GetVersion = nullptr;
  decltype(&::ncclGetUniqueId) GetUniqueId = nullptr;
  decltype(&::ncclCommInitRankConfig) CommInitRankConfig = nullptr;
  decltype(&::ncclCommInitRankScalable) CommInitRankScalable = nullptr;
  decltype(&::ncclCommSplit) CommSplit = nullptr;
  decltype(&::ncclCommShrink) CommShrink = nullptr;
  decltype(&::ncclCommRevoke) CommRevoke = nullptr;
  decltype(&::ncclCommAbort) CommAbort = nullptr;
  decltype(&::ncclCommFinalize) CommFinalize = nullptr;
  decltype(&::ncclCommDestroy) CommDestroy = nullptr;
  decltype(&::ncclCommGetAsyncError) CommGetAsyncError = nullptr;
  decltype(&::ncclCommCount) CommCount = nullptr;
  decltype(&::ncclCommUserRank) CommUserRank = nullptr;
  decltype(&::ncclGetErrorString) GetErrorString = nullptr;
  decltype(&::ncclGetLastError) GetLastError = nullptr;
  decltype(&::ncclAllReduce) AllReduce = nullptr;
  decltype(&::ncclBroadcast) Broadcast = nullptr;
  decltype(&::ncclReduce) Reduce = nullptr;
  decltype(&::ncclAllGather) AllGather = nullptr;
  decltype(&::ncclReduceScatter) ReduceScatter = nullptr;
  decltype(&::ncclSend) Send = nullptr;
  decltype(&::ncclRecv) Recv = nullptr;
  decltype(&::ncclGroupStart) GroupStart = nullptr;
  decltype(&::ncclGroupEnd) GroupEnd = nullptr;

  // Resolves and loads the process's libnccl on the first call (see the
  // file comment); later calls return the same table after checking that
  // no second copy has been mapped since and that `library`, when not
  // empty, names the copy in use. NotFound when no libnccl can be loaded
  // (naming every candidate tried and dlerror).
  static absl::StatusOr<const NcclApi*> Load(const std::string& library);
  // The table Load resolved, or null before the first successful Load.
  static const NcclApi* Loaded();
};

// The version gates of the fault-handling calls (DESIGN.md): shrink needs
// NCCL 2.27, revoke 2.28.7. OK when `version` has the feature and the
// symbol was found; FailedPrecondition naming both versions when the NCCL in
// use is older; Unimplemented when the version should have it but the
// library does not export it.
inline constexpr NcclVersion kShrinkSince{2, 27, 0};
inline constexpr NcclVersion kRevokeSince{2, 28, 7};
inline constexpr NcclVersion kScalableInitSince{2, 23, 0};
absl::Status CheckFeature(absl::string_view feature, const NcclVersion& since,
                          const NcclVersion& version, bool symbol_present, absl::string_view path);

// ncclResult_t -> absl::Status: "ncclCommInitRankConfig: unhandled cuda
// error (...) [last error]" with a canonical code (remote errors are
// Unavailable, invalid argument/usage InvalidArgument, the rest Internal).
absl::Status NcclError(const NcclApi& api, ncclResult_t result, absl::string_view call,
                       ncclComm_t comm = nullptr);

}  // namespace strata::nccl
