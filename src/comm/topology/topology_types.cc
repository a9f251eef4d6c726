// Names, the legend and the matrix rendering of a Topology.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "comm/topology/text_util.h"
#include "strata/comm/topology.h"

namespace strata {

std::string LinkSymbol(const Link& link) {
  switch (link.type) {
    case PathType::kSelf:
      return "X";
    case PathType::kNvLink:
      return absl::StrCat("NV", link.nvlinks);
    case PathType::kPix:
      return "PIX";
    case PathType::kPxb:
      return "PXB";
    case PathType::kPhb:
      return "PHB";
    case PathType::kNode:
      return "NODE";
    case PathType::kSys:
      return "SYS";
    case PathType::kUnknown:
      break;
  }
  return "?";
}

std::vector<LegendEntry> PathLegend() {
  return {
      {"X", "the device itself"},
      {"NV#",
       "joined by # NVLinks (directly, or each GPU's links into the NVSwitch fabric); "
       "fastest"},
      {"PIX", "PCIe through one switch at most; GPUDirect P2P and RDMA run at full speed"},
      {"PXB", "PCIe through several switches, without going through the CPU"},
      {"PHB", "PCIe through the CPU's root complex (host bridge)"},
      {"NODE", "PCIe through two host bridges of the same CPU socket / NUMA node"},
      {"SYS", "across CPU sockets (QPI/UPI/Infinity Fabric); slowest, NCCL avoids P2P here"},
      {"?", "not known from this input (no PCIe path, or NVLink unseen without NVML)"},
  };
}

const char* NicKindName(NicKind kind) {
  switch (kind) {
    case NicKind::kInfiniBand:
      return "InfiniBand";
    case NicKind::kRoce:
      return "RoCE";
    case NicKind::kEfa:
      return "EFA";
    case NicKind::kRdma:
      return "RDMA";
    case NicKind::kEthernet:
      return "Ethernet";
  }
  return "unknown";
}

std::string Topology::DeviceLabel(int i) const {
  if (i < static_cast<int>(gpus.size())) return absl::StrCat("GPU", i);
  return absl::StrCat("NIC", i - static_cast<int>(gpus.size()));
}

absl::StatusOr<std::string> ReadTextFile(const std::string& path) {
  return topology_internal::ReadFile(path);
}

namespace {

std::string Speed(double gbps) {
  if (gbps <= 0) return "speed unknown";
  return absl::StrFormat("%g Gb/s", gbps);
}

}  // namespace

std::string RenderMatrix(const Topology& t) {
  std::string out;
  const int n = t.num_devices();
  if (n == 0) {
    absl::StrAppend(&out, "(no GPUs or network adapters found)\n");
    return out;
  }
  size_t width = 5;
  for (int i = 0; i < n; ++i) width = std::max(width, t.DeviceLabel(i).size() + 1);
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) width = std::max(width, LinkSymbol(t.link(i, j)).size() + 1);
  }
  const int label_width = static_cast<int>(width);
  absl::StrAppend(&out, absl::StrFormat("%-*s", label_width, ""));
  for (int j = 0; j < n; ++j) {
    absl::StrAppend(&out, absl::StrFormat("%-*s", static_cast<int>(width), t.DeviceLabel(j)));
  }
  absl::StrAppend(&out, "NUMA\n");
  for (int i = 0; i < n; ++i) {
    absl::StrAppend(&out, absl::StrFormat("%-*s", label_width, t.DeviceLabel(i)));
    for (int j = 0; j < n; ++j) {
      absl::StrAppend(&out,
                      absl::StrFormat("%-*s", static_cast<int>(width), LinkSymbol(t.link(i, j))));
    }
    int numa = i < static_cast<int>(t.gpus.size()) ? t.gpus[i].numa_node
                                                   : t.nics[i - t.gpus.size()].numa_node;
    absl::StrAppend(&out, numa >= 0 ? absl::StrCat(numa) : std::string("-"), "\n");
  }
  absl::StrAppend(&out, "\nLegend:\n");
  for (const LegendEntry& e : PathLegend()) {
    absl::StrAppend(&out, absl::StrFormat("  %-5s %s\n", e.symbol, e.meaning));
  }
  if (!t.gpus.empty()) {
    absl::StrAppend(&out, "\nGPUs:\n");
    for (const Gpu& g : t.gpus) {
      absl::StrAppend(&out, absl::StrFormat("  GPU%-3d %-14s %s, NUMA node %s\n", g.index,
                                            g.pci_bus_id.empty() ? "-" : g.pci_bus_id, g.name,
                                            g.numa_node >= 0 ? absl::StrCat(g.numa_node) : "?"));
    }
  }
  if (!t.nics.empty()) {
    absl::StrAppend(&out, "\nNICs:\n");
    for (size_t i = 0; i < t.nics.size(); ++i) {
      const Nic& nic = t.nics[i];
      std::string netdevs =
          nic.netdevs.empty() ? "" : absl::StrCat(" (", absl::StrJoin(nic.netdevs, ","), ")");
      absl::StrAppend(
          &out, absl::StrFormat("  NIC%-3d %s%s: %s, %s, %s, NUMA node %s\n", static_cast<int>(i),
                                nic.name, netdevs, NicKindName(nic.kind), Speed(nic.speed_gbps),
                                nic.active ? "up" : "DOWN",
                                nic.numa_node >= 0 ? absl::StrCat(nic.numa_node) : "?"));
    }
  }
  return out;
}

}  // namespace strata
