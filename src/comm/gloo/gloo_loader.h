// Finding and loading the Gloo plugin (libstrata_gloo.so; plugin_api.h says
// why Gloo lives in a plugin).
//
//   STRATA_ASSIGN_OR_RETURN(std::shared_ptr<GlooPlugin> plugin, LoadGlooPlugin(""));
//   plugin->api().create_device(...);
//
// Where: `path` if given, else $STRATA_GLOO_PLUGIN, else beside the library
// or program that contains libstrata's code, else the build tree and the
// install directory this build knows. The plugin is opened with
// RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND | RTLD_NODELETE: its symbols (and
// libgloo's) stay out of the global scope, and its own references resolve
// inside it first. STRATA_GLOO_DEEPBIND=0 leaves out RTLD_DEEPBIND (for the
// isolation test that shows why it is there); sanitizer builds leave it out
// too (ASan and TSan refuse RTLD_DEEPBIND). Both variables are read through
// the settings registry (strata/base/settings.h) when the plugin is loaded:
// the communicator code that calls this has no option that carries them.
//
// Thread-safety: LoadGlooPlugin may be called from any thread.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "comm/gloo/plugin_api.h"

namespace strata::gloo {

class GlooPlugin {
 public:
  GlooPlugin(void* handle, const gloo_plugin::Api* api, std::string path, bool deepbind)
      : handle_(handle), api_(api), path_(std::move(path)), deepbind_(deepbind) {}
  ~GlooPlugin();
  GlooPlugin(const GlooPlugin&) = delete;
  GlooPlugin& operator=(const GlooPlugin&) = delete;

  const gloo_plugin::Api& api() const { return *api_; }
  const std::string& path() const { return path_; }
  bool deepbind() const { return deepbind_; }

 private:
  void* handle_;
  const gloo_plugin::Api* api_;
  std::string path_;
  bool deepbind_;
};

// NotFound lists the places searched; FailedPrecondition when the file is
// not a plugin of this build (dlerror's message, or the version);
// InvalidArgument for a malformed STRATA_* variable, naming it.
absl::StatusOr<std::shared_ptr<GlooPlugin>> LoadGlooPlugin(const std::string& path);

}  // namespace strata::gloo
