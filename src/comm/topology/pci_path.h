// The nvidia-smi path class between two PCI devices given their paths from
// the root (internal): shared by the sysfs and NCCL XML readers.
#pragma once

#include <string>
#include <vector>

#include "strata/comm/topology.h"

namespace strata {
namespace topology_internal {

// `a` and `b` list the tree from the root down to the device: the host
// bridge (sysfs "pci0000:00") or CPU (NCCL XML), then each bridge, then the
// device itself. A PCIe switch is an upstream port with downstream ports
// below it, so devices under one switch sit at most two levels below their
// common ancestor (PIX); deeper is PXB; sharing only the root is PHB;
// different roots are NODE within one NUMA node and SYS across nodes
// (unknown NUMA nodes, -1, count as the same node).
PathType ClassifyPciPath(const std::vector<std::string>& a, const std::vector<std::string>& b,
                         int numa_a, int numa_b);

}  // namespace topology_internal
}  // namespace strata
