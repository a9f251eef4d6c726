// PrepareNcclCommunicator: applies the NCCL profile once per process and
// gives each new communicator its ncclConfig_t fields.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "comm/nccl_tuning/nccl_setup_internal.h"
#include "strata/base/settings.h"
#include "strata/base/status.h"
#include "strata/comm/nccl_profile.h"

namespace strata {
namespace {

// The one piece of process-wide state in this area, and why: NCCL reads its
// environment variables once per process, at their first use, and caches
// them (src/misc/param.cc), so the profile's variables can only be applied
// once, before the first communicator, and re-applying them later would have
// no effect on NCCL. This latch mirrors that per-process fact: it remembers
// the profile that was applied and what was set, so later communicators get
// the same profile and the log is written once. Everything else a
// communicator needs is returned to the caller.
struct ProcessSetup {
  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  NcclProfile profile ABSL_GUARDED_BY(mu);
  std::vector<std::string> env_set ABSL_GUARDED_BY(mu);
  bool applied ABSL_GUARDED_BY(mu) = false;
};

ProcessSetup& Process() {
  static ProcessSetup* const setup = new ProcessSetup();
  return *setup;
}

// The caller's apply_profile, and STRATA_NCCL_PROFILE (a boolean setting:
// unset applies the profile, 0 opts out, anything but a boolean is rejected
// rather than guessed).
absl::StatusOr<bool> OptedOut(const NcclCommSetupOptions& options) {
  STRATA_ASSIGN_OR_RETURN(const Settings settings, Settings::FromEnvironment());
  return !options.apply_profile || !settings.nccl_profile;
}

void Log(const NcclCommSetupOptions& options, const std::string& line) {
  if (options.log) {
    options.log(line);
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
}

}  // namespace

namespace nccl_tuning_internal {
void ResetNcclSetupForTesting() {
  ProcessSetup& p = Process();
  absl::MutexLock lock(&p.mu);
  p.done = false;
  p.profile = NcclProfile();
  p.env_set.clear();
  p.applied = false;
}
}  // namespace nccl_tuning_internal

absl::StatusOr<NcclCommSetup> PrepareNcclCommunicator(const NcclCommSetupOptions& options) {
  ProcessSetup& proc = Process();
  absl::MutexLock lock(&proc.mu);
  NcclCommSetup out;
  STRATA_ASSIGN_OR_RETURN(const bool opted_out, OptedOut(options));
  if (!proc.done) {
    NcclVersion version = NewestKnownNcclVersion();
    std::string version_source;
    if (options.nccl_version) {
      version = *options.nccl_version;
      version_source = options.nccl_library ? absl::StrCat("from ", options.nccl_library->path,
                                                           ": ", options.nccl_library->reason)
                                            : "given by the caller";
    } else if (absl::StatusOr<NcclLibraryInfo> lib = FindNcclLibrary(); lib.ok()) {
      version = lib->version;
      version_source = absl::StrCat("from ", lib->path, ": ", lib->reason);
    } else {
      version_source =
          absl::StrCat("newest version strata knows; no libnccl found: ", lib.status().message());
    }
    absl::StatusOr<Topology> topo = DetectTopology(options.detect);
    if (!topo.ok()) return internal::Annotate(topo.status(), "detecting the topology for NCCL");
    CollectOptions collect;
    collect.nccl_version = version;
    STRATA_ASSIGN_OR_RETURN(EffectiveSettings user, CollectNcclSettings(collect));
    ProfileOptions popts;
    popts.classify = options.classify;
    popts.nccl_version = version;
    popts.user = &user;
    popts.nonblocking = options.nonblocking;
    proc.profile = MakeNcclProfile(*topo, popts);
    const NcclProfile& p = proc.profile;
    Log(options, absl::StrCat("strata: NCCL ", version.ToString(), " (", version_source,
                              "), topology class ", TopologyClassName(p.classification.cls), ": ",
                              p.classification.reason));
    for (const NcclProfileEntry& e : p.entries) {
      if (e.target != ProfileTarget::kEnv) continue;
      if (e.user_set) {
        Log(options, absl::StrCat("strata:   kept ", e.name, "=", e.user_value, " (yours, ",
                                  e.user_origin, "); the profile would set ", e.value));
      } else if (opted_out) {
        Log(options, absl::StrCat("strata:   not setting ", e.name, "=", e.value,
                                  " (profile disabled): ", e.reason));
      } else {
        // overwrite=0: a variable set since detection still wins.
        setenv(e.name.c_str(), e.value.c_str(), 0);
        proc.env_set.push_back(e.name);
        Log(options, absl::StrCat("strata:   set ", e.name, "=", e.value, ": ", e.reason));
      }
    }
    for (const NcclProfileEntry& e : p.entries) {
      if (e.target != ProfileTarget::kConfig || e.name == "commName") continue;
      Log(options,
          absl::StrCat("strata:   per communicator ", e.name, "=", e.value,
                       e.user_set ? absl::StrCat(" (overridden by ", e.user_origin, ")") : "", ": ",
                       e.reason));
    }
    for (const std::string& n : p.notes) Log(options, absl::StrCat("strata:   note: ", n));
    if (opted_out) {
      Log(options,
          "strata:   NCCL profile disabled (apply_profile=false or STRATA_NCCL_PROFILE=0)");
    }
    proc.done = true;
    proc.applied = !opted_out;
    out.first_in_process = true;
  }
  out.profile = proc.profile;
  out.env_set = proc.env_set;
  // Tuning fields only when the profile is in use; naming and blocking always.
  if (!opted_out) out.config = proc.profile.config;
  out.config.comm_name.reset();
  if (!options.comm_name.empty()) out.config.comm_name = options.comm_name;
  out.config.blocking.reset();
  if (options.nonblocking) out.config.blocking = 0;
  return out;
}

}  // namespace strata
