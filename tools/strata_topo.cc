// strata-topo: what this machine looks like to NCCL, what NCCL should be
// told on it and why, and what is wrong with the NCCL settings in force.
//
//   strata-topo                         report for this machine and environment
//   strata-topo --json                  the same as one JSON object
//   strata-topo --from-nvidia-smi FILE  read `nvidia-smi topo -m` output instead
//   strata-topo --from-xml FILE         read an NCCL topology XML instead
//   strata-topo --lint FILE             also lint an env script or nccl.conf
//   strata-topo --export env|conf       print the profile as export lines / nccl.conf
//   strata-topo --settings              strata's own STRATA_* settings in force
//
// Exit status: 0, or 1 when the lint finds errors, 2 for bad arguments or
// unreadable input.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "strata/base/settings.h"
#include "strata/comm/nccl_lint.h"
#include "strata/comm/topology_report.h"

namespace {

constexpr char kUsage[] =
    "usage: strata-topo [options]\n"
    "  --json                   print the report as JSON\n"
    "  --from-nvidia-smi FILE   read the topology from `nvidia-smi topo -m` output\n"
    "  --from-xml FILE          read the topology from an NCCL topology XML file\n"
    "  --sysfs-root DIR         read sysfs below DIR instead of /sys, without NVML (with\n"
    "                           --from-nvidia-smi: PCIe and NICs from DIR, GPU links\n"
    "                           from the text)\n"
    "  --no-nvml                do not load NVML (libnvidia-ml.so.1)\n"
    "  --lint FILE              also lint FILE (export lines or nccl.conf); repeatable\n"
    "  --export env|conf        print only the profile, as export lines or an nccl.conf\n"
    "  --nccl-version X.Y.Z     lint for this NCCL (default: the libnccl this process\n"
    "                           loads by the NCCL backend's rule; the report names the\n"
    "                           file and why it is the one)\n"
    "  --scope auto|single-node|multi-node   job scope for the class (default auto)\n"
    "  --no-conf-files          ignore NCCL_CONF_FILE, ~/.nccl.conf and /etc/nccl.conf\n"
    "  --list-variables         print strata's table of NCCL variables (Markdown) and exit\n"
    "  --settings               print strata's own settings (STRATA_*): value, source\n"
    "  --list-settings          print the registry of strata's settings (Markdown) and exit\n"
    "Exit status: 0, 1 when the lint reports errors, 2 for bad arguments or input.\n";

std::string Version(int code) {
  return code == 0 ? "" : strata::NcclVersion::FromCode(code).ToString();
}

// The variable table as Markdown (docs/nccl-variables.md is this output).
std::string VariablesMarkdown() {
  std::string out =
      "| variable | type | valid | default | since | removed | deprecated | debug | what it does "
      "| source |\n|---|---|---|---|---|---|---|---|---|---|\n";
  const char* types[] = {"int", "bool", "enum", "level", "list", "string"};
  for (const strata::NcclVarInfo& v : strata::NcclVariables()) {
    std::string valid = v.min <= v.max ? (v.max == INT64_MAX ? absl::StrCat(">= ", v.min)
                                                             : absl::StrCat(v.min, "..", v.max))
                                       : std::string(v.values);
    std::string dep = v.deprecated
                          ? absl::StrCat(Version(v.deprecated), " -> ", v.replacement)
                          : (*v.replacement && v.removed ? absl::StrCat("-> ", v.replacement) : "");
    std::string what =
        absl::StrCat(v.description, *v.out_of_range ? ". Out of range: " : "", v.out_of_range);
    absl::StrAppend(&out, "| ", v.name, " | ", types[static_cast<int>(v.type)], " | ",
                    absl::StrReplaceAll(valid, {{"|", ", "}}), " | ", v.default_value, " | ",
                    v.introduced == 20305 ? "<= 2.3.5" : Version(v.introduced), " | ",
                    Version(v.removed), " | ", dep, " | ", v.debug_only ? "yes" : "", " | ",
                    absl::StrReplaceAll(what, {{"|", "/"}}), " | ",
                    absl::StrReplaceAll(v.source, {{"|", "/"}}), " |\n");
  }
  return out;
}

// The settings registry as Markdown (docs/settings.md ends with this output).
std::string SettingsMarkdown() {
  std::string out =
      "| variable | takes | default | what it does | documented in |\n|---|---|---|---|---|\n";
  for (const strata::SettingValue& v : strata::Settings().List()) {
    std::string takes = v.info.type == strata::SettingType::kBool ? "0, 1, true, false"
                        : v.info.type == strata::SettingType::kChoice
                            ? absl::StrReplaceAll(v.info.choices, {{"|", ", "}})
                        : v.info.type == strata::SettingType::kPath ? "a path"
                                                                    : "text";
    const std::string page = std::string(v.info.doc).substr(std::string("docs/").size());
    absl::StrAppend(&out, "| `", v.info.name, "` | ", takes, " | ",
                    v.default_value.empty() ? "unset" : v.default_value, " | ", v.info.meaning,
                    " | [", page, "](", page, ") |\n");
  }
  return out;
}

// The settings in force, one line each.
int PrintSettings() {
  absl::StatusOr<strata::Settings> settings = strata::Settings::FromEnvironment();
  if (!settings.ok()) {
    std::fprintf(stderr, "strata-topo: %s\n", std::string(settings.status().message()).c_str());
    return 2;
  }
  for (const strata::SettingValue& v : settings->List()) {
    std::printf("%-22s %-28s %s\n", v.info.name, v.value.empty() ? "unset" : v.value.c_str(),
                v.from_environment ? "environment" : "default");
  }
  return 0;
}

int Usage(const std::string& problem) {
  std::fprintf(stderr, "strata-topo: %s\n%s", problem.c_str(), kUsage);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  strata::TopoReportOptions options;
  bool json = false;
  bool sysfs_given = false;
  std::string export_format;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&](std::string* out) {
      if (i + 1 >= argc) return false;
      *out = argv[++i];
      return true;
    };
    std::string v;
    if (arg == "--json") {
      json = true;
    } else if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    } else if (arg == "--no-nvml") {
      options.detect.use_nvml = false;
    } else if (arg == "--list-variables") {
      std::fputs(VariablesMarkdown().c_str(), stdout);
      return 0;
    } else if (arg == "--list-settings") {
      std::fputs(SettingsMarkdown().c_str(), stdout);
      return 0;
    } else if (arg == "--settings") {
      return PrintSettings();
    } else if (arg == "--no-conf-files") {
      options.read_conf_files = false;
    } else if (arg == "--from-nvidia-smi") {
      if (!value(&options.from_nvidia_smi)) return Usage("--from-nvidia-smi needs a file");
    } else if (arg == "--from-xml") {
      if (!value(&options.from_xml)) return Usage("--from-xml needs a file");
    } else if (arg == "--sysfs-root") {
      if (!value(&options.detect.sysfs_root)) return Usage("--sysfs-root needs a directory");
      sysfs_given = true;
      options.detect.use_nvml = false;  // NVML describes this machine, not the tree
    } else if (arg == "--lint") {
      if (!value(&v)) return Usage("--lint needs a file");
      options.lint_files.push_back(v);
    } else if (arg == "--export") {
      if (!value(&export_format) || (export_format != "env" && export_format != "conf")) {
        return Usage("--export takes env or conf");
      }
    } else if (arg == "--nccl-version") {
      if (!value(&v)) return Usage("--nccl-version needs a version such as 2.28.9");
      absl::StatusOr<strata::NcclVersion> version = strata::NcclVersion::Parse(v);
      if (!version.ok()) return Usage(std::string(version.status().message()));
      options.nccl_version = *version;
    } else if (arg == "--scope") {
      if (!value(&v)) return Usage("--scope needs auto, single-node or multi-node");
      if (v == "auto") {
        options.classify.scope = strata::JobScope::kAuto;
      } else if (v == "single-node") {
        options.classify.scope = strata::JobScope::kSingleNode;
      } else if (v == "multi-node") {
        options.classify.scope = strata::JobScope::kMultiNode;
      } else {
        return Usage(absl::StrCat("--scope '", v, "' is not auto, single-node or multi-node"));
      }
    } else {
      return Usage(absl::StrCat("unknown option '", arg, "'"));
    }
  }
  if (!options.from_nvidia_smi.empty() && !options.from_xml.empty()) {
    return Usage("--from-nvidia-smi and --from-xml are alternatives; give one");
  }
  if (!options.from_nvidia_smi.empty() && sysfs_given) {
    // Both: the sysfs tree for PCIe and NICs, the text for NVLink.
    absl::StatusOr<std::string> text = strata::ReadTextFile(options.from_nvidia_smi);
    if (!text.ok()) return Usage(std::string(text.status().message()));
    options.detect.nvidia_smi_topo = *text;
    options.from_nvidia_smi.clear();
  }
  absl::StatusOr<strata::TopoReport> report = strata::BuildTopoReport(options);
  if (!report.ok()) {
    std::fprintf(stderr, "strata-topo: %s\n", std::string(report.status().message()).c_str());
    return 2;
  }
  if (export_format == "env") {
    std::fputs(report->profile.ExportEnv().c_str(), stdout);
  } else if (export_format == "conf") {
    std::fputs(report->profile.ExportConf().c_str(), stdout);
  } else if (json) {
    std::fputs(strata::RenderTopoReportJson(*report).c_str(), stdout);
  } else {
    std::fputs(strata::RenderTopoReportText(*report).c_str(), stdout);
  }
  return report->lint.errors() > 0 ? 1 : 0;
}
