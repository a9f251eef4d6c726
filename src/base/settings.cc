// The registry of strata's environment variables (strata/base/settings.h).
#include "strata/base/settings.h"

#include <cstdlib>
#include <type_traits>
#include <variant>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/bool_setting.h"

namespace strata {
namespace {

// The field of Settings that holds a row's value.
using Field =
    std::variant<std::string Settings::*, bool Settings::*, std::optional<bool> Settings::*>;

struct Row {
  SettingInfo info;
  Field field;
};

// The registry. Defaults are the initialisers of Settings' fields.
const Row kRows[] = {
    {{"STRATA_LAUNCHER", SettingType::kChoice, "none|mpirun|torchrun|slurm",
      "Which launcher's variables say who this process is (none: a single process). Unset: "
      "detected, the innermost launcher first (torchrun, then mpirun, then Slurm)",
      "docs/launch.md"},
     &Settings::launcher},
    {{"STRATA_STORE", SettingType::kText, "",
      "The store that store-bootstrapped backends (gloo; nccl without mpirun) meet through when "
      "the code gives none: file:/a/directory/every/rank/sees. Unset: none (Python's "
      "strata.init() then uses torchrun's TCPStore)",
      "docs/launch.md"},
     &Settings::store},
    {{"STRATA_OVERSUBSCRIBED", SettingType::kBool, "",
      "Whether this host runs more ranks than it has cores: then the MPI backend's waits give "
      "their core to ranks that compute instead of polling. Unset: detected from the launcher's "
      "ranks per host and the cores this process may use",
      "docs/mpi.md"},
     &Settings::oversubscribed},
    {{"STRATA_NCCL_LIBRARY", SettingType::kPath, "",
      "The libnccl to load when the process has none loaded yet (one already loaded, torch's, "
      "is always the one used). Unset: libnccl.so.2 from the dynamic loader's search path, "
      "else the library strata was built against",
      "docs/nccl.md"},
     &Settings::nccl_library},
    {{"STRATA_NCCL_PROFILE", SettingType::kBool, "",
      "Whether the NCCL backend applies strata's NCCL profile for the detected topology before "
      "the first communicator; 0 leaves NCCL's settings alone",
      "docs/topology.md"},
     &Settings::nccl_profile},
    {{"STRATA_GLOO_PLUGIN", SettingType::kPath, "",
      "The Gloo plugin (libstrata_gloo.so) the gloo backend loads. Unset: the one beside "
      "libstrata, else the build tree's, else the install directory's",
      "docs/launch.md"},
     &Settings::gloo_plugin},
    {{"STRATA_GLOO_DEEPBIND", SettingType::kBool, "",
      "Load the Gloo plugin with RTLD_DEEPBIND, so that its Gloo cannot meet the copy inside the "
      "torch wheel; 0 is for the test that shows why (sanitizer builds never deep-bind)",
      "docs/launch.md"},
     &Settings::gloo_deepbind},
    {{"STRATA_GLOO_CMA", SettingType::kBool, "",
      "Let a Gloo group whose ranks share a host copy between the ranks' buffers "
      "(process_vm_readv) and meet on shared memory, for collectives and send/recv (host "
      "copies); 0 keeps it on Gloo's TCP transport. Every rank must see the same value",
      "docs/launch.md"},
     &Settings::gloo_cma},
    {{"STRATA_ELASTIC_SUPERVISED", SettingType::kText, "",
      "Set by strata.elastic.supervise() in the training process it forks under torchrun (the "
      "supervising process's pid), so that a second call, or a subprocess that runs the script "
      "again, does not fork once more. Set by hand, supervise() does nothing",
      "docs/elastic.md"},
     &Settings::elastic_supervised},
    {{"STRATA_ELASTIC_JOIN", SettingType::kBool, "",
      "This process joins a running elastic job instead of starting with it: strata.init() "
      "makes no world, and strata.elastic.run() asks the members to admit it at their next step "
      "boundary (as a spare, or completing a replica). Set by strata.elastic.supervise(restarts=) "
      "in the process it starts after a rank died; set by hand to add a process to a job",
      "docs/elastic.md"},
     &Settings::elastic_join},
    {{"STRATA_TRACE", SettingType::kBool, "",
      "Whether a World keeps a flight recorder of its last operations (collectives and "
      "point-to-point) and dumps it when an operation fails, on SIGUSR1 or when asked; 0 "
      "turns it off",
      "docs/observability.md"},
     &Settings::trace},
    {{"STRATA_TRACE_DIR", SettingType::kPath, "",
      "The directory flight-recorder dumps go to (one JSON file per rank). Unset: "
      "strata-trace-<job id> under $TMPDIR (else /tmp)",
      "docs/observability.md"},
     &Settings::trace_dir},
    {{"STRATA_METRICS_PORT", SettingType::kText, "",
      "Serve this rank's Prometheus metrics over HTTP on this port of the loopback address "
      "(0: a port the OS picks; a job of several ranks on one host gets port+local rank). "
      "Unset: not served",
      "docs/observability.md"},
     &Settings::metrics_port},
    {{"STRATA_METRICS_FILE", SettingType::kPath, "",
      "Write this rank's Prometheus metrics atomically to this .prom file (for "
      "node_exporter's textfile collector); {rank} in the name is replaced by the rank. "
      "Unset: no file",
      "docs/observability.md"},
     &Settings::metrics_file},
    {{"STRATA_TIMELINE_DIR", SettingType::kPath, "",
      "The directory strata.timeline.Timeline writes its per-rank Chrome trace files to when "
      "the code names none. Unset: the code must name one",
      "docs/observability.md"},
     &Settings::timeline_dir},
};

// What a kind of value takes, for messages.
std::string Takes(const SettingInfo& info) {
  switch (info.type) {
    case SettingType::kBool:
      return "a boolean (0/1/true/false)";
    case SettingType::kChoice:
      return absl::StrCat("one of ", absl::StrJoin(absl::StrSplit(info.choices, '|'), ", "));
    case SettingType::kPath:
      return "a path";
    case SettingType::kText:
      return "text";
  }
  return "a value";
}

absl::Status Bad(const SettingInfo& info, absl::string_view text) {
  return absl::InvalidArgumentError(
      absl::StrCat(info.name, "='", text, "' is not ", Takes(info), "; see ", info.doc));
}

// Parses `text` into the row's field of `out`.
absl::Status Parse(const Row& row, const std::string& text, Settings* out) {
  const SettingInfo& info = row.info;
  if (info.type == SettingType::kBool) {
    std::optional<bool> b = settings_internal::ParseBool(text);
    if (!b) return Bad(info, text);
    if (auto* f = std::get_if<bool Settings::*>(&row.field)) out->** f = *b;
    if (auto* f = std::get_if<std::optional<bool> Settings::*>(&row.field)) out->** f = *b;
    return absl::OkStatus();
  }
  std::string value = text;
  if (info.type == SettingType::kChoice) {
    value = absl::AsciiStrToLower(text);
    bool known = false;
    for (absl::string_view c : absl::StrSplit(info.choices, '|')) known = known || c == value;
    if (!known) return Bad(info, text);
  }
  out->*std::get<std::string Settings::*>(row.field) = std::move(value);
  return absl::OkStatus();
}

// The value of the row's field as the environment would spell it; "" when
// unset.
std::string Text(const Row& row, const Settings& s) {
  return std::visit(
      [&s](auto field) -> std::string {
        const auto& v = s.*field;
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, bool>) {
          return v ? "1" : "0";
        } else if constexpr (std::is_same_v<T, std::optional<bool>>) {
          return v ? (*v ? "1" : "0") : "";
        } else {
          return v;
        }
      },
      row.field);
}

}  // namespace

std::vector<SettingInfo> SettingRegistry() {
  std::vector<SettingInfo> out;
  for (const Row& row : kRows) out.push_back(row.info);
  return out;
}

std::string SettingValue::Describe() const {
  const std::string shown = value.empty() ? " unset" : absl::StrCat("=", value);
  return absl::StrCat(info.name, shown, from_environment ? " (environment)" : " (default)");
}

absl::StatusOr<Settings> Settings::FromLookup(const Lookup& lookup) {
  Settings out;
  for (const Row& row : kRows) {
    std::optional<std::string> text = lookup(row.info.name);
    if (!text || text->empty()) continue;
    absl::Status parsed = Parse(row, *text, &out);
    if (!parsed.ok()) return parsed;
    out.from_environment[row.info.name] = *text;
  }
  return out;
}

absl::StatusOr<Settings> Settings::FromEnvironment() {
  return FromLookup([](absl::string_view name) -> std::optional<std::string> {
    const char* v = std::getenv(std::string(name).c_str());
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  });
}

absl::StatusOr<Settings> Settings::FromMap(const std::map<std::string, std::string>& environment) {
  return FromLookup([&environment](absl::string_view name) -> std::optional<std::string> {
    auto it = environment.find(std::string(name));
    if (it == environment.end()) return std::nullopt;
    return it->second;
  });
}

std::vector<SettingValue> Settings::List() const {
  const Settings defaults;
  std::vector<SettingValue> out;
  for (const Row& row : kRows) {
    SettingValue v;
    v.info = row.info;
    v.value = Text(row, *this);
    v.default_value = Text(row, defaults);
    v.from_environment = from_environment.count(row.info.name) > 0;
    out.push_back(std::move(v));
  }
  return out;
}

}  // namespace strata
