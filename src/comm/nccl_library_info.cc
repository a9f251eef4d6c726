// strata::LoadNcclLibrary (strata/comm/nccl.h): the public face of the NCCL
// backend's loader, present in every build.
#include "strata/comm/nccl.h"

#ifdef STRATA_HAVE_NCCL
#include "comm/nccl/nccl_library.h"
#endif

namespace strata {

absl::StatusOr<NcclLibraryInfo> LoadNcclLibrary(const std::string& library) {
#ifdef STRATA_HAVE_NCCL
  absl::StatusOr<const nccl::NcclApi*> api = nccl::NcclApi::Load(library);
  if (!api.ok()) return api.status();
  return NcclLibraryInfo{(*api)->path, (*api)->version, (*api)->reason};
#else
  return absl::UnimplementedError(
      "this build of strata has no NCCL backend (configure with STRATA_WITH_NCCL=ON)");
#endif
}

}  // namespace strata
