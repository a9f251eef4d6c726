// strata's own environment variables (STRATA_*), in one registry.
//
// Every STRATA_* variable the library reads is a row of the registry: its
// name, type, default, meaning and the page that documents it
// (docs/settings.md lists them all; `strata-topo --settings` and Python's
// strata.settings() show the values in force and where each came from). The
// library reads them only through a Settings, which parses every registered
// variable in one pass. A value its type does not allow is an error naming
// the variable and the value ("STRATA_GLOO_CMA='maybe' is not a boolean
// (0/1/true/false)"), never a silent default. An empty value counts as unset.
//
// Read once, without global state: a Settings is a plain value, a snapshot
// of the environment, and nothing is cached between snapshots. Whoever
// starts an operation that depends on these variables takes one snapshot at
// its start and hands the values down: CreateRootCommunicator takes one for
// the root communicator (and every communicator split from it), resolving
// the options its backend reads; LaunchEnv::Detect takes one of the
// environment it is given. The environment is the only process-wide input,
// so a World torn down and built again after the user changed a variable
// sees the change, and two snapshots of an unchanged environment agree.
//
//   absl::StatusOr<strata::Settings> s = strata::Settings::FromEnvironment();
//   if (!s.ok()) return s.status();          // names the bad variable
//   if (!s->gloo_cma) ...
//   for (const strata::SettingValue& v : s->List()) std::puts(v.Describe().c_str());
//
// Thread-safety: Settings is a plain value. FromEnvironment reads the
// environment with getenv: safe to call concurrently, but not while another
// thread calls setenv.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "strata/base/export.h"

namespace strata {

enum class SettingType : uint8_t {
  kBool,    // 0, 1, true or false (the words in any case)
  kChoice,  // one of SettingInfo::choices, in any case
  kPath,    // a file or directory
  kText,    // free text (a URL, say), checked where it is used
};

// One row of the registry.
struct STRATA_EXPORT SettingInfo {
  const char* name;  // "STRATA_GLOO_CMA"
  SettingType type;
  const char* choices;  // kChoice: the accepted values, '|'-separated; "" otherwise
  const char* meaning;  // what it does, and what unset means
  const char* doc;      // the page that documents it: "docs/launch.md"
};

// Every registered setting, in the order docs/settings.md lists them.
STRATA_EXPORT std::vector<SettingInfo> SettingRegistry();

// One setting's value in a Settings, for listings.
struct STRATA_EXPORT SettingValue {
  SettingInfo info;
  std::string value;          // "1", "/opt/nccl/lib/libnccl.so.2", or "" when unset
  std::string default_value;  // the same for a default-constructed Settings
  bool from_environment = false;

  // "STRATA_GLOO_CMA=0 (environment)", "STRATA_STORE unset (default)".
  std::string Describe() const;
};

// The values of every registered setting. A default-constructed Settings
// holds the defaults; each field names its variable.
struct STRATA_EXPORT Settings {
  // STRATA_LAUNCHER: "" (detect the launcher), "none", "mpirun", "torchrun"
  // or "slurm" (lower case).
  std::string launcher;
  // STRATA_STORE: the rendezvous of store-bootstrapped backends, a URL such
  // as "file:/shared/dir" (strata/comm/store.h); "" for none.
  std::string store;
  // STRATA_OVERSUBSCRIBED: whether this host runs more ranks than it has
  // cores; unset: detected (strata/comm/backend.h, MpiOptions).
  std::optional<bool> oversubscribed;
  // STRATA_NCCL_LIBRARY: the libnccl to load when none is loaded yet.
  std::string nccl_library;
  // STRATA_NCCL_PROFILE: whether the NCCL backend applies the topology
  // profile (strata/comm/nccl_profile.h).
  bool nccl_profile = true;
  // STRATA_GLOO_PLUGIN: the Gloo plugin (libstrata_gloo.so) to load; "":
  // the one beside libstrata.
  std::string gloo_plugin;
  // STRATA_GLOO_DEEPBIND: load the Gloo plugin with RTLD_DEEPBIND.
  bool gloo_deepbind = true;
  // STRATA_GLOO_CMA: let Gloo groups whose ranks share a host copy between
  // the ranks' buffers (host copies) instead of using Gloo's TCP transport.
  bool gloo_cma = true;
  // STRATA_ELASTIC_SUPERVISED: set by strata.elastic.supervise() in the
  // training process it forks (the supervisor's pid); "" elsewhere.
  std::string elastic_supervised;
  // STRATA_ELASTIC_JOIN: this process joins a running job (strata.init
  // does not bootstrap with the job's first ranks; strata.elastic asks the
  // members to admit it). Set by supervise() when it restarts a rank.
  bool elastic_join = false;
  // STRATA_TRACE: whether a World keeps a flight recorder of its
  // operations (strata/observe/flight_recorder.h) and dumps it on failures.
  bool trace = true;
  // STRATA_TRACE_DIR: where flight-recorder dumps go; "": a folder named
  // after the job under the temp directory.
  std::string trace_dir;
  // STRATA_METRICS_PORT: serve Prometheus metrics on this port ("0": one
  // the OS picks); "" not at all (strata/observe/metrics.h checks it).
  std::string metrics_port;
  // STRATA_METRICS_FILE: write the metrics as a .prom file here ({rank}
  // replaced); "" nowhere.
  std::string metrics_file;
  // STRATA_TIMELINE_DIR: where strata.timeline writes its per-rank files
  // when the code names no directory; "": the code must name one.
  std::string timeline_dir;

  // The text of each registered variable that was set, by name.
  std::map<std::string, std::string> from_environment;

  // Reads every registered variable through `lookup` (nullopt: unset).
  // InvalidArgument names the first variable whose value its type does not
  // allow, the value, and what it takes.
  using Lookup = std::function<std::optional<std::string>(absl::string_view name)>;
  static absl::StatusOr<Settings> FromLookup(const Lookup& lookup);
  // The same over this process's environment, or over a map standing in
  // for it.
  static absl::StatusOr<Settings> FromEnvironment();
  static absl::StatusOr<Settings> FromMap(const std::map<std::string, std::string>& environment);

  // Every registered setting with its value here, in registry order.
  std::vector<SettingValue> List() const;
};

}  // namespace strata
