// DetectTopology: the machine from sysfs (PCIe tree, NUMA nodes, RDMA and
// Ethernet adapters, peer-memory modules), NVML (GPU names, NVLink) and,
// optionally, the text of `nvidia-smi topo -m`.
//
// Everything is read below DetectOptions::sysfs_root, so a fixture tree
// stands in for /sys: bus/pci/devices/<bdf> links into devices/pci..., and
// class/infiniband, class/net, devices/system/node and module as on Linux.
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <system_error>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "comm/topology/nvml.h"
#include "comm/topology/pci_path.h"
#include "comm/topology/text_util.h"
#include "strata/base/status.h"
#include "strata/comm/topology.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using topology_internal::ReadAttr;

constexpr unsigned kVendorNvidia = 0x10de;
constexpr unsigned kVendorAmazon = 0x1d0f;

struct PciDevice {
  std::string bdf;
  std::vector<std::string> path;  // components below <root>/devices: pci0000:00, 0000:00:01.0, ...
  unsigned cls = 0;               // 24-bit class code
  unsigned vendor = 0;
  unsigned device = 0;
  int numa = -1;
  std::string cpulist;
  std::string driver;
};

bool LooksLikeBdf(absl::string_view s) {
  // dddd:bb:dd.f
  return s.size() == 12 && s[4] == ':' && s[7] == ':' && s[10] == '.';
}

absl::Status ParseHexAttr(const std::string& file, unsigned* out) {
  std::string text;
  if (!ReadAttr(file, &text)) return absl::OkStatus();  // optional
  if (!absl::SimpleHexAtoi(text, out)) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed hexadecimal value '", text, "' in ", file));
  }
  return absl::OkStatus();
}

absl::Status ParseNumaAttr(const std::string& file, int* out) {
  std::string text;
  if (!ReadAttr(file, &text)) return absl::OkStatus();
  if (!absl::SimpleAtoi(text, out) || *out < -1) {
    return absl::InvalidArgumentError(absl::StrCat("malformed NUMA node '", text, "' in ", file));
  }
  return absl::OkStatus();
}

// Components of `dir` (resolved) below <root>/devices; empty if outside.
std::vector<std::string> DevicePath(const fs::path& root_devices, const fs::path& dir) {
  std::error_code ec;
  fs::path real = fs::canonical(dir, ec);
  if (ec) return {};
  std::vector<std::string> out;
  auto r = root_devices.begin();
  auto p = real.begin();
  for (; r != root_devices.end(); ++r, ++p) {
    if (p == real.end() || *r != *p) return {};
  }
  for (; p != real.end(); ++p) out.push_back(p->string());
  return out;
}

// The PCI function a sysfs device directory belongs to (virtio netdevs sit
// one level below theirs).
std::string OwningBdf(const std::vector<std::string>& path) {
  for (auto it = path.rbegin(); it != path.rend(); ++it) {
    if (LooksLikeBdf(*it)) return *it;
  }
  return "";
}

absl::StatusOr<std::map<std::string, PciDevice>> ReadPci(const fs::path& root,
                                                         std::vector<std::string>* notes) {
  std::map<std::string, PciDevice> out;
  fs::path bus = root / "bus/pci/devices";
  std::error_code ec;
  if (!fs::is_directory(bus, ec)) {
    notes->push_back(
        absl::StrCat("no PCI bus under ", root.string(), " (a container without /sys?)"));
    return out;
  }
  fs::path root_devices = fs::canonical(root / "devices", ec);
  for (const fs::directory_entry& e : fs::directory_iterator(bus, ec)) {
    PciDevice d;
    d.bdf = e.path().filename().string();
    fs::path dir = e.path();
    d.path = DevicePath(root_devices, dir);
    if (d.path.empty()) d.path = {d.bdf};
    STRATA_RETURN_IF_ERROR(ParseHexAttr((dir / "class").string(), &d.cls));
    STRATA_RETURN_IF_ERROR(ParseHexAttr((dir / "vendor").string(), &d.vendor));
    STRATA_RETURN_IF_ERROR(ParseHexAttr((dir / "device").string(), &d.device));
    STRATA_RETURN_IF_ERROR(ParseNumaAttr((dir / "numa_node").string(), &d.numa));
    ReadAttr((dir / "local_cpulist").string(), &d.cpulist);
    fs::path driver = fs::read_symlink(dir / "driver", ec);
    if (!ec) d.driver = driver.filename().string();
    ec.clear();
    out[d.bdf] = std::move(d);
  }
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot list ", bus.string(), ": ", ec.message()));
  }
  return out;
}

PathType PciPath(const PciDevice& a, const PciDevice& b) {
  if (a.bdf == b.bdf) return PathType::kSelf;
  return topology_internal::ClassifyPciPath(a.path, b.path, a.numa, b.numa);
}

double ParseRateGbps(absl::string_view rate) {
  // "400 Gb/sec (4X NDR)"
  double v = 0;
  absl::string_view num = rate.substr(0, rate.find(' '));
  if (!absl::SimpleAtod(num, &v)) return 0;
  return v;
}

void ReadRdmaNics(const fs::path& root, const std::map<std::string, PciDevice>& pci,
                  std::vector<Nic>* nics, std::vector<PciDevice>* nic_pci) {
  fs::path ib = root / "class/infiniband";
  std::error_code ec;
  if (!fs::is_directory(ib, ec)) return;
  fs::path root_devices = fs::canonical(root / "devices", ec);
  std::vector<fs::path> devs;
  for (const fs::directory_entry& e : fs::directory_iterator(ib, ec)) devs.push_back(e.path());
  std::sort(devs.begin(), devs.end());
  for (const fs::path& dev : devs) {
    Nic nic;
    nic.name = dev.filename().string();
    PciDevice d;
    std::vector<std::string> path = DevicePath(root_devices, dev / "device");
    d.bdf = OwningBdf(path);
    auto it = pci.find(d.bdf);
    if (it != pci.end()) {
      d = it->second;
    } else {
      d.path = path;
      ParseNumaAttr((dev / "device/numa_node").string(), &d.numa).IgnoreError();
      fs::path driver = fs::read_symlink(dev / "device/driver", ec);
      if (!ec) d.driver = driver.filename().string();
      ec.clear();
    }
    nic.pci_bus_id = d.bdf;
    nic.driver = d.driver;
    nic.numa_node = d.numa;
    // The first active port, else the first port.
    std::vector<fs::path> ports;
    for (const fs::directory_entry& e : fs::directory_iterator(dev / "ports", ec)) {
      ports.push_back(e.path());
    }
    ec.clear();
    std::sort(ports.begin(), ports.end());
    std::string link_layer;
    bool chosen = false;
    for (const fs::path& port : ports) {
      std::string state, rate, layer;
      ReadAttr((port / "state").string(), &state);
      bool active = absl::StrContains(state, "ACTIVE");
      if (chosen && !active) continue;
      topology_internal::ParseInt(port.filename().string(), &nic.port);
      nic.active = active;
      ReadAttr((port / "rate").string(), &rate);
      nic.speed_gbps = ParseRateGbps(rate);
      ReadAttr((port / "link_layer").string(), &layer);
      link_layer = layer;
      nic.gid_types.clear();
      nic.gids.clear();
      for (int g = 0; g < 256; ++g) {
        std::string type, gid;
        fs::path f = port / "gid_attrs/types" / std::to_string(g);
        if (!fs::exists(f, ec)) break;
        // Unused entries fail to read (EINVAL) or hold the zero GID.
        if (!ReadAttr(f.string(), &type)) type.clear();
        ReadAttr((port / "gids" / std::to_string(g)).string(), &gid);
        if (gid == "0000:0000:0000:0000:0000:0000:0000:0000") type.clear();
        nic.gid_types.push_back(type);
        nic.gids.push_back(gid);
      }
      chosen = true;
      if (active) break;
    }
    for (const fs::directory_entry& e : fs::directory_iterator(dev / "device/net", ec)) {
      nic.netdevs.push_back(e.path().filename().string());
    }
    ec.clear();
    std::sort(nic.netdevs.begin(), nic.netdevs.end());
    bool efa = d.driver == "efa" || (d.vendor == kVendorAmazon && (d.device & 0xfff0) == 0xefa0);
    if (efa) {
      nic.kind = NicKind::kEfa;
    } else if (link_layer == "InfiniBand") {
      nic.kind = NicKind::kInfiniBand;
    } else if (link_layer == "Ethernet") {
      nic.kind = NicKind::kRoce;
    } else {
      nic.kind = NicKind::kRdma;
    }
    nics->push_back(std::move(nic));
    nic_pci->push_back(std::move(d));
  }
}

void ReadEthernetNics(const fs::path& root, const std::map<std::string, PciDevice>& pci,
                      std::vector<Nic>* nics, std::vector<PciDevice>* nic_pci) {
  std::vector<std::string> owned;
  for (const Nic& n : *nics) owned.insert(owned.end(), n.netdevs.begin(), n.netdevs.end());
  fs::path net = root / "class/net";
  std::error_code ec;
  if (!fs::is_directory(net, ec)) return;
  fs::path root_devices = fs::canonical(root / "devices", ec);
  std::vector<fs::path> ifs;
  for (const fs::directory_entry& e : fs::directory_iterator(net, ec)) ifs.push_back(e.path());
  std::sort(ifs.begin(), ifs.end());
  for (const fs::path& dir : ifs) {
    std::string name = dir.filename().string();
    if (std::find(owned.begin(), owned.end(), name) != owned.end()) continue;
    if (!fs::exists(dir / "device", ec)) continue;  // virtual: lo, bridges, docker0
    std::vector<std::string> path = DevicePath(root_devices, dir / "device");
    std::string bdf = OwningBdf(path);
    PciDevice d;
    auto it = pci.find(bdf);
    if (it != pci.end()) {
      d = it->second;
    } else {
      d.bdf = bdf;
      d.path = path;
    }
    Nic nic;
    nic.name = name;
    nic.kind = NicKind::kEthernet;
    nic.netdevs = {name};
    nic.pci_bus_id = d.bdf;
    nic.driver = d.driver;
    nic.numa_node = d.numa;
    std::string speed, oper;
    int mbps = 0;
    if (ReadAttr((dir / "speed").string(), &speed) && absl::SimpleAtoi(speed, &mbps) && mbps > 0) {
      nic.speed_gbps = mbps / 1000.0;
    }
    if (ReadAttr((dir / "operstate").string(), &oper)) nic.active = oper == "up";
    nics->push_back(std::move(nic));
    nic_pci->push_back(std::move(d));
  }
}

int CountNumaNodes(const fs::path& root) {
  int n = 0;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(root / "devices/system/node", ec)) {
    std::string name = e.path().filename().string();
    int id;
    if (absl::StartsWith(name, "node") && absl::SimpleAtoi(name.substr(4), &id)) ++n;
  }
  return std::max(n, 1);
}

void ReadGpuDirect(const fs::path& root, const DetectOptions& options, Topology* t) {
  std::error_code ec;
  for (const char* module : {"nvidia_peermem", "nv_peer_mem", "efa_nv_peermem"}) {
    if (fs::is_directory(root / "module" / module, ec)) {
      t->gpudirect.peermem = true;
      t->gpudirect.module = module;
      break;
    }
  }
  std::string release = options.kernel_release;
  if (release.empty())
    ReadAttr((root.parent_path() / "proc/sys/kernel/osrelease").string(), &release);
  if (release.empty() && options.sysfs_root == "/sys") {
    ReadAttr("/proc/sys/kernel/osrelease", &release);
  }
  std::vector<std::string> parts = absl::StrSplit(release, absl::ByAnyChar(".-"));
  int major = 0, minor = 0;
  if (parts.size() >= 2 && absl::SimpleAtoi(parts[0], &major) &&
      absl::SimpleAtoi(parts[1], &minor)) {
    t->gpudirect.dmabuf_kernel = major > 5 || (major == 5 && minor >= 12);
  }
}

// Replaces GPU-GPU links with those of `nvidia-smi topo -m` text.
absl::Status MergeNvidiaSmi(const std::string& text, Topology* t) {
  STRATA_ASSIGN_OR_RETURN(Topology smi, ParseNvidiaSmiTopo(text));
  if (smi.gpus.size() != t->gpus.size()) {
    return absl::InvalidArgumentError(absl::StrCat("nvidia-smi topo -m lists ", smi.gpus.size(),
                                                   " GPUs but sysfs shows ", t->gpus.size()));
  }
  for (size_t i = 0; i < t->gpus.size(); ++i) {
    for (size_t j = 0; j < t->gpus.size(); ++j) t->links[i][j] = smi.links[i][j];
    if (t->gpus[i].cpu_affinity.empty()) t->gpus[i].cpu_affinity = smi.gpus[i].cpu_affinity;
  }
  t->nvlink_known = true;
  absl::StrAppend(&t->source, " + nvidia-smi topo -m");
  return absl::OkStatus();
}

// NVML's names and NVLinks for the GPUs sysfs found (matched by bus id).
void MergeNvml(const topology_internal::NvmlView& nvml, Topology* t) {
  absl::StrAppend(&t->source, " + NVML");
  t->nvlink_known = true;
  t->nvswitches = std::max(t->nvswitches, nvml.nvswitches);
  std::vector<int> at(nvml.gpus.size(), -1);  // NVML index -> our GPU index
  for (size_t a = 0; a < nvml.gpus.size(); ++a) {
    for (Gpu& g : t->gpus) {
      if (g.pci_bus_id == nvml.gpus[a].pci_bus_id) {
        g.name = nvml.gpus[a].name;
        at[a] = g.index;
      }
    }
  }
  for (size_t a = 0; a < nvml.gpus.size(); ++a) {
    for (size_t b = 0; b < nvml.gpus.size(); ++b) {
      const Link& l = nvml.gpu_links[a][b];
      if (at[a] >= 0 && at[b] >= 0 && l.type == PathType::kNvLink) t->links[at[a]][at[b]] = l;
    }
  }
}

// sysfs shows no GPU but NVML does (a container without the PCI tree): take
// NVML's GPUs and links; GPU-NIC paths stay unknown.
void AdoptNvmlGpus(const topology_internal::NvmlView& nvml, Topology* t) {
  const size_t g = nvml.gpus.size(), n = t->nics.size();
  std::vector<std::vector<Link>> links(g + n, std::vector<Link>(g + n));
  for (size_t i = 0; i < g; ++i) {
    for (size_t j = 0; j < g; ++j) links[i][j] = nvml.gpu_links[i][j];
  }
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < n; ++j) links[g + i][g + j] = t->links[i][j];
  }
  t->gpus = nvml.gpus;
  t->links = std::move(links);
  t->nvlink_known = true;
  t->nvswitches = std::max(t->nvswitches, nvml.nvswitches);
  absl::StrAppend(&t->source, " + NVML");
  t->notes.push_back("GPUs from NVML only: sysfs shows no NVIDIA PCI device (a container?)");
}

}  // namespace

absl::StatusOr<Topology> DetectTopology(const DetectOptions& options) {
  fs::path root(options.sysfs_root);
  std::error_code ec;
  if (!fs::is_directory(root, ec)) {
    return absl::NotFoundError(
        absl::StrCat("sysfs root ", options.sysfs_root, " does not exist or is not a directory"));
  }
  Topology t;
  t.source = absl::StrCat("sysfs ", options.sysfs_root);
  STRATA_ASSIGN_OR_RETURN(auto pci, ReadPci(root, &t.notes));

  std::vector<PciDevice> gpu_pci;
  for (const auto& [bdf, d] : pci) {
    if (d.vendor != kVendorNvidia) continue;
    unsigned base = d.cls >> 8;
    if (base == 0x0300 || base == 0x0302) gpu_pci.push_back(d);
    if (base == 0x0680) ++t.nvswitches;  // NVSwitch chips show up as bridges
  }
  for (size_t i = 0; i < gpu_pci.size(); ++i) {
    Gpu g;
    g.index = static_cast<int>(i);
    g.pci_bus_id = gpu_pci[i].bdf;
    g.name = absl::StrCat(absl::Hex(gpu_pci[i].vendor, absl::kZeroPad4), ":",
                          absl::Hex(gpu_pci[i].device, absl::kZeroPad4));
    g.numa_node = gpu_pci[i].numa;
    g.cpu_affinity = gpu_pci[i].cpulist;
    t.gpus.push_back(std::move(g));
  }

  std::vector<PciDevice> nic_pci;
  ReadRdmaNics(root, pci, &t.nics, &nic_pci);
  ReadEthernetNics(root, pci, &t.nics, &nic_pci);
  t.numa_nodes = CountNumaNodes(root);
  ReadGpuDirect(root, options, &t);

  std::vector<const PciDevice*> devs;
  for (const PciDevice& d : gpu_pci) devs.push_back(&d);
  for (const PciDevice& d : nic_pci) devs.push_back(&d);
  const size_t n = devs.size();
  t.links.assign(n, std::vector<Link>(n));
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < n; ++j) {
      bool known = !devs[i]->bdf.empty() && !devs[j]->bdf.empty();
      t.links[i][j].type =
          i == j ? PathType::kSelf : (known ? PciPath(*devs[i], *devs[j]) : PathType::kUnknown);
    }
  }

  if (options.use_nvml) {
    absl::StatusOr<topology_internal::NvmlView> nvml =
        topology_internal::ReadNvml(options.nvml_library);
    if (nvml.ok() && t.gpus.empty() && !nvml->gpus.empty()) {
      AdoptNvmlGpus(*nvml, &t);
    } else if (nvml.ok()) {
      MergeNvml(*nvml, &t);
    } else if (!t.gpus.empty()) {
      t.notes.push_back(absl::StrCat(nvml.status().message(), "; GPU names and NVLink unknown"));
    }
  }
  if (!options.nvidia_smi_topo.empty()) {
    STRATA_RETURN_IF_ERROR_CTX(MergeNvidiaSmi(options.nvidia_smi_topo, &t),
                               "merging nvidia-smi topo -m with sysfs");
  }
  if (!t.gpus.empty() && !t.nvlink_known) {
    t.notes.push_back(t.nvswitches > 0
                          ? absl::StrCat(t.nvswitches,
                                         " NVSwitch chips on PCIe: GPUs taken as NVLink all-to-all "
                                         "(NVML would confirm the links)")
                          : "NVLink not visible without NVML; GPU pairs show their PCIe path only");
  }
  if (t.gpus.empty()) t.notes.push_back("no NVIDIA GPU found on the PCI bus");
  return t;
}

}  // namespace strata
