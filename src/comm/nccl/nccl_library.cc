#include "comm/nccl/nccl_library.h"

#include <dlfcn.h>
#include <link.h>
#include <stdlib.h>

#include <climits>
#include <cstdlib>
#include <memory>
#include <mutex>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

namespace strata::nccl {
namespace {

std::string RealPath(const std::string& path) {
  char buf[PATH_MAX];
  if (path.empty() || realpath(path.c_str(), buf) == nullptr) return "";
  return buf;
}

int CollectMapped(struct dl_phdr_info* info, size_t, void* data) {
  auto* out = static_cast<std::vector<MappedLibrary>*>(data);
  if (info->dlpi_name == nullptr || !IsNcclLibraryName(info->dlpi_name)) return 0;
  MappedLibrary lib{info->dlpi_name, RealPath(info->dlpi_name)};
  if (lib.real_path.empty()) lib.real_path = lib.path;
  for (const MappedLibrary& seen : *out) {
    if (seen.real_path == lib.real_path) return 0;
  }
  out->push_back(std::move(lib));
  return 0;
}

std::string Paths(absl::Span<const MappedLibrary> mapped) {
  return absl::StrJoin(mapped, ", ", [](std::string* out, const MappedLibrary& m) {
    absl::StrAppend(out, m.real_path);
  });
}

std::string BuiltLibrary() {
#ifdef STRATA_NCCL_BUILT_LIBRARY
  return STRATA_NCCL_BUILT_LIBRARY;
#else
  return "";
#endif
}

template <typename F>
void Bind(void* handle, const char* name, F* slot) {
  *slot = reinterpret_cast<F>(dlsym(handle, name));
}

absl::StatusOr<std::unique_ptr<NcclApi>> Open(const LibraryChoice& choice) {
  std::vector<std::string> failures;
  for (const std::string& path : choice.candidates) {
    const int flags = RTLD_NOW | RTLD_LOCAL | (choice.already_mapped ? RTLD_NOLOAD : 0);
    void* handle = dlopen(path.c_str(), flags);
    if (handle == nullptr) {
      const char* err = dlerror();
      failures.push_back(absl::StrCat(path, ": ", err ? err : "cannot open"));
      continue;
    }
    auto api = std::make_unique<NcclApi>();
    api->reason = choice.reason;
    // The file the loader found (a bare "libnccl.so.2" names no file).
    struct link_map* map = nullptr;
    std::string file = path;
    if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr &&
        *map->l_name != '\0') {
      file = map->l_name;
    }
    api->path = RealPath(file).empty() ? file : RealPath(file);
    // The table is process-wide and never unloaded (see the header), so the
    // handle is intentionally kept open.
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
                          api->CommSplit && api->CommAbort && api->CommFinalize &&
                          api->CommDestroy && api->CommGetAsyncError && api->CommCount &&
                          api->CommUserRank && api->GetErrorString && api->AllReduce &&
                          api->Broadcast && api->Reduce && api->AllGather && api->ReduceScatter &&
                          api->Send && api->Recv && api->GroupStart && api->GroupEnd;
    if (!complete) {
      failures.push_back(absl::StrCat(
          path,
          ": lacks the NCCL calls strata needs (ncclCommInitRankConfig, ncclCommSplit, "
          "ncclSend/ncclRecv, ...); NCCL 2.18 or newer is required"));
      continue;
    }
    int code = 0;
    if (api->GetVersion(&code) != ncclSuccess || code <= 0) {
      failures.push_back(absl::StrCat(path, ": ncclGetVersion failed"));
      continue;
    }
    api->version = NcclVersion::FromCode(code);
    return api;
  }
  return absl::NotFoundError(absl::StrCat("cannot load NCCL (", choice.reason,
                                          "); tried: ", absl::StrJoin(failures, "; ")));
}

}  // namespace

bool IsNcclLibraryName(absl::string_view path) {
  const size_t slash = path.rfind('/');
  absl::string_view base = slash == absl::string_view::npos ? path : path.substr(slash + 1);
  if (!absl::ConsumePrefix(&base, "libnccl.so")) return false;
  // "libnccl.so", or "libnccl.so." followed by a version.
  return base.empty() || base[0] == '.';
}

std::vector<MappedLibrary> MappedNcclLibraries() {
  std::vector<MappedLibrary> out;
  dl_iterate_phdr(&CollectMapped, &out);
  return out;
}

absl::StatusOr<LibraryChoice> ChooseNcclLibrary(
    absl::Span<const MappedLibrary> mapped, const LibraryRequest& request,
    std::string (*real_path_of)(const std::string& path)) {
  if (mapped.size() > 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "two copies of NCCL are loaded in this process (", Paths(mapped),
        "); NCCL keeps process-wide state, so strata refuses to run with both. Load only one: "
        "in Python import torch first and do not preload another libnccl (LD_PRELOAD, "
        "LD_LIBRARY_PATH pointing at a second NCCL)"));
  }
  const std::string& explicit_request = !request.option.empty() ? request.option : request.env;
  const char* explicit_origin =
      !request.option.empty() ? "NcclOptions::library" : "STRATA_NCCL_LIBRARY";
  if (mapped.size() == 1) {
    if (!explicit_request.empty()) {
      const std::string wanted = real_path_of(explicit_request);
      if (wanted != mapped[0].real_path) {
        return absl::FailedPreconditionError(absl::StrCat(
            explicit_origin, " asks for ", explicit_request,
            wanted.empty() ? " (not found)" : absl::StrCat(" (", wanted, ")"),
            ", but this process already loaded NCCL from ", mapped[0].real_path,
            "; one NCCL per process: unset ", explicit_origin, " to use the loaded one"));
      }
    }
    return LibraryChoice{true, {mapped[0].path}, "already loaded in this process"};
  }
  LibraryChoice choice;
  if (!explicit_request.empty()) {
    choice.candidates.push_back(explicit_request);
    choice.reason = absl::StrCat("from ", explicit_origin);
    return choice;
  }
  choice.candidates.push_back("libnccl.so.2");
  choice.reason = "libnccl.so.2 from the library search path";
  if (!request.built.empty()) {
    choice.candidates.push_back(request.built);
    absl::StrAppend(&choice.reason, ", else the one strata was built against");
  }
  return choice;
}

absl::StatusOr<const NcclApi*> NcclApi::Load(const std::string& library) {
  // One table per process, since there is one libnccl per process.
  static std::mutex mu;
  static NcclApi* loaded = nullptr;
  std::lock_guard<std::mutex> lock(mu);
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
  LibraryRequest request;
  request.option = library;
  if (const char* env = std::getenv("STRATA_NCCL_LIBRARY")) request.env = env;
  request.built = BuiltLibrary();
  absl::StatusOr<LibraryChoice> choice = ChooseNcclLibrary(mapped, request, &RealPath);
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
