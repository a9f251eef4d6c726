// strata::LoadNcclLibrary and strata::FindNcclLibrary (strata/comm/nccl.h):
// the public face of the NCCL backend's loader, present in every build.
#include "comm/nccl_locate.h"
#include "strata/comm/nccl.h"

#ifdef STRATA_HAVE_NCCL
#include "comm/nccl/nccl_library.h"
#endif

namespace strata {

const char* NcclLibrarySourceName(NcclLibrarySource source) {
  switch (source) {
    case NcclLibrarySource::kAlreadyLoaded:
      return "already-loaded";
    case NcclLibrarySource::kOption:
      return "option";
    case NcclLibrarySource::kEnvironment:
      return "STRATA_NCCL_LIBRARY";
    case NcclLibrarySource::kSearchPath:
      return "search-path";
    case NcclLibrarySource::kBuiltAgainst:
      return "built-against";
  }
  return "unknown";
}

absl::StatusOr<NcclLibraryInfo> LoadNcclLibrary(const std::string& library) {
#ifdef STRATA_HAVE_NCCL
  absl::StatusOr<const nccl::NcclApi*> api = nccl::NcclApi::Load(library);
  if (!api.ok()) return api.status();
  return NcclLibraryInfo{(*api)->path, (*api)->version, (*api)->source, (*api)->reason};
#else
  return absl::UnimplementedError(
      "this build of strata has no NCCL backend (configure with STRATA_WITH_NCCL=ON)");
#endif
}

absl::StatusOr<NcclLibraryInfo> FindNcclLibrary(const std::string& library) {
#ifdef STRATA_HAVE_NCCL
  // Once the backend has loaded its library, that is the answer (with the
  // reason it was chosen for); Load also refuses a request for another file.
  if (nccl::NcclApi::Loaded() != nullptr) return LoadNcclLibrary(library);
#endif
  return nccl::ProbeNcclLibrary(library);
}

}  // namespace strata
