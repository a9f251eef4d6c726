// ParseNcclTopoXml: NCCL's topology XML (what NCCL_TOPO_DUMP_FILE writes and
// NCCL_TOPO_FILE reads) as a Topology.
//
// The document is <system> holding one <cpu numaid=..> per NUMA node; below a
// CPU, nested <pci busid=.. class=..> elements are the PCIe tree (switches,
// then devices); a device <pci> holds <gpu dev=..> (with <nvlink target=..
// count=.. tclass=..> children) or <nic> (with <net name=.. speed=..> per
// port). NVLinks whose target class is 0x068000 end on an NVSwitch.
#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "comm/topology/pci_path.h"
#include "comm/topology/text_util.h"
#include "comm/topology/xml_reader.h"
#include "strata/base/status.h"
#include "strata/comm/topology.h"

namespace strata {
namespace {

using topology_internal::XmlNode;

constexpr char kNvSwitchClass[] = "0x068000";

struct Place {
  std::vector<std::string> path;  // cpu id, then pci bus ids
  int numa = -1;
};

struct XmlGpu {
  Gpu gpu;
  Place place;
  std::vector<std::pair<std::string, int>> nvlinks;  // target bus id, count
  std::vector<int> switch_links;
};

struct XmlNet {
  Nic nic;
  Place place;
};

NicKind GuessKind(const std::string& name) {
  // The XML does not record link layers. NCCL's IB transport names a port by
  // its verbs device (mlx5_0), the socket transport by its netdev (eth0, or
  // ib0 for IP over InfiniBand); AWS EFA devices are rdmap* / efa*.
  if (absl::StartsWith(name, "rdmap") || absl::StartsWith(name, "efa")) return NicKind::kEfa;
  for (const char* netdev : {"eth", "ens", "enp", "eno", "enP", "bond", "ib", "lo"}) {
    if (absl::StartsWith(name, netdev)) return NicKind::kEthernet;
  }
  return NicKind::kRdma;
}

absl::Status BadAttr(const XmlNode& node, absl::string_view attr, const std::string& value) {
  return absl::InvalidArgumentError(absl::StrCat("XML line ", node.line, ": <", node.name, "> ",
                                                 attr, "='", value, "' is not valid"));
}

absl::Status Walk(const XmlNode& node, Place place, std::vector<XmlGpu>* gpus,
                  std::vector<XmlNet>* nets, int* cpus) {
  if (node.name == "cpu") {
    ++*cpus;
    const std::string* id = node.Attr("numaid");
    if (id == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("XML line ", node.line, ": <cpu> has no numaid attribute"));
    }
    if (!absl::SimpleAtoi(*id, &place.numa) || place.numa < -1) return BadAttr(node, "numaid", *id);
    place.path = {absl::StrCat("cpu", *id)};
  } else if (node.name == "pci") {
    const std::string* bus = node.Attr("busid");
    if (bus == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("XML line ", node.line, ": <pci> has no busid attribute"));
    }
    place.path.push_back(topology_internal::NormalizeBusId(*bus));
  } else if (node.name == "gpu") {
    XmlGpu g;
    g.place = place;
    g.gpu.pci_bus_id = place.path.size() > 1 ? place.path.back() : "";
    g.gpu.numa_node = place.numa;
    const std::string* dev = node.Attr("dev");
    int index = -1;
    if (dev != nullptr && !absl::SimpleAtoi(*dev, &index)) return BadAttr(node, "dev", *dev);
    g.gpu.index = index;
    const std::string* sm = node.Attr("sm");
    g.gpu.name = sm ? absl::StrCat("sm_", *sm) : "GPU";
    for (const XmlNode& link : node.children) {
      if (link.name != "nvlink") continue;
      const std::string* target = link.Attr("target");
      const std::string* count = link.Attr("count");
      const std::string* tclass = link.Attr("tclass");
      int n = 0;
      if (count == nullptr || !absl::SimpleAtoi(*count, &n) || n < 0 || n > 1024) {
        return BadAttr(link, "count", count ? *count : "(missing)");
      }
      if (tclass != nullptr && *tclass == kNvSwitchClass) {
        g.switch_links.push_back(n);
      } else if (target != nullptr) {
        g.nvlinks.emplace_back(topology_internal::NormalizeBusId(*target), n);
      }
    }
    gpus->push_back(std::move(g));
    return absl::OkStatus();
  } else if (node.name == "net") {
    XmlNet net;
    net.place = place;
    const std::string* name = node.Attr("name");
    net.nic.name = name ? *name : absl::StrCat("net", nets->size());
    net.nic.kind = GuessKind(net.nic.name);
    net.nic.numa_node = place.numa;
    net.nic.pci_bus_id = place.path.size() > 1 ? place.path.back() : "";
    if (const std::string* speed = node.Attr("speed")) {
      double mbps = 0;
      if (!absl::SimpleAtod(*speed, &mbps) || mbps < 0) return BadAttr(node, "speed", *speed);
      net.nic.speed_gbps = mbps / 1000.0;
    }
    if (const std::string* port = node.Attr("port")) {
      if (!absl::SimpleAtoi(*port, &net.nic.port)) return BadAttr(node, "port", *port);
    }
    nets->push_back(std::move(net));
    return absl::OkStatus();
  }
  for (const XmlNode& child : node.children) {
    STRATA_RETURN_IF_ERROR(Walk(child, place, gpus, nets, cpus));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Topology> ParseNcclTopoXml(absl::string_view xml) {
  STRATA_ASSIGN_OR_RETURN(XmlNode doc, topology_internal::ParseXml(xml));
  const XmlNode* system = nullptr;
  for (const XmlNode& n : doc.children) {
    if (n.name == "system") system = &n;
  }
  if (system == nullptr) {
    return absl::InvalidArgumentError("not an NCCL topology: no <system> element");
  }
  std::vector<XmlGpu> gpus;
  std::vector<XmlNet> nets;
  int cpus = 0;
  STRATA_RETURN_IF_ERROR(Walk(*system, Place{}, &gpus, &nets, &cpus));
  if (gpus.size() + nets.size() > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("NCCL topology lists ", gpus.size() + nets.size(), " devices (limit 4096)"));
  }
  // GPUs in their NCCL device order when given, else document order.
  std::stable_sort(gpus.begin(), gpus.end(),
                   [](const XmlGpu& a, const XmlGpu& b) { return a.gpu.index < b.gpu.index; });

  Topology t;
  t.source = "NCCL topology XML";
  t.nvlink_known = true;
  t.numa_nodes = std::max(cpus, 1);
  std::map<std::string, int> gpu_by_bus;
  for (size_t i = 0; i < gpus.size(); ++i) {
    gpus[i].gpu.index = static_cast<int>(i);
    if (!gpus[i].gpu.pci_bus_id.empty()) gpu_by_bus[gpus[i].gpu.pci_bus_id] = static_cast<int>(i);
    t.gpus.push_back(gpus[i].gpu);
    if (!gpus[i].switch_links.empty()) t.nvswitches = std::max(t.nvswitches, 1);
  }
  for (const XmlNet& n : nets) t.nics.push_back(n.nic);

  std::vector<const Place*> places;
  for (const XmlGpu& g : gpus) places.push_back(&g.place);
  for (const XmlNet& n : nets) places.push_back(&n.place);
  const size_t count = places.size();
  t.links.assign(count, std::vector<Link>(count));
  for (size_t i = 0; i < count; ++i) {
    for (size_t j = 0; j < count; ++j) {
      if (i == j) {
        t.links[i][j].type = PathType::kSelf;
        continue;
      }
      // Ports of one NIC share a place; still distinct devices.
      PathType p = topology_internal::ClassifyPciPath(places[i]->path, places[j]->path,
                                                      places[i]->numa, places[j]->numa);
      t.links[i][j].type = p == PathType::kSelf ? PathType::kPix : p;
    }
  }
  // NVLink: direct links, then links through NVSwitch.
  for (size_t i = 0; i < gpus.size(); ++i) {
    for (const auto& [target, n] : gpus[i].nvlinks) {
      auto peer = gpu_by_bus.find(target);
      if (peer == gpu_by_bus.end() || n == 0) continue;
      Link& l = t.links[i][peer->second];
      l = {PathType::kNvLink, (l.type == PathType::kNvLink ? l.nvlinks : 0) + n};
    }
  }
  for (size_t i = 0; i < gpus.size(); ++i) {
    for (size_t j = 0; j < gpus.size(); ++j) {
      if (i == j || gpus[i].switch_links.empty() || gpus[j].switch_links.empty()) continue;
      int a = 0, b = 0;
      for (int n : gpus[i].switch_links) a += n;
      for (int n : gpus[j].switch_links) b += n;
      Link& l = t.links[i][j];
      int nv = std::min(a, b);
      if (nv > 0 && (l.type != PathType::kNvLink || l.nvlinks < nv)) l = {PathType::kNvLink, nv};
    }
  }
  t.notes.push_back("read from NCCL topology XML: NIC link layers guessed from device names");
  return t;
}

}  // namespace strata
