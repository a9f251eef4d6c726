// LoadedNcclVersion: ncclGetVersion() of the NCCL this process uses.
#include <dlfcn.h>

#include "absl/strings/str_cat.h"
#include "strata/comm/nccl_settings.h"

namespace strata {

absl::StatusOr<NcclVersion> LoadedNcclVersion(const std::string& library) {
  // One NCCL per process (DESIGN.md): prefer the copy already loaded (torch's
  // wheel, say); load `library` only when none is.
  bool loaded_here = false;
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (handle == nullptr) {
    handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
    loaded_here = handle != nullptr;
  }
  if (handle == nullptr) {
    const char* err = dlerror();
    return absl::NotFoundError(
        absl::StrCat("cannot load ", library, ": ", err ? err : "unknown error"));
  }
  using GetVersion = int (*)(int*);
  auto get = reinterpret_cast<GetVersion>(dlsym(handle, "ncclGetVersion"));
  int code = 0;
  int rc = get ? get(&code) : -1;
  if (loaded_here) dlclose(handle);
  if (get == nullptr || rc != 0 || code <= 0) {
    return absl::NotFoundError(absl::StrCat(library, " has no working ncclGetVersion"));
  }
  return NcclVersion::FromCode(code);
}

}  // namespace strata
