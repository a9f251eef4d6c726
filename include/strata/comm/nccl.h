// The NCCL this process uses (the nccl backend's library), for reports and
// for checking the one-NCCL-per-process rule before building communicators.
//
//   absl::StatusOr<strata::NcclLibraryInfo> nccl = strata::LoadNcclLibrary();
//   if (nccl.ok()) std::printf("NCCL %s from %s (%s)\n", nccl->version.ToString().c_str(),
//                              nccl->path.c_str(), nccl->reason.c_str());
//
// Which file: a libnccl already loaded in the process (torch's) wins; else
// `library`, else $STRATA_NCCL_LIBRARY, else "libnccl.so.2" from the dynamic
// loader's search path, else the one strata was built against (the CUDA
// toolkit's). Two different libnccl files in one process are refused
// (FailedPrecondition naming both); see docs/nccl.md. Which file a process
// gets thus depends on how it was started (with torch imported or not,
// LD_LIBRARY_PATH, ...), so every report of the version names the file and
// the reason.
//
// Thread-safety: thread-safe. LoadNcclLibrary keeps the library loaded for
// the life of the process once resolved; FindNcclLibrary does not.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "strata/base/export.h"
#include "strata/comm/nccl_settings.h"

namespace strata {

// Why a process uses the libnccl it uses.
enum class NcclLibrarySource : uint8_t {
  kAlreadyLoaded,  // mapped into the process before strata looked (by torch, say)
  kOption,         // NcclOptions::library, strata.nccl.library(path)
  kEnvironment,    // $STRATA_NCCL_LIBRARY
  kSearchPath,     // "libnccl.so.2" found by the dynamic loader
  kBuiltAgainst,   // the file strata was built against (the CUDA toolkit's)
};

// "already-loaded", "option", "STRATA_NCCL_LIBRARY", "search-path", "built-against".
STRATA_EXPORT const char* NcclLibrarySourceName(NcclLibrarySource source);

struct STRATA_EXPORT NcclLibraryInfo {
  std::string path;     // the file in use, absolute, symlinks resolved
  NcclVersion version;  // ncclGetVersion()
  NcclLibrarySource source = NcclLibrarySource::kSearchPath;
  // Why that file, for people: "already loaded in this process by torch
  // (.../libtorch_cuda.so links it)", "STRATA_NCCL_LIBRARY=/opt/nccl/lib/libnccl.so.2",
  // "libnccl.so.2 found via the dynamic loader's search path: LD_LIBRARY_PATH
  // entry /opt/nccl/lib", ...
  std::string reason;
};

// Resolves (on the first call, loads) the process's libnccl. NotFound when
// none loads; FailedPrecondition when two copies are loaded or `library`
// names another file than the one in use; Unimplemented in a build without
// NCCL.
STRATA_EXPORT absl::StatusOr<NcclLibraryInfo> LoadNcclLibrary(const std::string& library = "");

// The libnccl this process uses, or would use by the same rule, with its
// version and the reason, for reports (strata-topo, strata.topology). Unlike
// LoadNcclLibrary it does not keep a file it had to open loaded, and it
// works in every build (only ncclGetVersion is called). Errors as
// LoadNcclLibrary, but never Unimplemented.
STRATA_EXPORT absl::StatusOr<NcclLibraryInfo> FindNcclLibrary(const std::string& library = "");

}  // namespace strata
