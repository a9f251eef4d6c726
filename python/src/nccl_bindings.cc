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

py::dict ToDict(const NcclLibraryInfo& info) {
  py::dict d;
  d["path"] = info.path;
  d["version"] = py::make_tuple(info.version.major, info.version.minor, info.version.patch);
  d["source"] = NcclLibrarySourceName(info.source);
  d["reason"] = info.reason;
  return d;
}

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
        return ToDict(*info);
      },
      py::arg("library") = "");
  m.def(
      "_nccl_find",
      [](const std::string& library) {
        absl::StatusOr<NcclLibraryInfo> info;
        {
          py::gil_scoped_release release;
          info = FindNcclLibrary(library);
        }
        if (!info.ok()) RaiseStatus(info.status(), ErrorArea::kComm);
        return ToDict(*info);
      },
      py::arg("library") = "");
});

}  // namespace
}  // namespace strata::bindings
