// LoadedNcclVersion: ncclGetVersion() of the NCCL this process uses.
#include "strata/comm/nccl.h"
#include "strata/comm/nccl_settings.h"

namespace strata {

absl::StatusOr<NcclVersion> LoadedNcclVersion(const std::string& library) {
  // The same rule as the NCCL backend (strata/comm/nccl.h): the copy already
  // loaded (torch's wheel, say), else the one the backend would load.
  absl::StatusOr<NcclLibraryInfo> info = FindNcclLibrary(library);
  if (!info.ok()) return info.status();
  return info->version;
}

}  // namespace strata
