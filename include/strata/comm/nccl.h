// The NCCL this process uses (the nccl backend's library), for reports and
// for checking the one-NCCL-per-process rule before building communicators.
//
//   absl::StatusOr<strata::NcclLibraryInfo> nccl = strata::LoadNcclLibrary();
//   if (nccl.ok()) std::printf("NCCL %s from %s\n", nccl->version.ToString().c_str(),
//                              nccl->path.c_str());
//
// Which file: a libnccl already loaded in the process (torch's) wins; else
// `library`, else $STRATA_NCCL_LIBRARY, else "libnccl.so.2" from the library
// search path, else the one strata was built against. Two different libnccl
// files in one process are refused (FailedPrecondition naming both); see
// docs/nccl.md.
//
// Thread-safety: thread-safe. The library stays loaded for the life of the
// process once resolved.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "strata/base/export.h"
#include "strata/comm/nccl_settings.h"

namespace strata {

struct STRATA_EXPORT NcclLibraryInfo {
  std::string path;     // the file in use, symlinks resolved
  NcclVersion version;  // ncclGetVersion()
  std::string reason;   // "already loaded in this process", ...
};

// Resolves (on the first call, loads) the process's libnccl. NotFound when
// none loads; FailedPrecondition when two copies are loaded or `library`
// names another file than the one in use; Unimplemented in a build without
// NCCL.
STRATA_EXPORT absl::StatusOr<NcclLibraryInfo> LoadNcclLibrary(const std::string& library = "");

}  // namespace strata
