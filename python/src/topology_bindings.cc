// Bindings for strata.topology (see python/strata/topology.py and
// include/strata/comm/topology_report.h): one call that builds the report
// and renders it as JSON, text, export lines or nccl.conf.
#include <pybind11/stl.h>

#include "group_handle.h"
#include "registry.h"
#include "status_map.h"
#include "strata/comm/nccl_lint.h"
#include "strata/comm/nccl_settings.h"
#include "strata/comm/topology_report.h"

namespace py = pybind11;

namespace strata::bindings {
namespace {

TopoReportOptions FromDict(const py::dict& d) {
  TopoReportOptions o;
  auto str = [&](const char* key, std::string* out) {
    if (d.contains(key) && !d[key].is_none()) *out = py::cast<std::string>(d[key]);
  };
  str("sysfs_root", &o.detect.sysfs_root);
  str("from_nvidia_smi", &o.from_nvidia_smi);
  str("from_xml", &o.from_xml);
  str("home_dir", &o.home_dir);
  str("system_conf", &o.system_conf);
  if (d.contains("nvidia_smi_text") && !d["nvidia_smi_text"].is_none()) {
    o.detect.nvidia_smi_topo = py::cast<std::string>(d["nvidia_smi_text"]);
  }
  if (d.contains("use_nvml")) o.detect.use_nvml = py::cast<bool>(d["use_nvml"]);
  if (d.contains("read_conf_files")) o.read_conf_files = py::cast<bool>(d["read_conf_files"]);
  if (d.contains("lint_files")) o.lint_files = py::cast<std::vector<std::string>>(d["lint_files"]);
  if (d.contains("env") && !d["env"].is_none()) {
    o.environment = py::cast<std::map<std::string, std::string>>(d["env"]);
  }
  if (d.contains("nccl_version") && !d["nccl_version"].is_none()) {
    o.nccl_version =
        Unwrap(NcclVersion::Parse(py::cast<std::string>(d["nccl_version"])), ErrorArea::kTopology);
  }
  std::string scope = "auto";
  str("scope", &scope);
  if (scope == "single-node") {
    o.classify.scope = JobScope::kSingleNode;
  } else if (scope == "multi-node") {
    o.classify.scope = JobScope::kMultiNode;
  } else if (scope != "auto") {
    RaiseStatus(
        absl::InvalidArgumentError("scope '" + scope + "' is not auto, single-node or multi-node"),
        ErrorArea::kTopology);
  }
  return o;
}

Registration reg(kOrderComm, [](py::module_& m) {
  m.def(
      "_topology_report",
      [](const py::dict& options, const std::string& format) {
        TopoReportOptions o = FromDict(options);
        if (format != "json" && format != "text" && format != "env" && format != "conf") {
          RaiseStatus(
              absl::InvalidArgumentError("format '" + format + "' is not json, text, env or conf"),
              ErrorArea::kTopology);
        }
        absl::StatusOr<TopoReport> r;
        {
          py::gil_scoped_release release;  // reads files, may load NVML
          r = BuildTopoReport(o);
        }
        TopoReport report = Unwrap(std::move(r), ErrorArea::kTopology);
        if (format == "text") return RenderTopoReportText(report);
        if (format == "env") return report.profile.ExportEnv();
        if (format == "conf") return report.profile.ExportConf();
        return RenderTopoReportJson(report, -1);
      },
      py::arg("options"), py::arg("format") = "json",
      "Builds the strata-topo report (see strata.topology) and renders it.");

  m.def(
      "_check_nccl_consistency",
      [](py::handle group, std::optional<std::map<std::string, std::string>> env,
         std::vector<std::string> ignore, double timeout) {
        Communicator& comm = GroupCommunicator(group);
        CollectOptions collect;
        collect.environment = std::move(env);
        EffectiveSettings settings = Unwrap(CollectNcclSettings(collect), ErrorArea::kTopology);
        ConsistencyOptions options;
        options.ignore = std::move(ignore);
        options.timeout = absl::Seconds(timeout);
        absl::StatusOr<ConsistencyReport> report;
        {
          py::gil_scoped_release release;  // collective over the group
          report = CheckNcclConsistency(comm, settings, options);
        }
        ConsistencyReport r = Unwrap(std::move(report), ErrorArea::kComm);
        py::dict out;
        out["consistent"] = r.consistent;
        out["groups"] = r.groups;
        py::list diffs;
        for (const ConsistencyDifference& d : r.differences) {
          py::dict e;
          e["name"] = d.name;
          e["values"] = d.values;
          diffs.append(e);
        }
        out["differences"] = diffs;
        out["text"] = r.ToString();
        return out;
      },
      py::arg("group"), py::arg("env") = py::none(), py::arg("ignore") = std::vector<std::string>{},
      py::arg("timeout") = 60.0,
      "Collective over `group`: compares every rank's effective NCCL settings.");
});

}  // namespace
}  // namespace strata::bindings
