// ParseNvidiaSmiTopo on arbitrary text: never crashes or hangs, and an
// accepted matrix is square over the devices it lists with X on the diagonal.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "strata/comm/topology.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<strata::Topology> t = strata::ParseNvidiaSmiTopo(text);
  if (!t.ok()) return 0;
  const size_t n = static_cast<size_t>(t->num_devices());
  if (t->links.size() != n) std::abort();
  for (size_t i = 0; i < n; ++i) {
    if (t->links[i].size() != n) std::abort();
    if (t->links[i][i].type != strata::PathType::kSelf) std::abort();
  }
  (void)strata::RenderMatrix(*t);
  return 0;
}
