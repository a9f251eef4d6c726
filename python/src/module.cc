// The strata._strata extension module: runs the registrations of every
// binding file (see registry.h).
#include <algorithm>
#include <utility>
#include <vector>

#include "registry.h"

namespace strata::bindings {
namespace {

std::vector<std::pair<int, std::function<void(pybind11::module_&)>>>& Registrations() {
  static auto* registrations =
      new std::vector<std::pair<int, std::function<void(pybind11::module_&)>>>();
  return *registrations;
}

}  // namespace

Registration::Registration(int order, std::function<void(pybind11::module_&)> fn) {
  Registrations().emplace_back(order, std::move(fn));
}

void RegisterAll(pybind11::module_& m) {
  auto& regs = Registrations();
  std::stable_sort(regs.begin(), regs.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  for (auto& [order, fn] : regs) fn(m);
}

}  // namespace strata::bindings

PYBIND11_MODULE(_strata, m) {
  m.doc() = "strata: embeddable distributed-training runtime (C++ core)";
  strata::bindings::RegisterAll(m);
}
