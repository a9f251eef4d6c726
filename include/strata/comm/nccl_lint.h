// A version-aware lint of NCCL settings.
//
// Users copy NCCL settings from blog posts; many are wrong in ways NCCL does
// not report: names that never existed, variables removed years ago,
// values NCCL silently replaces ("8" threads becomes 512), PyTorch's own
// variables, debugging switches left on in production, and settings that
// contradict the machine (InfiniBand disabled on an InfiniBand fabric).
// The lint checks each effective setting (see nccl_settings.h) against a
// table of NCCL's variables built from NCCL's documentation and source, for
// the NCCL version the job loads, and against the detected topology.
//
//   strata::CollectOptions collect;
//   absl::StatusOr<strata::EffectiveSettings> s = strata::CollectNcclSettings(collect);
//   strata::LintOptions options;
//   options.topology = &*topology;          // optional
//   strata::LintReport report = strata::LintNcclSettings(*s, options);
//   for (const strata::Finding& f : report.findings) std::puts(f.Describe().c_str());
//   return report.errors() > 0 ? 1 : 0;
//
// CheckNcclConsistency() compares the effective settings of every rank of a
// communicator with O(N) communication (hash, then details only for the few
// distinct configurations) and names the ranks and variables that differ.
//
// Thread-safety: all functions are pure except CheckNcclConsistency, which is
// a collective over the communicator.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "strata/base/export.h"
#include "strata/comm/communicator.h"
#include "strata/comm/nccl_settings.h"
#include "strata/comm/topology.h"

namespace strata {

// ---- the variable table ---------------------------------------------------

enum class NcclVarType : uint8_t {
  kInt,     // read with strtoll(value, NULL, 0): hex and octal accepted, stops at
            // the first non-digit, non-numeric text reads as 0
  kBool,    // an integer used as 0/1
  kEnum,    // one of `values` (see NcclVarInfo::case_sensitive)
  kLevel,   // a path level: LOC, NVL, NVB, C2C, PIX, PXB, P2C, PXN, PHB, SYS or legacy 0-4
  kList,    // a list with its own syntax (interfaces, HCAs, algorithms)
  kString,  // free text (paths, names)
};

struct STRATA_EXPORT NcclVarInfo {
  const char* name;
  NcclVarType type;
  int64_t min;  // valid range for kInt/kBool, inclusive; min > max: no range
  int64_t max;
  const char* values;  // kEnum/kList: accepted tokens, '|'-separated; "" otherwise
  bool case_sensitive;
  const char* default_value;
  int introduced;           // NCCL_VERSION_CODE of the first release that reads it
  int removed;              // first release that no longer reads it; 0 if still read
  int deprecated;           // release that deprecated it; 0 if not
  const char* replacement;  // the variable to use instead; "" if none
  bool debug_only;          // listed under "Debugging" in NCCL's documentation
  bool documented;          // in NCCL's environment-variable documentation
  // What NCCL does with an out-of-range value, when known from its source.
  const char* out_of_range;
  const char* description;
  const char* source;  // where the row's facts come from
};

// Every NCCL variable strata knows, documented ones first.
STRATA_EXPORT absl::Span<const NcclVarInfo> NcclVariables();
// The row for `name`, or nullptr.
STRATA_EXPORT const NcclVarInfo* FindNcclVariable(absl::string_view name);
// Known names that look like `name` (edit distance / shared words), best first.
STRATA_EXPORT std::vector<std::string> SuggestNcclVariables(absl::string_view name, int max = 3);

// ---- findings -------------------------------------------------------------

enum class Severity : uint8_t { kInfo, kWarning, kError };
STRATA_EXPORT const char* SeverityName(Severity severity);  // "info", "warning", "error"

struct STRATA_EXPORT Finding {
  Severity severity = Severity::kInfo;
  std::string rule;  // "unknown-name", "removed", "out-of-range", ...
  std::string name;
  std::string value;
  std::string origin;   // "environment", "/etc/nccl.conf:3"
  std::string message;  // what is wrong and what NCCL does with it
  std::string fix;      // what to do instead

  std::string Describe() const;  // "error NCCL_NTHREADS=8 (environment): ... Fix: ..."
};

struct STRATA_EXPORT LintOptions {
  static constexpr int kVersion = 1;
  int version = kVersion;
  // The NCCL the job loads (see LoadedNcclVersion); defaults to the newest known.
  NcclVersion nccl_version;
  // For contradictions with the machine; nullptr skips those checks.
  const Topology* topology = nullptr;
  // Time within which a dead InfiniBand peer should be noticed; a longer
  // NCCL_IB_TIMEOUT x retries is a warning.
  absl::Duration failure_detection_budget = absl::Seconds(60);
};

struct STRATA_EXPORT LintReport {
  NcclVersion nccl_version;
  std::vector<Finding> findings;  // errors first, then warnings, then info

  int count(Severity s) const;
  int errors() const { return count(Severity::kError); }
  int warnings() const { return count(Severity::kWarning); }
};

STRATA_EXPORT LintReport LintNcclSettings(const EffectiveSettings& settings,
                                          const LintOptions& options = {});

// Time until an InfiniBand queue pair gives up on a silent peer:
// 4.096 us * 2^timeout per attempt (InfiniBand spec vol. 1, 12.7.34) for the
// first send and each of `retry_cnt` retries. Infinite for timeout 0 or >= 32.
STRATA_EXPORT absl::Duration IbFailureDetectionTime(int64_t timeout, int64_t retry_cnt);

// ---- cross-rank consistency -----------------------------------------------

struct STRATA_EXPORT ConsistencyOptions {
  static constexpr int kVersion = 1;
  int version = kVersion;
  // Deadline of each collective step.
  absl::Duration timeout = absl::Seconds(60);
  // Distinct configurations whose variables are compared in detail; beyond
  // this only the ranks are named (bounds the traffic when every rank differs).
  int max_detailed_configs = 8;
  // Variables allowed to differ between ranks.
  std::vector<std::string> ignore;
};

struct STRATA_EXPORT ConsistencyDifference {
  std::string name;
  // Value per configuration; "" when unset. values[0] is the reference (the
  // configuration held by most ranks, ties to the lowest rank).
  std::vector<std::string> values;
};

struct STRATA_EXPORT ConsistencyReport {
  bool consistent = true;
  // Ranks of each distinct configuration, reference first (one group of
  // every rank when consistent).
  std::vector<std::vector<int>> groups;
  std::vector<ConsistencyDifference> differences;
  // "ranks 0-5,7 and ranks 6 differ: NCCL_IB_HCA='=mlx5_0' vs unset".
  std::string ToString() const;
};

// Collective over `comm`: every rank hashes its effective NCCL_* settings
// (xxh64 of the sorted NAME=VALUE lines); two all-reduces tell whether all
// agree. Only if not: an all-gather of the 8-byte hashes groups the ranks, and
// one representative per configuration broadcasts its settings (at most
// max_detailed_configs of them). Every rank returns the same report.
// Errors of the communicator (a peer lost, a deadline passed) are returned
// with "checking NCCL settings across ranks" prepended.
STRATA_EXPORT absl::StatusOr<ConsistencyReport> CheckNcclConsistency(
    Communicator& comm, const EffectiveSettings& settings, const ConsistencyOptions& options = {});

}  // namespace strata
