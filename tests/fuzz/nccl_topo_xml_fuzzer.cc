// ParseNcclTopoXml on arbitrary bytes: never crashes, hangs or runs away
// with memory (depth and element counts are bounded), and an accepted
// topology has a square device matrix.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "strata/comm/topology.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string xml(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<strata::Topology> t = strata::ParseNcclTopoXml(xml);
  if (!t.ok()) return 0;
  const size_t n = static_cast<size_t>(t->num_devices());
  if (t->links.size() != n) std::abort();
  for (const auto& row : t->links) {
    if (row.size() != n) std::abort();
  }
  (void)strata::RenderMatrix(*t);
  return 0;
}
