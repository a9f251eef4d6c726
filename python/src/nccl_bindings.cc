// Bindings for the NCCL library in use (include/strata/comm/nccl.h); the
// Pythonic face is python/strata/nccl.py.
#include <pybind11/pybind11.h>

#include <string>

#include "registry.h"
#include "status_map.h"
#include "strata/comm/nccl.h"

namespace py = pybind11;

namespace strata::bindings {
namespace {

Registration reg(kOrderComm, [](py::module_& m) {
  m.def(
      "_nccl_library",
      [](const std::string& library) {
        absl::StatusOr<NcclLibraryInfo> info;
        {
          py::gil_scoped_release release;
          info = LoadNcclLibrary(library);
        }
        if (!info.ok()) RaiseStatus(info.status(), ErrorArea::kComm);
        py::dict d;
        d["path"] = info->path;
        d["version"] =
            py::make_tuple(info->version.major, info->version.minor, info->version.patch);
        d["reason"] = info->reason;
        return d;
      },
      py::arg("library") = "");
});

}  // namespace
}  // namespace strata::bindings
