#include "comm/topology/pci_path.h"

namespace strata {
namespace topology_internal {

PathType ClassifyPciPath(const std::vector<std::string>& a, const std::vector<std::string>& b,
                         int numa_a, int numa_b) {
  if (!a.empty() && a == b) return PathType::kSelf;
  if (a.empty() || b.empty() || a[0] != b[0]) {
    if (numa_a >= 0 && numa_b >= 0 && numa_a != numa_b) return PathType::kSys;
    return PathType::kNode;
  }
  size_t common = 0;
  while (common < a.size() && common < b.size() && a[common] == b[common]) ++common;
  if (common <= 1) return PathType::kPhb;
  size_t da = a.size() - common, db = b.size() - common;
  return (da <= 2 && db <= 2) ? PathType::kPix : PathType::kPxb;
}

}  // namespace topology_internal
}  // namespace strata
