// NCCL settings as NCCL itself sees them: the variables of the process
// environment and of NCCL's configuration files, merged with NCCL's
// precedence, plus the version of the NCCL library they are meant for.
//
// NCCL (src/misc/param.cc, checked for 2.3.5 through 2.30.7) reads its files
// once per process, at its first use of a variable, and only adds variables
// that are not already set (setenv(name, value, 0)). So:
//   1. the process environment wins;
//   2. then NCCL_CONF_FILE, when set and non-empty (since 2.23), otherwise
//      ~/.nccl.conf (home from getpwuid before 2.30, from $HOME since);
//   3. then /etc/nccl.conf.
// Within one file the first line for a name wins. A file line is
// NAME=VALUE, split at the first '=', nothing trimmed; '#' starts a comment
// only in the first column; lines without '=' are skipped.
//
//   strata::CollectOptions options;          // process environment + files
//   options.nccl_version = strata::NcclVersion{2, 28, 9};
//   absl::StatusOr<strata::EffectiveSettings> s = strata::CollectNcclSettings(options);
//   for (const strata::Setting& v : s->settings) std::printf("%s\n", v.Describe().c_str());
//
// Thread-safety: plain values; CollectNcclSettings reads the environment and
// files and is safe to call concurrently with other readers.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "strata/base/export.h"

namespace strata {

// An NCCL release, compared as NCCL_VERSION_CODE (major*10000 + minor*100 + patch).
struct STRATA_EXPORT NcclVersion {
  int major = 2;
  int minor = 30;
  int patch = 7;

  int code() const { return major * 10000 + minor * 100 + patch; }
  std::string ToString() const;  // "2.28.9"
  // From "2.28.9", "2.28" or an NCCL_VERSION_CODE such as "22809".
  static absl::StatusOr<NcclVersion> Parse(absl::string_view text);
  // From ncclGetVersion()'s code (22809 -> 2.28.9).
  static NcclVersion FromCode(int code);
  friend bool operator<(const NcclVersion& a, const NcclVersion& b) { return a.code() < b.code(); }
  friend bool operator>=(const NcclVersion& a, const NcclVersion& b) { return !(a < b); }
  friend bool operator==(const NcclVersion& a, const NcclVersion& b) {
    return a.code() == b.code();
  }
};

// The newest release whose source and documentation strata's variable table
// was checked against.
STRATA_EXPORT NcclVersion NewestKnownNcclVersion();

// ncclGetVersion() of the libnccl this process uses, by the NCCL backend's
// rule (strata/comm/nccl.h: the copy already loaded, torch's say, else
// `library`, $STRATA_NCCL_LIBRARY, libnccl.so.2 from the search path, the
// one strata was built against). FindNcclLibrary also says which file and
// why; reports should use it. NotFound when none loads.
STRATA_EXPORT absl::StatusOr<NcclVersion> LoadedNcclVersion(const std::string& library = "");

enum class SettingSource : uint8_t {
  kEnvironment,  // the process environment
  kConfFile,     // $NCCL_CONF_FILE
  kUserConf,     // ~/.nccl.conf
  kSystemConf,   // /etc/nccl.conf
  kCommandLine,  // a file given to strata-topo --lint (not read by NCCL)
};

// "environment", "NCCL_CONF_FILE", "~/.nccl.conf", "/etc/nccl.conf", "file".
STRATA_EXPORT const char* SettingSourceName(SettingSource source);

// One NAME=VALUE as a source gave it.
struct STRATA_EXPORT Setting {
  std::string name;   // exactly as NCCL takes it (may hold stray spaces)
  std::string value;  // exactly as NCCL takes it (quotes and '\r' kept)
  SettingSource source = SettingSource::kEnvironment;
  std::string origin;  // "environment" or "/etc/nccl.conf:12"
  // False when another source (or an earlier line) already set the name, so
  // NCCL never sees this one.
  bool effective = true;
  // The raw line, for file settings.
  std::string line;

  std::string Describe() const;  // "NCCL_IB_HCA=mlx5 (/etc/nccl.conf:3)"
};

// A line of a configuration file that NCCL reads differently from how it
// looks (a name with spaces, an "export" prefix, quotes, ...), found while
// parsing. The lint reports these.
struct STRATA_EXPORT ConfLineNote {
  std::string origin;  // "file:line"
  std::string line;
  std::string problem;
};

struct STRATA_EXPORT ParsedConf {
  std::vector<Setting> settings;  // in file order, duplicates marked ineffective
  std::vector<ConfLineNote> notes;
};

// Parses an nccl.conf with NCCL's exact rules (see the file comment); `path`
// names the file in origins. Never fails: odd lines become notes.
STRATA_EXPORT ParsedConf ParseNcclConf(absl::string_view text, const std::string& path,
                                       SettingSource source);

// Parses a shell fragment of `export NAME=VALUE` / `NAME=VALUE` lines (the
// env format of strata-topo --lint), removing shell quotes as a shell would.
// InvalidArgument for an unterminated quote, naming the line.
STRATA_EXPORT absl::StatusOr<ParsedConf> ParseEnvFile(absl::string_view text,
                                                      const std::string& path);

// Every setting from every source, with NCCL's precedence applied.
struct STRATA_EXPORT EffectiveSettings {
  NcclVersion nccl_version;
  std::vector<Setting> settings;    // all sources, `effective` marks the winners
  std::vector<ConfLineNote> notes;  // odd file lines
  // Files NCCL would look at, in order, and whether each was found: e.g.
  // {"/root/.nccl.conf", "not found"}.
  std::vector<std::pair<std::string, std::string>> files;

  // The value NCCL sees for `name`, if any.
  std::optional<std::string> Get(absl::string_view name) const;
  // The winning setting for `name`, or nullptr.
  const Setting* Find(absl::string_view name) const;
  // name -> value of the effective NCCL_* settings, for hashing and diffs.
  std::map<std::string, std::string> EffectiveNccl() const;
};

struct STRATA_EXPORT CollectOptions {
  static constexpr int kVersion = 1;
  int version = kVersion;
  // The environment to lint; unset means this process's environment.
  std::optional<std::map<std::string, std::string>> environment;
  // Read the configuration files as NCCL would.
  bool read_conf_files = true;
  // Home directory for ~/.nccl.conf; empty picks NCCL's rule for the version
  // (getpwuid before 2.30, $HOME since).
  std::string home_dir;
  std::string system_conf = "/etc/nccl.conf";
  // Extra files to lint (strata-topo --lint), lowest precedence, and not
  // read by NCCL.
  std::vector<std::string> extra_files;
  NcclVersion nccl_version;
};

// Merges the sources. Only an unreadable --lint file is an error (NotFound /
// PermissionDenied naming it); NCCL's own files may be missing.
STRATA_EXPORT absl::StatusOr<EffectiveSettings> CollectNcclSettings(const CollectOptions& options);

}  // namespace strata
