// The whole strata-topo answer in one value: the topology (detected or read
// from a file), its class and NCCL profile, and the lint of the NCCL
// settings in force, rendered as text for people or JSON for tools. The
// command-line tool, the Python bindings and the demo all go through this.
//
//   strata::TopoReportOptions options;          // this machine, this environment
//   absl::StatusOr<strata::TopoReport> r = strata::BuildTopoReport(options);
//   if (!r.ok()) return r.status();
//   std::fputs(strata::RenderTopoReportText(*r).c_str(), stdout);
//   return r->lint.errors() > 0 ? 1 : 0;
//
// JSON object: {"class", "class_description", "reason", "intra_node",
// "network", "source", "nccl_version", "nccl_version_source",
// "nccl_library": {"path", "version", "source", "reason"} or null, "gpus",
// "nics", "matrix": {"labels", "cells"}, "legend", "gpudirect", "notes",
// "profile": [{"name", "value", "reason", "target", "user_set", ...}],
// "profile_notes", "lint": [{"name", "value", "severity", "message", "fix",
// "rule", "origin"}], "summary": {"errors", "warnings", "info"},
// "files": [{"path", "state"}]}.
//
// Thread-safety: BuildTopoReport reads files and the environment (and may
// load NVML and libnccl); safe to call concurrently. Reports are plain values.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "strata/base/export.h"
#include "strata/comm/nccl.h"
#include "strata/comm/nccl_lint.h"
#include "strata/comm/nccl_profile.h"
#include "strata/comm/nccl_settings.h"
#include "strata/comm/topology.h"

namespace strata {

struct STRATA_EXPORT TopoReportOptions {
  static constexpr int kVersion = 1;
  int version = kVersion;
  // Where the topology comes from: one of these files, else the machine.
  std::string from_nvidia_smi;  // `nvidia-smi topo -m` output
  std::string from_xml;         // NCCL topology XML
  DetectOptions detect;         // sysfs root, NVML
  ClassifyOptions classify;
  // The NCCL to lint for; unset asks the libnccl this process uses (by the
  // NCCL backend's rule, FindNcclLibrary), then falls back to the newest
  // version strata knows (the report says which, and which file).
  std::optional<NcclVersion> nccl_version;
  // Settings: the process environment (or this map) and NCCL's files.
  std::optional<std::map<std::string, std::string>> environment;
  bool read_conf_files = true;
  std::string home_dir;
  std::string system_conf = "/etc/nccl.conf";
  std::vector<std::string> lint_files;  // --lint FILE
  absl::Duration failure_detection_budget = absl::Seconds(60);
};

struct STRATA_EXPORT TopoReport {
  Topology topology;
  NcclVersion nccl_version;
  // "given; ...", "ncclGetVersion() of <path>", or why none was found.
  std::string nccl_version_source;
  // The file the version came from and why it is the one (unset when the
  // version was given or no libnccl was found).
  std::optional<NcclLibraryInfo> nccl_library;
  EffectiveSettings settings;
  NcclProfile profile;
  LintReport lint;
};

// NotFound / InvalidArgument / PermissionDenied name the file that failed.
STRATA_EXPORT absl::StatusOr<TopoReport> BuildTopoReport(const TopoReportOptions& options);

STRATA_EXPORT std::string RenderTopoReportText(const TopoReport& report);
STRATA_EXPORT std::string RenderTopoReportJson(const TopoReport& report, int indent = 2);

}  // namespace strata
