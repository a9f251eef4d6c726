// Bindings for LaunchEnv and the build configuration.
#include <pybind11/stl.h>

#include "registry.h"
#include "status_map.h"
#include "strata/comm/launch_env.h"
#include "strata/version.h"

namespace py = pybind11;

namespace strata::bindings {
namespace {

Registration reg(kOrderBase, [](py::module_& m) {
  m.def(
      "build_info",
      [] {
        BuildInfo b = GetBuildInfo();
        py::dict d;
        d["version"] = b.version;
        d["cuda"] = b.cuda;
        d["nccl"] = b.nccl;
        d["mpi"] = b.mpi;
        d["ulfm"] = b.ulfm;
        d["gloo"] = b.gloo;
        return d;
      },
      "What this build of strata contains: version and compiled-in backends.");

  py::class_<LaunchEnv>(m, "LaunchEnv", "Who this process is in the job (see strata.launch_env).")
      .def_property_readonly("launcher",
                             [](const LaunchEnv& e) { return LauncherName(e.launcher); })
      .def_readonly("rank", &LaunchEnv::rank)
      .def_readonly("world_size", &LaunchEnv::world_size)
      .def_readonly("local_rank", &LaunchEnv::local_rank)
      .def_readonly("local_world_size", &LaunchEnv::local_world_size)
      .def_readonly("node_index", &LaunchEnv::node_index)
      .def_readonly("num_nodes", &LaunchEnv::num_nodes)
      .def_readonly("node_index_exact", &LaunchEnv::node_index_exact)
      .def_readonly("master_addr", &LaunchEnv::master_addr)
      .def_readonly("master_port", &LaunchEnv::master_port)
      .def_readonly("source", &LaunchEnv::source)
      .def("__repr__", [](const LaunchEnv& e) { return "LaunchEnv(" + e.ToString() + ")"; });

  m.def(
      "launch_env",
      [](std::optional<std::map<std::string, std::string>> env) {
        return Unwrap(env ? LaunchEnv::Detect(*env) : LaunchEnv::Detect(), ErrorArea::kLaunch);
      },
      py::arg("env") = py::none(),
      "Detects rank, world size, local rank, node and rendezvous address from the\n"
      "launcher's variables (mpirun, torchrun, Slurm, or none). `env` replaces\n"
      "os.environ. Raises strata.LaunchError on an inconsistent environment.");
});

}  // namespace
}  // namespace strata::bindings
