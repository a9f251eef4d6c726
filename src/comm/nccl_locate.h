// Which libnccl this process uses, and why: the rule the NCCL backend loads
// by, and the probe every report of the NCCL version goes through, so that
// strata-topo, strata.topology, strata.nccl and the backend's own log line
// name the same file for the same reason. Compiled in every build (it needs
// no nccl.h: only ncclGetVersion is called, through dlsym).
//
// The rule (one NCCL per process, DESIGN.md):
//   1. a libnccl already mapped into the process (torch's, from the
//      nvidia-nccl wheel) is the one;
//   2. else NcclOptions::library, else $STRATA_NCCL_LIBRARY, else
//      "libnccl.so.2" from the dynamic loader's search path, else the
//      library strata was built against (the CUDA toolkit's).
// Each candidate carries its reason; once a file is open the reason is made
// precise: which object links an already-mapped copy ("by torch"), which
// entry of the search path (LD_LIBRARY_PATH, a RUNPATH, the ldconfig cache)
// found "libnccl.so.2".
//
//   absl::StatusOr<strata::NcclLibraryInfo> nccl = strata::nccl::ProbeNcclLibrary("");
//   std::printf("NCCL %s from %s (%s)\n", nccl->version.ToString().c_str(),
//               nccl->path.c_str(), nccl->reason.c_str());
//
// Thread-safety: the pure functions are; ProbeNcclLibrary and OpenNcclLibrary
// call dlopen, which is thread-safe.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "strata/comm/nccl.h"

namespace strata::nccl {

// A libnccl mapped into the process: the path the loader recorded, its real
// path (symlinks resolved), which identifies the copy, and the object that
// links it (DT_NEEDED), when one does.
struct MappedLibrary {
  std::string path;
  std::string real_path;
  // e.g. ".../site-packages/torch/lib/libtorch_cuda.so"; empty when no
  // mapped object names libnccl in DT_NEEDED (it was dlopen'ed).
  std::string needed_by;
};

// The libnccl files mapped into this process now (dl_iterate_phdr), one per
// real path. Network plugins (libnccl-net*.so) and tuner plugins are not
// NCCL itself and are left out. `with_linkers` also fills needed_by, which
// reads the ELF headers of every mapped object (a few milliseconds; only
// done when a libnccl is mapped).
std::vector<MappedLibrary> MappedNcclLibraries(bool with_linkers = false);

// True for the file name of NCCL itself: "libnccl.so", "libnccl.so.2",
// "libnccl.so.2.28.9" (any directory); false for plugins such as
// "libnccl-net.so".
bool IsNcclLibraryName(absl::string_view path);

// The dynamic section of an ELF64 shared object or program, read from the
// file: DT_NEEDED ("libc.so.6", ...) and the DT_RUNPATH / DT_RPATH entries
// as written ("$ORIGIN/../lib"). Empty when the file cannot be read or is
// not ELF64.
struct ElfDynamic {
  std::vector<std::string> needed;
  std::vector<std::string> runpath;  // DT_RUNPATH, else DT_RPATH, split at ':'
};
ElfDynamic ReadElfDynamic(const std::string& path);

// Where the library may come from, for ChooseNcclLibrary.
struct LibraryRequest {
  // NcclOptions::library / strata.nccl.library(path) (empty: none).
  std::string option;
  // $STRATA_NCCL_LIBRARY (empty: unset).
  std::string env;
  // The library strata was built against (empty: unknown).
  std::string built;
  // Where `built` came from at configure time, for the reason: "the CUDA
  // toolkit", "NCCL_HOME".
  std::string built_origin;
};

// The request of this process: `option`, $STRATA_NCCL_LIBRARY (read
// through the settings registry, strata/base/settings.h, which rejects a
// malformed STRATA_* variable by name), and the library this build of strata
// was configured with.
absl::StatusOr<LibraryRequest> RequestFromEnvironment(const std::string& option);

// One file to try, and why it is the one.
struct Candidate {
  std::string path;
  NcclLibrarySource source = NcclLibrarySource::kSearchPath;
  std::string reason;
};

// What to dlopen, in order: the first that opens wins.
struct LibraryChoice {
  // True when `candidates` holds the one copy already mapped (open it with
  // RTLD_NOLOAD).
  bool already_mapped = false;
  std::vector<Candidate> candidates;
  // The request it was made from (SearchPathReason compares with `built`).
  LibraryRequest request;
};

// The rule above as a pure function. `mapped`: MappedNcclLibraries().
// `real_path_of` resolves a requested path to compare it with a mapped one
// (returns empty when the file does not exist). FailedPrecondition when two
// copies are mapped, or when the request names a file other than the
// mapped copy.
absl::StatusOr<LibraryChoice> ChooseNcclLibrary(
    absl::Span<const MappedLibrary> mapped, const LibraryRequest& request,
    std::string (*real_path_of)(const std::string& path));

// A directory the dynamic loader searches when an object asks for a bare
// "libnccl.so.2" (dlinfo RTLD_DI_SERINFO), in search order.
struct SearchDir {
  enum class Kind { kLdLibraryPath, kRunpath, kSystem };
  std::string dir;
  Kind kind = Kind::kSystem;
};

// Labels the loader's search list (`serinfo`, RTLD_DI_SERINFO's directories
// in order; glibc leaves its flags unset) by where each entry comes from:
// `ld_library_path` ($LD_LIBRARY_PATH), `runpath` (the requester's
// RUNPATH, $ORIGIN already expanded), else the system directories.
std::vector<SearchDir> ClassifySearchDirs(absl::Span<const std::string> serinfo,
                                          const std::string& ld_library_path,
                                          absl::Span<const std::string> runpath);

// Why a dlopen("libnccl.so.2") found `found` (a real path): the first
// LD_LIBRARY_PATH or RUNPATH entry of `dirs` whose libnccl.so.2 is that
// file, else the loader's cache or a system directory (they come after
// those). `requester` names the object whose RUNPATH was searched. Adds
// that the file is the one strata was built against when it is.
std::string SearchPathReason(const std::string& found, absl::Span<const SearchDir> dirs,
                             const std::string& requester, const LibraryRequest& request,
                             std::string (*real_path_of)(const std::string& path));

// A library opened by OpenNcclLibrary.
struct OpenedLibrary {
  void* handle = nullptr;  // dlopen's; the caller closes it or keeps it
  NcclLibraryInfo info;    // real path, version, source, precise reason
};

// Opens the candidates of `choice` in order (RTLD_NOW | RTLD_LOCAL, plus
// RTLD_NOLOAD for an already-mapped copy) and returns the first one that
// opens, has a working ncclGetVersion and passes `check` (which sees the
// handle; a non-OK status rejects the file and the next is tried). NotFound
// names every candidate tried and why it failed.
absl::StatusOr<OpenedLibrary> OpenNcclLibrary(
    const LibraryChoice& choice, const std::function<absl::Status(void* handle)>& check);

// The libnccl this process would use (or uses) by the rule above, its
// version, and why, without keeping a newly opened file loaded: a report
// must not leave a second NCCL behind for torch to collide with. Errors as
// ChooseNcclLibrary and OpenNcclLibrary.
absl::StatusOr<NcclLibraryInfo> ProbeNcclLibrary(const std::string& option);

// The real path of `path` (symlinks resolved), or "" when it does not exist.
std::string RealPath(const std::string& path);

}  // namespace strata::nccl
