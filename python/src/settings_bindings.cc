// Bindings for strata's settings registry (strata/base/settings.h): the one
// way Python reads a STRATA_* variable (python/strata/_settings.py).
#include <pybind11/stl.h>

#include "registry.h"
#include "status_map.h"
#include "strata/base/settings.h"

namespace py = pybind11;

namespace strata::bindings {
namespace {

const char* TypeName(SettingType type) {
  switch (type) {
    case SettingType::kBool:
      return "bool";
    case SettingType::kChoice:
      return "choice";
    case SettingType::kPath:
      return "path";
    case SettingType::kText:
      return "text";
  }
  return "unknown";
}

Registration reg(kOrderBase, [](py::module_& m) {
  m.def(
      "settings",
      [](std::optional<std::map<std::string, std::string>> env) {
        Settings s = Unwrap(env ? Settings::FromMap(*env) : Settings::FromEnvironment(),
                            ErrorArea::kGeneric);
        py::list out;
        for (const SettingValue& v : s.List()) {
          py::dict d;
          d["name"] = v.info.name;
          d["value"] = v.value;
          d["source"] = v.from_environment ? "environment" : "default";
          d["default"] = v.default_value;
          d["type"] = TypeName(v.info.type);
          d["choices"] = v.info.choices;
          d["meaning"] = v.info.meaning;
          d["doc"] = v.info.doc;
          out.append(d);
        }
        return out;
      },
      py::arg("env") = py::none(),
      "Every STRATA_* setting with its value in `env` (default os.environ), as dicts.\n"
      "Raises strata.InvalidArgument naming a variable whose value its type does not take.");
});

}  // namespace
}  // namespace strata::bindings
