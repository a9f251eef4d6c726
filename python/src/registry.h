// Self-registration of binding files: each python/src/<area>.cc defines a
// static Registration that adds its classes and functions to the module, so
// adding an area never edits a central file.
//
//   static strata::bindings::Registration reg(strata::bindings::kOrderComm,
//                                       [](pybind11::module_& m) { ... });
#pragma once

#include <pybind11/pybind11.h>

#include <functional>

namespace strata::bindings {

// Areas register in this order (types used by later areas come first).
enum Order : int {
  kOrderErrors = 0,
  kOrderBase = 10,
  kOrderComm = 20,
  kOrderParallel = 30,
  kOrderWorld = 40,
  kOrderCheckpoint = 50,
  kOrderElastic = 60,
};

class Registration {
 public:
  Registration(int order, std::function<void(pybind11::module_&)> fn);
};

// Calls every registered function in order; used once by the module init.
void RegisterAll(pybind11::module_& m);

}  // namespace strata::bindings
