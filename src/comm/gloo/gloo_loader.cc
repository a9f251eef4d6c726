#include "comm/gloo/gloo_loader.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "strata/base/settings.h"
#include "strata/base/status.h"

namespace strata::gloo {
namespace {

constexpr char kPluginName[] = "libstrata_gloo.so";

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

// The directory of the object (libstrata.so, or a program linking the
// static library) that contains this function.
std::string OwnDirectory() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&OwnDirectory), &info) == 0 || info.dli_fname == nullptr) {
    return "";
  }
  std::string path = info.dli_fname;
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

std::vector<std::string> Candidates(const std::string& path) {
  if (!path.empty()) return {path};
  std::vector<std::string> out;
  const std::string own = OwnDirectory();
  if (!own.empty()) out.push_back(absl::StrCat(own, "/", kPluginName));
#ifdef STRATA_GLOO_PLUGIN_BUILD_PATH
  out.push_back(STRATA_GLOO_PLUGIN_BUILD_PATH);
#endif
#ifdef STRATA_GLOO_PLUGIN_INSTALL_PATH
  out.push_back(STRATA_GLOO_PLUGIN_INSTALL_PATH);
#endif
  return out;
}

}  // namespace

GlooPlugin::~GlooPlugin() {
  // RTLD_NODELETE keeps the code mapped: Gloo's threads and thread-locals
  // may outlive this handle by a little.
  if (handle_ != nullptr) dlclose(handle_);
}

absl::StatusOr<std::shared_ptr<GlooPlugin>> LoadGlooPlugin(const std::string& path) {
  // STRATA_GLOO_PLUGIN and STRATA_GLOO_DEEPBIND, through the settings
  // registry (strata/base/settings.h).
  STRATA_ASSIGN_OR_RETURN(const Settings settings, Settings::FromEnvironment());
  const bool deepbind = !kSanitized && settings.gloo_deepbind;
  int flags = RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE;
  if (deepbind) flags |= RTLD_DEEPBIND;
  const std::vector<std::string> candidates =
      Candidates(path.empty() ? settings.gloo_plugin : path);
  // One load at a time: the first dlopen runs libgloo's static initialisers,
  // and the loader's own lock, which orders them before another thread's
  // use, is invisible to ThreadSanitizer. Holding our mutex makes that order
  // explicit (ranks run as threads in tests, and a process may create
  // several roots at once).
  static std::mutex load_mu;
  std::lock_guard<std::mutex> lock(load_mu);
  for (const std::string& candidate : candidates) {
    if (::access(candidate.c_str(), F_OK) != 0) continue;
    void* handle = dlopen(candidate.c_str(), flags);
    if (handle == nullptr) {
      const char* err = dlerror();
      return absl::FailedPreconditionError(absl::StrCat("cannot load the Gloo plugin ", candidate,
                                                        ": ", err ? err : "unknown error"));
    }
    using Entry = const gloo_plugin::Api* (*)(int);
    auto entry = reinterpret_cast<Entry>(dlsym(handle, "strata_gloo_plugin_api"));
    const gloo_plugin::Api* api = entry ? entry(gloo_plugin::kApiVersion) : nullptr;
    if (api == nullptr || api->size != sizeof(gloo_plugin::Api) || api->create_device == nullptr ||
        api->connect == nullptr) {
      dlclose(handle);
      return absl::FailedPreconditionError(
          absl::StrCat(candidate, " is not a Gloo plugin of this strata build (API version ",
                       gloo_plugin::kApiVersion, ")"));
    }
    return std::make_shared<GlooPlugin>(handle, api, candidate, deepbind);
  }
  return absl::NotFoundError(
      absl::StrCat("the Gloo plugin (", kPluginName, ") was not found; looked at: ",
                   absl::StrJoin(candidates, ", "), " (set STRATA_GLOO_PLUGIN to its path)"));
}

}  // namespace strata::gloo
