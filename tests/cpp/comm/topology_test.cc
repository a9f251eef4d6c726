// Topology readers on fixtures of six real machine types, each with its
// expected class and profile, plus the parsers' error cases.
#include "strata/comm/topology.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "comm/topology/pci_path.h"
#include "strata/comm/nccl_profile.h"

namespace strata {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

std::string Fixture(const std::string& machine) {
  return std::string(STRATA_TOPOLOGY_FIXTURES) + "/" + machine;
}

Topology Detect(const std::string& machine, bool with_smi = true) {
  DetectOptions o;
  o.sysfs_root = Fixture(machine) + "/sys";
  o.use_nvml = false;
  std::string smi = Fixture(machine) + "/nvidia-smi.txt";
  if (with_smi && fs::exists(smi)) o.nvidia_smi_topo = *ReadTextFile(smi);
  absl::StatusOr<Topology> t = DetectTopology(o);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *t : Topology();
}

const NcclProfileEntry* Entry(const NcclProfile& p, const std::string& name) {
  for (const NcclProfileEntry& e : p.entries) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

NcclProfile Profile(const Topology& t, NcclVersion v = {2, 28, 9},
                    JobScope scope = JobScope::kAuto) {
  ProfileOptions o;
  o.nccl_version = v;
  o.classify.scope = scope;
  return MakeNcclProfile(t, o);
}

TEST(TopologyFixtures, DgxH100NvSwitchWithEightInfiniBandNics) {
  Topology t = Detect("dgx_h100");
  ASSERT_EQ(t.gpus.size(), 8u);
  EXPECT_EQ(t.nvswitches, 4);
  EXPECT_EQ(t.gpus[0].pci_bus_id, "0000:18:00.0");
  EXPECT_EQ(t.gpus[0].numa_node, 0);
  EXPECT_EQ(t.gpus[7].numa_node, 1);
  EXPECT_EQ(t.gpus[0].cpu_affinity, "0-55,112-167");  // from nvidia-smi
  int ib = 0, roce = 0;
  for (const Nic& n : t.nics) {
    ib += n.kind == NicKind::kInfiniBand;
    roce += n.kind == NicKind::kRoce;
  }
  EXPECT_EQ(ib, 8);
  EXPECT_EQ(roce, 2);  // the storage NICs
  EXPECT_EQ(t.nics[0].name, "mlx5_0");
  EXPECT_EQ(t.nics[0].speed_gbps, 400);
  EXPECT_EQ(t.nics[0].driver, "mlx5_core");
  EXPECT_THAT(t.nics[0].netdevs, ElementsAre("ibp25s0"));
  // Each GPU shares a PCIe switch with its NIC; other NICs of the socket are
  // NODE, the far socket SYS.
  EXPECT_EQ(LinkSymbol(t.gpu_nic(0, 0)), "PIX");
  EXPECT_EQ(LinkSymbol(t.gpu_nic(0, 1)), "NODE");
  EXPECT_EQ(LinkSymbol(t.gpu_nic(0, 7)), "SYS");
  EXPECT_EQ(LinkSymbol(t.link(0, 5)), "NV18");
  EXPECT_TRUE(t.gpudirect.peermem);
  EXPECT_EQ(t.gpudirect.module, "nvidia_peermem");
  EXPECT_TRUE(t.gpudirect.dmabuf_kernel);  // 5.15

  NcclProfile p = Profile(t);
  EXPECT_EQ(p.classification.cls, TopologyClass::kMultiNodeInfiniBand);
  EXPECT_EQ(p.classification.intra_node, "nvswitch");
  const NcclProfileEntry* hca = Entry(p, "NCCL_IB_HCA");
  ASSERT_NE(hca, nullptr);
  EXPECT_EQ(hca->value, "=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7");
  EXPECT_THAT(hca->reason, HasSubstr("mlx5_8 (RoCE)"));
  ASSERT_TRUE(p.config.net_name.has_value());
  EXPECT_EQ(*p.config.net_name, "IB");
  // The same node used alone is the NVSwitch class, with nothing to set.
  NcclProfile single = Profile(t, {2, 28, 9}, JobScope::kSingleNode);
  EXPECT_EQ(single.classification.cls, TopologyClass::kSingleNodeNvSwitch);
  EXPECT_EQ(Entry(single, "NCCL_IB_HCA"), nullptr);
}

TEST(TopologyFixtures, PcieOnlyDualSocket) {
  Topology t = Detect("pcie_8gpu_dual_socket");
  ASSERT_EQ(t.gpus.size(), 8u);
  EXPECT_EQ(t.numa_nodes, 2);
  EXPECT_EQ(LinkSymbol(t.link(0, 1)), "PIX");   // same switch
  EXPECT_EQ(LinkSymbol(t.link(0, 2)), "NODE");  // other switch, same socket
  EXPECT_EQ(LinkSymbol(t.link(0, 4)), "SYS");   // other socket
  NcclProfile p = Profile(t);
  EXPECT_EQ(p.classification.cls, TopologyClass::kPcieOnly);
  for (const NcclProfileEntry& e : p.entries) EXPECT_NE(e.target, ProfileTarget::kEnv) << e.name;
  EXPECT_THAT(p.notes, testing::Contains(HasSubstr("NUMA 0: GPU 0,1,2,3; NUMA 1: GPU 4,5,6,7")));
}

TEST(TopologyFixtures, PcieOnlyFromSysfsAloneMatchesNvidiaSmi) {
  // Without NVML or nvidia-smi, the PCIe paths computed from sysfs are the
  // ones nvidia-smi prints for this machine.
  Topology sysfs = Detect("pcie_8gpu_dual_socket", /*with_smi=*/false);
  absl::StatusOr<Topology> smi =
      ParseNvidiaSmiTopo(*ReadTextFile(Fixture("pcie_8gpu_dual_socket") + "/nvidia-smi.txt"));
  ASSERT_TRUE(smi.ok()) << smi.status();
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 8; ++j) {
      EXPECT_EQ(LinkSymbol(sysfs.link(i, j)), LinkSymbol(smi->link(i, j))) << i << "," << j;
    }
  }
}

TEST(TopologyFixtures, NvLinkBridgedPairs) {
  Topology t = Detect("nvlink_pairs_4gpu");
  ASSERT_EQ(t.gpus.size(), 4u);
  EXPECT_EQ(LinkSymbol(t.link(0, 1)), "NV4");
  EXPECT_EQ(LinkSymbol(t.link(2, 3)), "NV4");
  EXPECT_EQ(LinkSymbol(t.link(1, 2)), "NODE");
  NcclProfile p = Profile(t);
  EXPECT_EQ(p.classification.cls, TopologyClass::kNvLinkPartial);
  EXPECT_THAT(p.notes, testing::Contains(HasSubstr("NVLink groups {0,1} {2,3}")));
  // Without the NVLink information the same machine looks PCIe-only, and
  // the report says why.
  Topology blind = Detect("nvlink_pairs_4gpu", /*with_smi=*/false);
  EXPECT_EQ(Profile(blind).classification.cls, TopologyClass::kPcieOnly);
  EXPECT_THAT(blind.notes, testing::Contains(HasSubstr("NVLink not visible without NVML")));
}

TEST(TopologyFixtures, RoceCluster) {
  Topology t = Detect("roce_cluster");
  ASSERT_EQ(t.nics.size(), 9u);  // 8 RoCE + management Ethernet
  const Nic& n = t.nics[0];
  EXPECT_EQ(n.kind, NicKind::kRoce);
  EXPECT_THAT(n.gid_types, ElementsAre("IB/RoCE v1", "RoCE v2", "IB/RoCE v1", "RoCE v2"));
  NcclProfile p = Profile(t, {2, 28, 9});
  EXPECT_EQ(p.classification.cls, TopologyClass::kMultiNodeRoce);
  EXPECT_EQ(Entry(p, "NCCL_IB_GID_INDEX"), nullptr);  // NCCL 2.21+ picks it
  EXPECT_EQ(Entry(p, "NCCL_IB_HCA"), nullptr);        // every RDMA port is compute
  EXPECT_EQ(*p.config.net_name, "IB");
  // Before 2.21 NCCL used GID 0 (RoCE v1, link-local): the profile names the
  // IPv4 RoCE v2 entry, index 3.
  NcclProfile old = Profile(t, {2, 18, 6});
  const NcclProfileEntry* gid = Entry(old, "NCCL_IB_GID_INDEX");
  ASSERT_NE(gid, nullptr);
  EXPECT_EQ(gid->value, "3");
}

TEST(TopologyFixtures, AwsEfa) {
  Topology t = Detect("aws_p4d");
  int efa = 0;
  for (const Nic& n : t.nics) efa += n.kind == NicKind::kEfa;
  EXPECT_EQ(efa, 4);
  EXPECT_EQ(t.gpudirect.module, "efa_nv_peermem");
  NcclProfile p = Profile(t);
  EXPECT_EQ(p.classification.cls, TopologyClass::kAwsEfa);
  EXPECT_EQ(*p.config.net_name, "AWS Libfabric");
  EXPECT_EQ(Entry(p, "NCCL_SOCKET_NTHREADS"), nullptr);
}

TEST(TopologyFixtures, TcpOnlyCloudVm) {
  Topology t = Detect("tcp_cloud_vm");
  ASSERT_EQ(t.gpus.size(), 1u);
  EXPECT_EQ(t.gpus[0].numa_node, -1);
  ASSERT_EQ(t.nics.size(), 1u);  // lo is virtual and skipped
  EXPECT_EQ(t.nics[0].name, "ens4");
  EXPECT_EQ(t.nics[0].driver, "gve");
  NcclProfile p = Profile(t);
  EXPECT_EQ(p.classification.cls, TopologyClass::kTcpOnly);
  EXPECT_TRUE(p.entries.empty() || p.entries[0].target == ProfileTarget::kConfig);
}

TEST(TopologyFixtures, FastTcpGetsSocketThreadsUnlessTheCloudDriverTunesItself) {
  Topology t;
  Nic eth;
  eth.name = "ens1f0";
  eth.speed_gbps = 100;
  eth.driver = "ice";
  t.nics.push_back(eth);
  t.links = {{Link{PathType::kSelf}}};
  NcclProfile p = Profile(t);
  ASSERT_NE(Entry(p, "NCCL_SOCKET_NTHREADS"), nullptr);
  EXPECT_EQ(Entry(p, "NCCL_NSOCKS_PERTHREAD")->value, "4");
  t.nics[0].driver = "ena";  // NCCL picks 2 x 8 on AWS by itself
  EXPECT_EQ(Entry(Profile(t), "NCCL_SOCKET_NTHREADS"), nullptr);
}

TEST(TopologyFixtures, UserValuesWinAndTheExportSaysSo) {
  Topology t = Detect("dgx_h100");
  EffectiveSettings user;
  user.settings.push_back({"NCCL_IB_HCA", "mlx5", SettingSource::kEnvironment, "environment"});
  ProfileOptions o;
  o.nccl_version = {2, 28, 9};
  o.user = &user;
  NcclProfile p = MakeNcclProfile(t, o);
  const NcclProfileEntry* hca = Entry(p, "NCCL_IB_HCA");
  ASSERT_NE(hca, nullptr);
  EXPECT_TRUE(hca->user_set);
  EXPECT_EQ(hca->user_value, "mlx5");
  std::string env = p.ExportEnv();
  EXPECT_THAT(env, HasSubstr("# NCCL_IB_HCA: you set 'mlx5'"));
  EXPECT_THAT(env, testing::Not(HasSubstr("export NCCL_IB_HCA")));
  std::string conf = p.ExportConf();
  EXPECT_THAT(conf, testing::Not(HasSubstr("\nNCCL_IB_HCA=")));
  // Without the user's value: a plain line, no quotes (NCCL keeps them).
  NcclProfile mine = Profile(t);
  EXPECT_THAT(mine.ExportConf(), HasSubstr("\nNCCL_IB_HCA==mlx5_0,"));
  EXPECT_THAT(mine.ExportEnv(), HasSubstr("export NCCL_IB_HCA='=mlx5_0,"));
}

TEST(PciPath, ClassesFollowTheTree) {
  using topology_internal::ClassifyPciPath;
  std::vector<std::string> gpu = {"pci0000:15", "0000:15:01.0", "0000:16:00.0", "0000:17:00.0",
                                  "0000:18:00.0"};
  std::vector<std::string> nic = {"pci0000:15", "0000:15:01.0", "0000:16:00.0", "0000:17:01.0",
                                  "0000:19:00.0"};
  std::vector<std::string> other_root_port = {"pci0000:15", "0000:15:02.0", "0000:20:00.0"};
  std::vector<std::string> other_bridge = {"pci0000:29", "0000:29:01.0", "0000:2a:00.0"};
  EXPECT_EQ(ClassifyPciPath(gpu, gpu, 0, 0), PathType::kSelf);
  EXPECT_EQ(ClassifyPciPath(gpu, nic, 0, 0), PathType::kPix);
  EXPECT_EQ(ClassifyPciPath(gpu, other_root_port, 0, 0), PathType::kPhb);
  EXPECT_EQ(ClassifyPciPath(gpu, other_bridge, 0, 0), PathType::kNode);
  EXPECT_EQ(ClassifyPciPath(gpu, other_bridge, 0, 1), PathType::kSys);
  EXPECT_EQ(ClassifyPciPath(gpu, other_bridge, -1, 1), PathType::kNode);  // unknown NUMA
  std::vector<std::string> deep = gpu;
  deep.insert(deep.end() - 1, "0000:30:00.0");
  EXPECT_EQ(ClassifyPciPath(deep, nic, 0, 0), PathType::kPxb);
}

TEST(NvidiaSmiParser, ReadsNicsLegendAnsiAndAffinity) {
  std::string text = *ReadTextFile(Fixture("dgx_h100") + "/nvidia-smi.txt");
  // Terminals get underline escapes in the header.
  text.insert(0, "\x1b[4m");
  text.insert(text.find('\n'), "\x1b[0m");
  absl::StatusOr<Topology> t = ParseNvidiaSmiTopo(text);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->gpus.size(), 8u);
  ASSERT_EQ(t->nics.size(), 8u);
  EXPECT_EQ(t->nics[3].name, "mlx5_3");
  EXPECT_EQ(t->nics[3].numa_node, 0);  // from the GPU it shares a switch with
  EXPECT_EQ(t->gpus[4].numa_node, 1);
  EXPECT_EQ(LinkSymbol(t->gpu_nic(4, 4)), "PIX");
  NcclProfile p = Profile(*t);
  // Link layers are unknown from the text; RDMA NICs are taken as InfiniBand.
  EXPECT_EQ(p.classification.cls, TopologyClass::kMultiNodeInfiniBand);
  EXPECT_THAT(p.classification.reason, HasSubstr("unknown link layer"));
}

TEST(NvidiaSmiParser, ErrorsNameTheLineAndToken) {
  auto err = [](absl::string_view text) {
    return std::string(ParseNvidiaSmiTopo(text).status().message());
  };
  EXPECT_THAT(err("hello\nworld\n"), HasSubstr("no header line starting with GPU0"));
  EXPECT_THAT(err("\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tNV4\t X \tjunk\nGPU2\tX\tX\n"),
              HasSubstr("line 4: row label 'GPU2' is not a device"));
  EXPECT_THAT(err("\tGPU0\tGPU1\nGPU0\t X \tQPI\nGPU1\tNV4\t X \n"),
              HasSubstr("line 2: cell 'QPI' (GPU0 to GPU1)"));
  EXPECT_THAT(err("\tGPU0\tGPU1\nGPU0\t X \nGPU1\tNV4\t X \n"),
              HasSubstr("GPU0 has 1 cells, expected 2"));
  EXPECT_THAT(err("\tGPU0\tGPU1\nGPU0\t X \tNV4\n"),
              HasSubstr("device GPU1 of the header has no row"));
  EXPECT_THAT(err("\tGPU0\nGPU0\tPIX\n"), HasSubstr("to itself is 'PIX', expected X"));
  EXPECT_THAT(err("\tGPU0\tGPU0\nGPU0\t X \t X \n"), HasSubstr("names device GPU0 twice"));
}

TEST(NcclXml, ReadsGpusNvLinkNicsAndPcieTree) {
  const char* xml = R"(<?xml version="1.0"?>
<!-- two sockets, NVLink pair 0-1 through NVSwitch, NICs per socket -->
<system version="1">
  <cpu numaid="0" affinity="0000ffff" arch="x86_64" vendor="GenuineIntel">
    <pci busid="0000:17:00.0" class="0x060400" vendor="0x1000" device="0xc030">
      <pci busid="0000:18:00.0" class="0x030200" vendor="0x10de" device="0x2330">
        <gpu dev="0" sm="90" rank="0" gdr="1">
          <nvlink target="fffffff:ffff:ff" count="18" tclass="0x068000"/>
        </gpu>
      </pci>
      <pci busid="0000:19:00.0" class="0x020700" vendor="0x15b3" device="0x1021">
        <nic><net name="mlx5_0" dev="0" speed="400000" port="1" gdr="1"/></nic>
      </pci>
    </pci>
  </cpu>
  <cpu numaid="1" affinity="ffff0000">
    <pci busid="0000:9a:00.0" class="0x030200" vendor="0x10de" device="0x2330">
      <gpu dev="1" sm="90"><nvlink target="fffffff:ffff:ff" count="18" tclass="0x068000"/></gpu>
    </pci>
    <nic><net name="eth0" dev="1" speed="25000" port="0"/></nic>
  </cpu>
</system>)";
  absl::StatusOr<Topology> t = ParseNcclTopoXml(xml);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->gpus.size(), 2u);
  ASSERT_EQ(t->nics.size(), 2u);
  EXPECT_EQ(LinkSymbol(t->link(0, 1)), "NV18");
  EXPECT_EQ(LinkSymbol(t->gpu_nic(0, 0)), "PIX");
  EXPECT_EQ(LinkSymbol(t->gpu_nic(1, 0)), "SYS");
  EXPECT_EQ(t->nics[0].speed_gbps, 400);
  EXPECT_EQ(t->nics[1].kind, NicKind::kEthernet);
  EXPECT_EQ(t->numa_nodes, 2);
  EXPECT_EQ(Profile(*t, {2, 28, 9}, JobScope::kSingleNode).classification.cls,
            TopologyClass::kSingleNodeNvSwitch);
}

TEST(NcclXml, MalformedInputNamesTheLine) {
  auto err = [](absl::string_view text) {
    return std::string(ParseNcclTopoXml(text).status().message());
  };
  EXPECT_THAT(err("<system><cpu numaid=\"0\"></system>"),
              HasSubstr("expected </cpu>, found </system"));
  EXPECT_THAT(err("<system>\n<cpu numaid=0/></system>"),
              HasSubstr("XML line 2: attribute numaid of <cpu> is not quoted"));
  EXPECT_THAT(err("<nothing/>"), HasSubstr("no <system> element"));
  EXPECT_THAT(err("<system><cpu/></system>"), HasSubstr("<cpu> has no numaid"));
  EXPECT_THAT(err("<system><cpu numaid=\"x\"/></system>"), HasSubstr("numaid='x' is not valid"));
  EXPECT_THAT(err("<system><!-- open"), HasSubstr("unterminated comment"));
  std::string deep;
  for (int i = 0; i < 100; ++i) deep += "<pci busid=\"0\">";
  EXPECT_THAT(err("<system>" + deep), HasSubstr("nested deeper than 64"));
}

TEST(DetectTopology, UnreadableAndMalformedSysfs) {
  DetectOptions o;
  o.use_nvml = false;
  o.sysfs_root = "/nonexistent/strata/sys";
  absl::StatusOr<Topology> t = DetectTopology(o);
  EXPECT_TRUE(absl::IsNotFound(t.status()));
  EXPECT_THAT(t.status().message(), HasSubstr("/nonexistent/strata/sys does not exist"));

  // A PCI class file with garbage in it.
  fs::path root = fs::path(testing::TempDir()) / ("strata_bad_sysfs_" + std::to_string(::getpid()));
  fs::remove_all(root);
  fs::create_directories(root / "devices/pci0000:00/0000:00:03.0");
  fs::create_directories(root / "bus/pci/devices");
  fs::create_directory_symlink("../../../devices/pci0000:00/0000:00:03.0",
                               root / "bus/pci/devices/0000:00:03.0");
  std::ofstream(root / "devices/pci0000:00/0000:00:03.0/class") << "not-hex\n";
  o.sysfs_root = root.string();
  t = DetectTopology(o);
  EXPECT_TRUE(absl::IsInvalidArgument(t.status()));
  EXPECT_THAT(t.status().message(), HasSubstr("malformed hexadecimal value 'not-hex'"));
  EXPECT_THAT(t.status().message(), HasSubstr("0000:00:03.0/class"));
  std::ofstream(root / "devices/pci0000:00/0000:00:03.0/class") << "0x030200\n";
  std::ofstream(root / "devices/pci0000:00/0000:00:03.0/numa_node") << "-7\n";
  t = DetectTopology(o);
  EXPECT_THAT(t.status().message(), HasSubstr("malformed NUMA node '-7'"));

  // An nvidia-smi text that disagrees with sysfs on the GPU count.
  o.sysfs_root = Fixture("tcp_cloud_vm") + "/sys";
  o.nvidia_smi_topo = *ReadTextFile(Fixture("nvlink_pairs_4gpu") + "/nvidia-smi.txt");
  t = DetectTopology(o);
  EXPECT_THAT(t.status().message(), HasSubstr("nvidia-smi topo -m lists 4 GPUs but sysfs shows 1"));
  fs::remove_all(root);
}

TEST(DetectTopology, NoNvmlLibraryIsANoteNotAnError) {
  DetectOptions o;
  o.sysfs_root = Fixture("tcp_cloud_vm") + "/sys";
  o.nvml_library = "libstrata-no-such-nvml.so";
  absl::StatusOr<Topology> t = DetectTopology(o);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT(t->notes,
              testing::Contains(HasSubstr("cannot load NVML (libstrata-no-such-nvml.so)")));
}

TEST(ReadTextFile, NamesThePath) {
  absl::StatusOr<std::string> r = ReadTextFile("/nonexistent/strata.txt");
  EXPECT_TRUE(absl::IsNotFound(r.status()));
  EXPECT_THAT(r.status().message(), HasSubstr("/nonexistent/strata.txt"));
  r = ReadTextFile(testing::TempDir());
  EXPECT_THAT(r.status().message(), HasSubstr("is a directory"));
}

TEST(RenderMatrix, ExplainsEverySymbol) {
  std::string m = RenderMatrix(Detect("dgx_h100"));
  for (const char* sym : {"NV#", "PIX", "PXB", "PHB", "NODE", "SYS"})
    EXPECT_THAT(m, HasSubstr(sym));
  EXPECT_THAT(m, HasSubstr("NIC0   mlx5_0 (ibp25s0): InfiniBand, 400 Gb/s, up, NUMA node 0"));
}

}  // namespace
}  // namespace strata
