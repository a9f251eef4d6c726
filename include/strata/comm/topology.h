// Topology: what the machine a rank runs on looks like to NCCL: its GPUs,
// how each pair of devices is connected (NVLink, or which PCIe path), its
// network adapters (InfiniBand, RoCE, AWS EFA, plain Ethernet) with their NUMA
// nodes, and whether GPUDirect RDMA can work.
//
// Three inputs give the same Topology:
//   - the machine itself: sysfs for the PCIe tree, NUMA nodes and NICs, plus
//     NVML (libnvidia-ml, loaded with dlopen at run time, so the library runs
//     where no driver is installed) for GPU names and NVLink;
//   - the text of `nvidia-smi topo -m`, for a machine you cannot log in to;
//   - NCCL's topology XML (the NCCL_TOPO_FILE / NCCL_TOPO_DUMP_FILE format).
// Every reader takes its root (DetectOptions::sysfs_root), so a fixture tree
// can stand in for /sys in tests.
//
//   strata::DetectOptions options;            // reads /sys, tries NVML
//   absl::StatusOr<strata::Topology> topo = strata::DetectTopology(options);
//   if (!topo.ok()) return topo.status();     // names the file that failed
//   std::printf("%s", strata::RenderMatrix(*topo).c_str());
//
// Device-pair links use the symbols `nvidia-smi topo -m` prints (X, NV#, PIX,
// PXB, PHB, NODE, SYS); PathLegend() explains each one. Classify() names the
// kind of machine (single-node NVSwitch, multi-node InfiniBand, ...), which
// strata/comm/nccl_profile.h turns into NCCL settings.
//
// Thread-safety: Topology is a plain value. DetectTopology reads files and
// may load NVML; it is safe to call from several threads. Classify is pure.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "strata/base/export.h"

namespace strata {

// How two devices reach each other, closest first.
enum class PathType : uint8_t {
  kSelf,     // X: the device itself
  kNvLink,   // NV#: a bonded set of # NVLinks (direct or through NVSwitch)
  kPix,      // PIX: at most one PCIe switch between them
  kPxb,      // PXB: several PCIe switches, no host bridge
  kPhb,      // PHB: through a PCIe host bridge (the CPU's root complex)
  kNode,     // NODE: between host bridges of one NUMA node
  kSys,      // SYS: across NUMA nodes (the CPU-to-CPU interconnect)
  kUnknown,  // not known from the input
};

struct STRATA_EXPORT Link {
  PathType type = PathType::kUnknown;
  int nvlinks = 0;  // number of NVLinks when type == kNvLink
};

// "X", "NV18", "PIX", "PXB", "PHB", "NODE", "SYS" or "?".
STRATA_EXPORT std::string LinkSymbol(const Link& link);

// One line per symbol, in strata's words: {"NV#", "joined by # NVLinks ..."}.
struct STRATA_EXPORT LegendEntry {
  std::string symbol;
  std::string meaning;
};
STRATA_EXPORT std::vector<LegendEntry> PathLegend();

enum class NicKind : uint8_t {
  kInfiniBand,  // RDMA device whose port link layer is InfiniBand
  kRoce,        // RDMA device on Ethernet (RoCE)
  kEfa,         // AWS Elastic Fabric Adapter
  kRdma,        // RDMA device whose link layer is not known (nvidia-smi input)
  kEthernet,    // plain Ethernet (TCP only)
};

// "InfiniBand", "RoCE", "EFA", "RDMA", "Ethernet".
STRATA_EXPORT const char* NicKindName(NicKind kind);

struct STRATA_EXPORT Gpu {
  int index = 0;             // position in the GPU list (NVML / nvidia-smi order)
  std::string pci_bus_id;    // "0000:18:00.0", lower case; empty if not known
  std::string name;          // "NVIDIA H100 80GB HBM3", or "10de:2330" from sysfs
  int numa_node = -1;        // -1 when not known
  std::string cpu_affinity;  // "0-55,112-167", when known
};

struct STRATA_EXPORT Nic {
  std::string name;  // ibverbs device ("mlx5_0", "rdmap16s27") or netdev ("eth0")
  NicKind kind = NicKind::kEthernet;
  std::string pci_bus_id;            // empty if not known
  std::string driver;                // kernel driver of the PCI function: "mlx5_core", "ena", "gve"
  std::vector<std::string> netdevs;  // associated network interfaces
  int numa_node = -1;
  int port = 1;           // RDMA port used
  bool active = true;     // port state ACTIVE / operstate up
  double speed_gbps = 0;  // link rate, 0 when not known
  // RDMA only: GID table of the port, "RoCE v2", "IB/RoCE v1" or "" for an
  // unused entry, indexed by GID index.
  std::vector<std::string> gid_types;
  // RDMA only: the GID values ("0000:...:ffff:0a00:0001"), same indices.
  std::vector<std::string> gids;
};

// Whether GPUDirect RDMA (NIC reading/writing GPU memory) can work.
struct STRATA_EXPORT GpuDirectInfo {
  // A peer-memory kernel module is loaded: nvidia_peermem, nv_peer_mem or
  // efa_nv_peermem (named in `module`).
  bool peermem = false;
  std::string module;
  // The kernel is recent enough for DMA-BUF (5.12+); NCCL checks the driver
  // and NIC at run time (NCCL_DMABUF_ENABLE).
  bool dmabuf_kernel = false;
};

struct STRATA_EXPORT Topology {
  static constexpr int kVersion = 1;
  int version = kVersion;

  // Where this came from: "sysfs /sys + NVML", "nvidia-smi topo -m (file)".
  std::string source;
  std::vector<Gpu> gpus;
  std::vector<Nic> nics;
  // NVSwitch chips seen (PCI bridges of NVIDIA's, or NVLinks ending on one).
  int nvswitches = 0;
  // False when no input could show NVLink (sysfs alone without NVML).
  bool nvlink_known = false;
  int numa_nodes = 1;
  GpuDirectInfo gpudirect;
  // Square matrix over devices: GPUs first, then NICs (see DeviceLabel).
  std::vector<std::vector<Link>> links;
  // What could not be read and what was assumed, for the report.
  std::vector<std::string> notes;

  int num_devices() const { return static_cast<int>(gpus.size() + nics.size()); }
  // "GPU3" or "NIC1" for device i of `links`.
  std::string DeviceLabel(int i) const;
  // Link between devices a and b (indices into `links`).
  const Link& link(int a, int b) const { return links[a][b]; }
  // Link between GPU g and NIC n.
  const Link& gpu_nic(int g, int n) const { return links[g][gpus.size() + n]; }
};

struct STRATA_EXPORT DetectOptions {
  static constexpr int kVersion = 1;
  int version = kVersion;
  // Root of the sysfs tree; a fixture directory in tests.
  std::string sysfs_root = "/sys";
  // Load NVML for GPU names and NVLink. Off in tests of fixture trees.
  bool use_nvml = true;
  std::string nvml_library = "libnvidia-ml.so.1";
  // Text of `nvidia-smi topo -m` for the same machine; when set, its GPU-GPU
  // links (NVLink in particular) replace what sysfs alone can tell.
  std::string nvidia_smi_topo;
  // Kernel release for the DMA-BUF check; empty reads
  // <sysfs_root>/../proc/sys/kernel/osrelease, then /proc for the real root.
  std::string kernel_release;
};

// Reads the machine (or a fixture tree). Missing parts (no NVML, no
// InfiniBand class) are notes, not errors; an unreadable sysfs root is
// NotFound and a malformed file InvalidArgument, naming the path.
STRATA_EXPORT absl::StatusOr<Topology> DetectTopology(const DetectOptions& options = {});

// Parses `nvidia-smi topo -m` output (with or without its legend and ANSI
// escapes). InvalidArgument names the line and the token it could not read.
STRATA_EXPORT absl::StatusOr<Topology> ParseNvidiaSmiTopo(absl::string_view text);

// Parses NCCL's topology XML (<system><cpu><pci><gpu><nvlink/>...). Errors
// name the line of the malformed element.
STRATA_EXPORT absl::StatusOr<Topology> ParseNcclTopoXml(absl::string_view xml);

// Reads a whole file; NotFound / PermissionDenied / InvalidArgument (too
// large, > 16 MiB) naming the path.
STRATA_EXPORT absl::StatusOr<std::string> ReadTextFile(const std::string& path);

// The device matrix as `nvidia-smi topo -m` lays it out, followed by the
// legend in strata's words and the NIC list with NUMA nodes.
STRATA_EXPORT std::string RenderMatrix(const Topology& topology);

// ---- the class of a machine -----------------------------------------------
//
// What kind of machine a Topology describes, in the terms NCCL tuning cares
// about (strata/comm/nccl_profile.h turns a class into settings).

enum class TopologyClass : uint8_t {
  kSingleNodeNvSwitch,   // one node, every GPU pair on NVLink through NVSwitch
  kNvLinkPartial,        // one node, NVLink only within groups (bridged pairs)
  kPcieOnly,             // one node, GPUs talk over PCIe only
  kMultiNodeInfiniBand,  // nodes joined by InfiniBand
  kMultiNodeRoce,        // nodes joined by RDMA over Converged Ethernet
  kAwsEfa,               // nodes joined by AWS Elastic Fabric Adapter
  kTcpOnly,              // no RDMA network, and at most one GPU per node
};

// "single-node-nvswitch", "nvlink-partial", "pcie-only",
// "multi-node-infiniband", "multi-node-roce", "aws-efa", "tcp-only".
STRATA_EXPORT const char* TopologyClassName(TopologyClass cls);
// One sentence for the report.
STRATA_EXPORT const char* TopologyClassDescription(TopologyClass cls);

// Whether the job spans nodes. kAuto takes a machine with an active RDMA
// adapter as part of a multi-node job (that is what the adapter is for) and
// any other as a single node.
enum class JobScope : uint8_t { kAuto, kSingleNode, kMultiNode };

struct STRATA_EXPORT ClassifyOptions {
  static constexpr int kVersion = 1;
  int version = kVersion;
  JobScope scope = JobScope::kAuto;
};

struct STRATA_EXPORT Classification {
  TopologyClass cls = TopologyClass::kTcpOnly;
  // Inside a node: "nvswitch", "nvlink-partial", "pcie", "single-gpu", "no-gpu".
  std::string intra_node;
  // Between nodes: "infiniband", "roce", "efa", "tcp".
  std::string network;
  // Why this class, naming what was seen: "8 GPUs, all pairs NV18; 8 active
  // InfiniBand ports".
  std::string reason;
};

STRATA_EXPORT Classification Classify(const Topology& topology,
                                      const ClassifyOptions& options = {});

}  // namespace strata
