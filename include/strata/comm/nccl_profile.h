// NCCL tuning profiles: what NCCL should be told on a machine of a given
// class (Classify, strata/comm/topology.h), each value with a reason a user
// can read.
//
// NCCL picks good settings by itself on most machines, so a production
// profile sets as little as possible: only what detection knows and NCCL
// cannot (which RDMA devices are the compute fabric, which GID to use on RoCE
// before NCCL 2.21, that an RDMA class must not fall back to TCP silently).
// Values the user already set (environment or NCCL's config files) always
// win: the profile keeps them and says so.
//
// Two kinds of setting: environment variables, which NCCL reads once per
// process and caches, and per-communicator ncclConfig_t fields, for anything
// that may differ between communicators. NcclConfigFields mirrors the
// settable ncclConfig_t fields (NCCL 2.28) as a plain struct, so users of
// this header need not include nccl.h.
//
//   absl::StatusOr<strata::Topology> topo = strata::DetectTopology();
//   strata::ProfileOptions options;
//   strata::NcclProfile profile = strata::MakeNcclProfile(*topo, options);
//   std::printf("%s", profile.ExportEnv().c_str());   // export lines with reasons
//
// The NCCL backend calls PrepareNcclCommunicator() each time it creates a
// communicator: the first call in a process detects the topology, sets the
// profile's environment variables (unless the user opted out) and logs what
// it set and why; every call returns the config fields for that communicator.
//
// Thread-safety: MakeNcclProfile and the exports are pure.
// PrepareNcclCommunicator is serialized by a process-wide mutex; its first
// call sets environment variables (see its comment).
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "strata/base/export.h"
#include "strata/comm/nccl.h"
#include "strata/comm/nccl_settings.h"
#include "strata/comm/topology.h"

namespace strata {

// The settable fields of ncclConfig_t; unset fields keep NCCL's default.
struct STRATA_EXPORT NcclConfigFields {
  static constexpr int kVersion = 1;
  int version = kVersion;
  std::optional<int> blocking;
  std::optional<int> cga_cluster_size;
  std::optional<int> min_ctas;
  std::optional<int> max_ctas;
  std::optional<std::string> net_name;
  std::optional<int> split_share;
  std::optional<int> traffic_class;
  std::optional<std::string> comm_name;
  std::optional<int> collnet_enable;
  std::optional<int> cta_policy;
  std::optional<int> shrink_share;
  std::optional<int> nvls_ctas;
  std::optional<int> n_channels_per_net_peer;
  std::optional<int> nvlink_centric_sched;
};

enum class ProfileTarget : uint8_t { kEnv, kConfig };

struct STRATA_EXPORT NcclProfileEntry {
  ProfileTarget target = ProfileTarget::kEnv;
  std::string name;    // "NCCL_IB_HCA", or a config field: "netName"
  std::string value;   // what the profile would set
  std::string reason;  // one line
  // The user already set this (environment or config file): their value is
  // kept and `value` is only the profile's suggestion.
  bool user_set = false;
  std::string user_value;
  std::string user_origin;
};

struct STRATA_EXPORT NcclProfile {
  Classification classification;
  NcclVersion nccl_version;
  std::vector<NcclProfileEntry> entries;
  // Advice that is not a setting ("place tp groups on the NVLink pairs").
  std::vector<std::string> notes;
  // The config entries the user did not override, ready for ncclConfig_t.
  NcclConfigFields config;

  // `export NAME='value'` lines, each after a "# reason" comment; user-set
  // variables appear as comments that say the user's value is kept.
  std::string ExportEnv() const;
  // nccl.conf lines (NAME=value, no quotes: NCCL keeps quotes literally),
  // reasons as comment lines. Config fields are listed as comments, since no
  // file can set them.
  std::string ExportConf() const;
};

struct STRATA_EXPORT ProfileOptions {
  static constexpr int kVersion = 1;
  int version = kVersion;
  ClassifyOptions classify;
  NcclVersion nccl_version;
  // What the user already set; nullptr means nothing.
  const EffectiveSettings* user = nullptr;
  // Name for NCCL's logs (ncclConfig_t::commName); empty leaves it unset.
  std::string comm_name;
  // strata's NCCL backend creates nonblocking communicators so that every
  // wait has a deadline and abort works; set false for a blocking caller.
  bool nonblocking = true;
};

STRATA_EXPORT NcclProfile MakeNcclProfile(const Topology& topology, const ProfileOptions& options);

// ---- for the NCCL backend -------------------------------------------------

struct STRATA_EXPORT NcclCommSetupOptions {
  static constexpr int kVersion = 1;
  int version = kVersion;
  // Opt-out: false (or STRATA_NCCL_PROFILE=0 in the environment) leaves the
  // environment alone; config fields still carry comm_name and blocking.
  bool apply_profile = true;
  std::string comm_name;
  bool nonblocking = true;
  DetectOptions detect;
  ClassifyOptions classify;
  // The loaded NCCL's version; unset asks FindNcclLibrary().
  std::optional<NcclVersion> nccl_version;
  // The file nccl_version came from and why, for the log line (the NCCL
  // backend passes the library it loaded).
  std::optional<NcclLibraryInfo> nccl_library;
  // Where the once-per-process log lines go; null writes to stderr.
  std::function<void(absl::string_view)> log;
};

struct STRATA_EXPORT NcclCommSetup {
  // Fill ncclConfig_t from these.
  NcclConfigFields config;
  // The process-wide profile (detected by the first call in the process).
  NcclProfile profile;
  // Variables this process's first call set in the environment.
  std::vector<std::string> env_set;
  // True for the call that applied and logged the profile.
  bool first_in_process = false;
};

// Called before each ncclCommInitRankConfig / ncclCommSplit. The first call
// in a process detects the topology, sets the profile's environment
// variables that nobody set (NCCL reads them once, at its first use, so this
// must happen before the first communicator) and logs them with reasons;
// later calls reuse that profile. A detection failure is returned (NotFound
// / InvalidArgument naming the file); the caller may go on without a profile.
// Not thread-safe with concurrent getenv elsewhere in the process during the
// first call (setenv is not); the NCCL backend calls it before starting
// communication threads.
STRATA_EXPORT absl::StatusOr<NcclCommSetup> PrepareNcclCommunicator(
    const NcclCommSetupOptions& options);

}  // namespace strata
