// Classify: the topology class of a machine (see strata/comm/topology.h).
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "strata/comm/topology.h"

namespace strata {
namespace {

struct Fabric {
  int gpus = 0;
  int pairs = 0;
  int nvlink_pairs = 0;
  std::set<int> nvlink_counts;
};

Fabric GpuFabric(const Topology& t) {
  Fabric f;
  f.gpus = static_cast<int>(t.gpus.size());
  for (int i = 0; i < f.gpus; ++i) {
    for (int j = i + 1; j < f.gpus; ++j) {
      ++f.pairs;
      const Link& l = t.link(i, j);
      if (l.type == PathType::kNvLink) {
        ++f.nvlink_pairs;
        f.nvlink_counts.insert(l.nvlinks);
      }
    }
  }
  return f;
}

}  // namespace

const char* TopologyClassName(TopologyClass cls) {
  switch (cls) {
    case TopologyClass::kSingleNodeNvSwitch:
      return "single-node-nvswitch";
    case TopologyClass::kNvLinkPartial:
      return "nvlink-partial";
    case TopologyClass::kPcieOnly:
      return "pcie-only";
    case TopologyClass::kMultiNodeInfiniBand:
      return "multi-node-infiniband";
    case TopologyClass::kMultiNodeRoce:
      return "multi-node-roce";
    case TopologyClass::kAwsEfa:
      return "aws-efa";
    case TopologyClass::kTcpOnly:
      return "tcp-only";
  }
  return "unknown";
}

const char* TopologyClassDescription(TopologyClass cls) {
  switch (cls) {
    case TopologyClass::kSingleNodeNvSwitch:
      return "one node whose GPUs all reach each other over NVLink (NVSwitch or all-to-all)";
    case TopologyClass::kNvLinkPartial:
      return "one node with NVLink inside groups of GPUs (bridged pairs) and PCIe between groups";
    case TopologyClass::kPcieOnly:
      return "one node whose GPUs talk over PCIe only";
    case TopologyClass::kMultiNodeInfiniBand:
      return "nodes joined by InfiniBand (RDMA)";
    case TopologyClass::kMultiNodeRoce:
      return "nodes joined by RDMA over Converged Ethernet (RoCE)";
    case TopologyClass::kAwsEfa:
      return "AWS nodes joined by Elastic Fabric Adapter, through the aws-ofi-nccl plugin";
    case TopologyClass::kTcpOnly:
      return "no RDMA network and nothing to tune inside the node: NCCL uses TCP sockets between "
             "processes";
  }
  return "unknown";
}

Classification Classify(const Topology& t, const ClassifyOptions& options) {
  Classification c;
  Fabric f = GpuFabric(t);
  std::string gpu_words;
  if (f.gpus == 0) {
    c.intra_node = "no-gpu";
    gpu_words = "no GPU";
  } else if (f.gpus == 1) {
    c.intra_node = "single-gpu";
    gpu_words = "1 GPU";
  } else if (f.nvlink_pairs == f.pairs) {
    c.intra_node = "nvswitch";
    gpu_words = absl::StrCat(f.gpus, " GPUs, every pair on NVLink (NV",
                             absl::StrJoin(f.nvlink_counts, "/NV"), ")");
  } else if (f.nvlink_pairs > 0) {
    c.intra_node = "nvlink-partial";
    gpu_words =
        absl::StrCat(f.gpus, " GPUs, NVLink on ", f.nvlink_pairs, " of ", f.pairs, " pairs");
  } else if (!t.nvlink_known && t.nvswitches > 0) {
    c.intra_node = "nvswitch";
    gpu_words = absl::StrCat(f.gpus, " GPUs and ", t.nvswitches,
                             " NVSwitch chips (NVLink assumed all-to-all; NVML not available)");
  } else {
    c.intra_node = "pcie";
    gpu_words = absl::StrCat(f.gpus, " GPUs, PCIe only",
                             t.nvlink_known ? "" : " as far as sysfs shows (no NVML)");
  }

  int ib = 0, roce = 0, efa = 0, rdma = 0, eth = 0;
  for (const Nic& n : t.nics) {
    if (!n.active) continue;
    switch (n.kind) {
      case NicKind::kInfiniBand:
        ++ib;
        break;
      case NicKind::kRoce:
        ++roce;
        break;
      case NicKind::kEfa:
        ++efa;
        break;
      case NicKind::kRdma:
        ++rdma;
        break;
      case NicKind::kEthernet:
        ++eth;
        break;
    }
  }
  std::string net_words;
  if (efa > 0) {
    c.network = "efa";
    net_words = absl::StrCat(efa, " active EFA device(s)");
  } else if (ib > 0) {
    c.network = "infiniband";
    net_words = absl::StrCat(ib, " active InfiniBand port(s)",
                             roce ? absl::StrCat(" (and ", roce, " RoCE)") : "");
  } else if (roce > 0) {
    c.network = "roce";
    net_words = absl::StrCat(roce, " active RoCE port(s)");
  } else if (rdma > 0) {
    c.network = "infiniband";
    net_words = absl::StrCat(rdma, " RDMA device(s) of unknown link layer, taken as InfiniBand");
  } else {
    c.network = "tcp";
    net_words = eth > 0 ? absl::StrCat("no RDMA device, ", eth, " Ethernet interface(s)")
                        : "no RDMA device";
  }

  bool rdma_net = c.network != "tcp";
  bool multi =
      options.scope == JobScope::kMultiNode || (options.scope == JobScope::kAuto && rdma_net);
  std::string scope_words =
      options.scope == JobScope::kAuto
          ? (multi ? "multi-node (an RDMA adapter is present)" : "single node (no RDMA adapter)")
          : (multi ? "multi-node (as asked)" : "single node (as asked)");
  if (multi) {
    if (c.network == "efa") {
      c.cls = TopologyClass::kAwsEfa;
    } else if (c.network == "infiniband") {
      c.cls = TopologyClass::kMultiNodeInfiniBand;
    } else if (c.network == "roce") {
      c.cls = TopologyClass::kMultiNodeRoce;
    } else {
      c.cls = TopologyClass::kTcpOnly;
    }
  } else if (c.intra_node == "nvswitch") {
    c.cls = TopologyClass::kSingleNodeNvSwitch;
  } else if (c.intra_node == "nvlink-partial") {
    c.cls = TopologyClass::kNvLinkPartial;
  } else if (c.intra_node == "pcie") {
    c.cls = TopologyClass::kPcieOnly;
  } else {
    c.cls = TopologyClass::kTcpOnly;
  }
  c.reason = absl::StrCat(gpu_words, "; ", net_words, "; ", scope_words);
  return c;
}

}  // namespace strata
