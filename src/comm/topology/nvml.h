// NVML, loaded with dlopen at run time so that libstrata runs (and detects
// "no GPU") where no NVIDIA driver is installed. Internal.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "strata/comm/topology.h"

namespace strata {
namespace topology_internal {

struct NvmlView {
  std::vector<Gpu> gpus;                     // NVML order, names and bus ids
  std::vector<std::vector<Link>> gpu_links;  // NVLink (or NVML's PCIe level) per GPU pair
  int nvswitches = 0;                        // distinct NVSwitch endpoints of NVLinks
};

// Loads `library`, initializes NVML, reads every GPU and shuts NVML down.
// Unavailable when the library cannot be loaded or NVML cannot initialize
// (no driver), naming the library and NVML's error string.
absl::StatusOr<NvmlView> ReadNvml(const std::string& library);

}  // namespace topology_internal
}  // namespace strata
