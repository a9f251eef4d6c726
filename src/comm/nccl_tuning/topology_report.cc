// BuildTopoReport and its text and JSON renderings (see topology_report.h).
#include "strata/comm/topology_report.h"

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "strata/base/status.h"

namespace strata {
namespace {

using json = nlohmann::json;

std::string GpuDirectText(const Topology& t) {
  std::string s = t.gpudirect.peermem
                      ? absl::StrCat("peer-memory module ", t.gpudirect.module, " loaded")
                      : "no peer-memory module (nvidia_peermem) loaded";
  absl::StrAppend(&s, t.gpudirect.dmabuf_kernel ? "; kernel supports DMA-BUF (5.12+)"
                                                : "; DMA-BUF kernel support unknown or absent");
  return s;
}

}  // namespace

absl::StatusOr<TopoReport> BuildTopoReport(const TopoReportOptions& options) {
  TopoReport r;
  if (!options.from_nvidia_smi.empty()) {
    STRATA_ASSIGN_OR_RETURN(std::string text, ReadTextFile(options.from_nvidia_smi));
    absl::StatusOr<Topology> t = ParseNvidiaSmiTopo(text);
    if (!t.ok()) return internal::Annotate(t.status(), options.from_nvidia_smi);
    r.topology = *std::move(t);
    r.topology.source = absl::StrCat("nvidia-smi topo -m (", options.from_nvidia_smi, ")");
  } else if (!options.from_xml.empty()) {
    STRATA_ASSIGN_OR_RETURN(std::string text, ReadTextFile(options.from_xml));
    absl::StatusOr<Topology> t = ParseNcclTopoXml(text);
    if (!t.ok()) return internal::Annotate(t.status(), options.from_xml);
    r.topology = *std::move(t);
    r.topology.source = absl::StrCat("NCCL topology XML (", options.from_xml, ")");
  } else {
    STRATA_ASSIGN_OR_RETURN(r.topology, DetectTopology(options.detect));
  }

  // Which libnccl a process uses depends on how it was started (torch
  // imported or not, LD_LIBRARY_PATH, STRATA_NCCL_LIBRARY), so the report
  // names the file and the reason, by the NCCL backend's own rule.
  if (options.nccl_version) {
    r.nccl_version = *options.nccl_version;
    r.nccl_version_source = "given; no libnccl was loaded for this report";
  } else if (absl::StatusOr<NcclLibraryInfo> lib = FindNcclLibrary(); lib.ok()) {
    r.nccl_version = lib->version;
    r.nccl_version_source = absl::StrCat("ncclGetVersion() of ", lib->path);
    r.nccl_library = *std::move(lib);
  } else {
    r.nccl_version = NewestKnownNcclVersion();
    r.nccl_version_source = absl::StrCat("no libnccl found (", lib.status().message(),
                                         "); linting for the newest NCCL strata knows");
  }

  CollectOptions collect;
  collect.environment = options.environment;
  collect.read_conf_files = options.read_conf_files;
  collect.home_dir = options.home_dir;
  collect.system_conf = options.system_conf;
  collect.extra_files = options.lint_files;
  collect.nccl_version = r.nccl_version;
  STRATA_ASSIGN_OR_RETURN(r.settings, CollectNcclSettings(collect));

  ProfileOptions popts;
  popts.classify = options.classify;
  popts.nccl_version = r.nccl_version;
  popts.user = &r.settings;
  r.profile = MakeNcclProfile(r.topology, popts);
  r.profile.entries.erase(
      std::remove_if(r.profile.entries.begin(), r.profile.entries.end(),
                     [](const NcclProfileEntry& e) { return e.name == "blocking"; }),
      r.profile.entries.end());  // strata's backend choice, not advice for other tools

  LintOptions lopts;
  lopts.nccl_version = r.nccl_version;
  lopts.topology = &r.topology;
  lopts.failure_detection_budget = options.failure_detection_budget;
  r.lint = LintNcclSettings(r.settings, lopts);
  return r;
}

std::string RenderTopoReportText(const TopoReport& r) {
  const Topology& t = r.topology;
  std::string out = absl::StrCat("strata-topo: topology from ", t.source, "\n\n");
  absl::StrAppend(&out, RenderMatrix(t));
  absl::StrAppend(&out, "\nGPUDirect RDMA: ", GpuDirectText(t), "\n");
  for (const std::string& n : t.notes) absl::StrAppend(&out, "note: ", n, "\n");

  const Classification& c = r.profile.classification;
  absl::StrAppend(&out, "\nClass: ", TopologyClassName(c.cls), " -- ",
                  TopologyClassDescription(c.cls), "\n  seen: ", c.reason, "\n");

  if (r.nccl_library) {
    absl::StrAppend(&out, "\nNCCL ", r.nccl_version.ToString(), " from ", r.nccl_library->path,
                    "\n  why this file: ", r.nccl_library->reason, "\n");
  } else {
    absl::StrAppend(&out, "\nNCCL ", r.nccl_version.ToString(), " (", r.nccl_version_source, ")\n");
  }
  absl::StrAppend(&out, "\nProfile (what strata tells NCCL on this class, and why):\n");
  bool any = false;
  for (const NcclProfileEntry& e : r.profile.entries) {
    any = true;
    std::string where = e.target == ProfileTarget::kEnv ? "env   " : "config";
    if (e.user_set) {
      absl::StrAppend(&out, "  ", where, " ", e.name, ": kept your '", e.user_value, "' (",
                      e.user_origin, "); the profile would use '", e.value, "' -- ", e.reason,
                      "\n");
    } else {
      absl::StrAppend(&out, "  ", where, " ", e.name, "=", e.value, " -- ", e.reason, "\n");
    }
  }
  if (!any) absl::StrAppend(&out, "  nothing to set: NCCL's defaults fit this machine\n");
  for (const std::string& n : r.profile.notes) absl::StrAppend(&out, "  note: ", n, "\n");

  const LintReport& l = r.lint;
  absl::StrAppend(&out, "\nLint of the NCCL settings (", l.errors(), " errors, ", l.warnings(),
                  " warnings, ", l.count(Severity::kInfo), " info):\n");
  if (r.settings.settings.empty()) {
    absl::StrAppend(&out, "  no NCCL variable is set in the environment or NCCL's files\n");
  }
  for (Severity sev : {Severity::kError, Severity::kWarning, Severity::kInfo}) {
    bool header = false;
    for (const Finding& f : l.findings) {
      if (f.severity != sev) continue;
      if (!header) {
        absl::StrAppend(&out, "  ",
                        sev == Severity::kInfo ? "info" : absl::StrCat(SeverityName(sev), "s"),
                        ":\n");
        header = true;
      }
      absl::StrAppend(&out, "    ", f.name, f.name.empty() && f.value.empty() ? "" : "=", f.value,
                      " (", f.origin, ") [", f.rule, "]\n      ", f.message, "\n");
      if (!f.fix.empty()) absl::StrAppend(&out, "      fix: ", f.fix, "\n");
    }
  }
  if (!r.settings.files.empty()) {
    absl::StrAppend(&out,
                    "\nFiles NCCL reads at startup, in order of precedence after the "
                    "environment:\n");
    for (const auto& [path, state] : r.settings.files) {
      absl::StrAppend(&out, "  ", path, ": ", state, "\n");
    }
  }
  return out;
}

std::string RenderTopoReportJson(const TopoReport& r, int indent) {
  const Topology& t = r.topology;
  json j;
  const Classification& c = r.profile.classification;
  j["class"] = TopologyClassName(c.cls);
  j["class_description"] = TopologyClassDescription(c.cls);
  j["reason"] = c.reason;
  j["intra_node"] = c.intra_node;
  j["network"] = c.network;
  j["source"] = t.source;
  j["nccl_version"] = r.nccl_version.ToString();
  j["nccl_version_source"] = r.nccl_version_source;
  if (r.nccl_library) {
    j["nccl_library"] = {{"path", r.nccl_library->path},
                         {"version", r.nccl_library->version.ToString()},
                         {"source", NcclLibrarySourceName(r.nccl_library->source)},
                         {"reason", r.nccl_library->reason}};
  } else {
    j["nccl_library"] = nullptr;
  }
  j["gpus"] = json::array();
  for (const Gpu& g : t.gpus) {
    j["gpus"].push_back({{"index", g.index},
                         {"pci_bus_id", g.pci_bus_id},
                         {"name", g.name},
                         {"numa_node", g.numa_node},
                         {"cpu_affinity", g.cpu_affinity}});
  }
  j["nics"] = json::array();
  for (const Nic& n : t.nics) {
    j["nics"].push_back({{"name", n.name},
                         {"kind", NicKindName(n.kind)},
                         {"pci_bus_id", n.pci_bus_id},
                         {"driver", n.driver},
                         {"netdevs", n.netdevs},
                         {"numa_node", n.numa_node},
                         {"port", n.port},
                         {"active", n.active},
                         {"speed_gbps", n.speed_gbps},
                         {"gid_types", n.gid_types},
                         {"gids", n.gids}});
  }
  json labels = json::array(), cells = json::array();
  for (int i = 0; i < t.num_devices(); ++i) {
    labels.push_back(t.DeviceLabel(i));
    json row = json::array();
    for (int k = 0; k < t.num_devices(); ++k) row.push_back(LinkSymbol(t.link(i, k)));
    cells.push_back(row);
  }
  j["matrix"] = {{"labels", labels}, {"cells", cells}};
  j["legend"] = json::object();
  for (const LegendEntry& e : PathLegend()) j["legend"][e.symbol] = e.meaning;
  j["nvswitches"] = t.nvswitches;
  j["nvlink_known"] = t.nvlink_known;
  j["numa_nodes"] = t.numa_nodes;
  j["gpudirect"] = {{"peermem", t.gpudirect.peermem},
                    {"module", t.gpudirect.module},
                    {"dmabuf_kernel", t.gpudirect.dmabuf_kernel}};
  j["notes"] = t.notes;
  j["profile"] = json::array();
  for (const NcclProfileEntry& e : r.profile.entries) {
    json p = {{"name", e.name},
              {"value", e.value},
              {"reason", e.reason},
              {"target", e.target == ProfileTarget::kEnv ? "env" : "config"},
              {"user_set", e.user_set}};
    if (e.user_set) {
      p["user_value"] = e.user_value;
      p["user_origin"] = e.user_origin;
    }
    j["profile"].push_back(p);
  }
  j["profile_notes"] = r.profile.notes;
  j["lint"] = json::array();
  for (const Finding& f : r.lint.findings) {
    j["lint"].push_back({{"name", f.name},
                         {"value", f.value},
                         {"severity", SeverityName(f.severity)},
                         {"message", f.message},
                         {"fix", f.fix},
                         {"rule", f.rule},
                         {"origin", f.origin}});
  }
  j["summary"] = {{"errors", r.lint.errors()},
                  {"warnings", r.lint.warnings()},
                  {"info", r.lint.count(Severity::kInfo)}};
  j["files"] = json::array();
  for (const auto& [path, state] : r.settings.files)
    j["files"].push_back({{"path", path}, {"state", state}});
  // Invalid UTF-8 (a binary file linted by mistake) is replaced, not thrown on.
  return j.dump(indent, ' ', false, json::error_handler_t::replace) + "\n";
}

}  // namespace strata
