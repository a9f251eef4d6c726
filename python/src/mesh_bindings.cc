// Bindings for strata.Mesh (see include/strata/parallel/mesh.h).
#include <pybind11/stl.h>

#include "absl/strings/str_cat.h"
#include "registry.h"
#include "status_map.h"
#include "strata/parallel/mesh.h"

namespace py = pybind11;

namespace strata::bindings {
namespace {

Mesh MakeMesh(int world_size, int tp, int pp, int cp, int ep, std::optional<int> etp,
              std::optional<int> dp, const std::string& order, std::optional<int> ranks_per_node) {
  MeshSpec spec;
  spec.world_size = world_size;
  spec.tp = tp;
  spec.pp = pp;
  spec.cp = cp;
  spec.ep = ep;
  // None means "derive"; an explicit value must be valid (0 is not "derive").
  if (etp && *etp < 1) {
    RaiseStatus(absl::InvalidArgumentError(absl::StrCat("mesh axis etp has size ", *etp,
                                                        "; every axis size must be >= 1")),
                ErrorArea::kMesh);
  }
  if (dp && *dp < 1) {
    RaiseStatus(absl::InvalidArgumentError(
                    absl::StrCat("mesh axis dp has size ", *dp, "; every axis size must be >= 1")),
                ErrorArea::kMesh);
  }
  if (ranks_per_node && *ranks_per_node < 1) {
    RaiseStatus(
        absl::InvalidArgumentError(absl::StrCat("ranks_per_node ", *ranks_per_node, " < 1")),
        ErrorArea::kMesh);
  }
  spec.etp = etp.value_or(0);
  spec.dp = dp.value_or(0);
  spec.order = order;
  spec.ranks_per_node = ranks_per_node.value_or(0);
  return Unwrap(Mesh::Create(spec), ErrorArea::kMesh);
}

py::list ToList(const RankGroups& groups) {
  py::list out(groups.num_groups());
  for (int g = 0; g < groups.num_groups(); ++g) {
    absl::Span<const int> s = groups.group(g);
    py::list members(s.size());
    for (size_t i = 0; i < s.size(); ++i) members[i] = s[i];
    out[g] = std::move(members);
  }
  return out;
}

Registration reg(kOrderParallel, [](py::module_& m) {
  py::class_<Mesh>(m, "Mesh", R"doc(
The DP/TP/PP/CP/EP layout of a job: which ranks form each process group.

Pure arithmetic, no communication. Ranks are numbered as Megatron-Core numbers
them: the leftmost axis of ``order`` has stride 1. ``dp`` defaults to
world_size / (tp*pp*cp). Expert parallelism is carved out of dp*cp: the
expert mesh has expert-TP ``etp`` (default tp), ``ep`` and expert-DP
``edp = world_size / (etp*ep*pp)`` and shares the pipeline groups.
Invalid specs raise strata.MeshError naming the numbers.
)doc")
      .def(py::init(&MakeMesh), py::arg("world_size"), py::kw_only(), py::arg("tp") = 1,
           py::arg("pp") = 1, py::arg("cp") = 1, py::arg("ep") = 1, py::arg("etp") = py::none(),
           py::arg("dp") = py::none(), py::arg("order") = "tp-cp-ep-dp-pp",
           py::arg("ranks_per_node") = py::none())
      .def_property_readonly("world_size", &Mesh::world_size)
      .def_property_readonly("tp", &Mesh::tp)
      .def_property_readonly("pp", &Mesh::pp)
      .def_property_readonly("cp", &Mesh::cp)
      .def_property_readonly("dp", &Mesh::dp)
      .def_property_readonly("ep", &Mesh::ep)
      .def_property_readonly("etp", &Mesh::etp)
      .def_property_readonly("edp", &Mesh::edp)
      .def_property_readonly("order", [](const Mesh& m) { return m.spec().order; })
      .def_property_readonly("ranks_per_node",
                             [](const Mesh& m) -> std::optional<int> {
                               if (m.spec().ranks_per_node == 0) return std::nullopt;
                               return m.spec().ranks_per_node;
                             })
      .def(
          "groups",
          [](const Mesh& m, const std::string& axes) {
            return ToList(Unwrap(m.Groups(axes), ErrorArea::kMesh));
          },
          py::arg("axes"),
          "Every group of an axis or axis combination ('tp', 'dp-cp', 'tp-pp') as rank lists.")
      .def(
          "expert_groups",
          [](const Mesh& m, const std::string& axes) {
            return ToList(Unwrap(m.ExpertGroups(axes), ErrorArea::kMesh));
          },
          py::arg("axes"),
          "Every group of the expert mesh: 'ep', 'tp' (expert-TP), 'dp' (expert-DP), 'tp-ep', "
          "'tp-ep-pp'.")
      .def(
          "group_of",
          [](const Mesh& m, int rank, const std::string& axes) {
            return Unwrap(m.GroupOf(rank, axes), ErrorArea::kMesh);
          },
          py::arg("rank"), py::arg("axes"), "The group of `axes` that holds `rank`.")
      .def(
          "expert_group_of",
          [](const Mesh& m, int rank, const std::string& axes) {
            return Unwrap(m.ExpertGroupOf(rank, axes), ErrorArea::kMesh);
          },
          py::arg("rank"), py::arg("axes"))
      .def(
          "coords",
          [](const Mesh& m, int rank) { return Unwrap(m.Coords(rank), ErrorArea::kMesh); },
          py::arg("rank"),
          "Coordinates of `rank`: tp, cp, dp, pp (and etp, ep, edp on an expert mesh).")
      .def(
          "rank",
          [](const Mesh& m, py::kwargs kwargs) {
            std::map<std::string, int> coords;
            for (auto item : kwargs)
              coords[py::cast<std::string>(item.first)] = py::cast<int>(item.second);
            return Unwrap(m.RankAt(coords), ErrorArea::kMesh);
          },
          "The rank at the given coordinates, e.g. mesh.rank(tp=1, dp=0, pp=1).")
      .def(
          "pipeline_next",
          [](const Mesh& m, int rank) { return Unwrap(m.PipelineNext(rank), ErrorArea::kMesh); },
          py::arg("rank"))
      .def(
          "pipeline_prev",
          [](const Mesh& m, int rank) { return Unwrap(m.PipelinePrev(rank), ErrorArea::kMesh); },
          py::arg("rank"))
      .def(
          "embedding_group",
          [](const Mesh& m, int rank) { return Unwrap(m.EmbeddingGroup(rank), ErrorArea::kMesh); },
          py::arg("rank"), "Ranks of the first and last pipeline stage of `rank`'s pp group.")
      .def(
          "check_topology",
          [](const Mesh& m, std::optional<int> ranks_per_node) {
            py::list out;
            for (const TopologyWarning& w : m.CheckTopology(ranks_per_node.value_or(0))) {
              py::dict d;
              d["axis"] = w.axis;
              d["groups_spanning"] = w.groups_spanning;
              d["message"] = w.message;
              d["suggestion"] = w.suggestion;
              out.append(d);
            }
            return out;
          },
          py::arg("ranks_per_node") = py::none(),
          "Warnings for tp/cp/ep groups that span nodes, each with a suggested fix.")
      .def("describe", &Mesh::Describe, py::arg("max_groups") = 4,
           "A readable table of each axis's groups.")
      .def("spec",
           [](const Mesh& m) {
             const MeshSpec& s = m.spec();
             py::dict d;
             d["version"] = s.version;
             d["world_size"] = s.world_size;
             d["tp"] = s.tp;
             d["pp"] = s.pp;
             d["cp"] = s.cp;
             d["ep"] = s.ep;
             d["etp"] = s.etp;
             d["dp"] = s.dp;
             d["order"] = s.order;
             d["ranks_per_node"] = s.ranks_per_node;
             return d;
           })
      .def("__repr__", [](const Mesh& m) {
        const MeshSpec& s = m.spec();
        return absl::StrCat("Mesh(world_size=", s.world_size, ", tp=", s.tp, ", pp=", s.pp,
                            ", cp=", s.cp, ", dp=", s.dp, ", ep=", s.ep, ", etp=", s.etp,
                            ", order='", s.order, "')");
      });
});

}  // namespace
}  // namespace strata::bindings
