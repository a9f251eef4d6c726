// ParseNvidiaSmiTopo on `nvidia-smi topo -m` text of several machines and
// driver generations (tests/fixtures/topology/nvidia_smi/), as nvidia-smi
// writes it to a terminal or a file, and as it arrives after a copy out of a
// terminal or a log viewer (escape bytes lost or spelled out, tabs turned
// into spaces, CRLF line ends, a prompt around it).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "strata/comm/topology.h"

namespace strata {
namespace {

using ::testing::HasSubstr;

std::string Fixture(const std::string& name) {
  absl::StatusOr<std::string> text =
      ReadTextFile(std::string(STRATA_TOPOLOGY_FIXTURES) + "/nvidia_smi/" + name);
  EXPECT_TRUE(text.ok()) << text.status();
  return text.ok() ? *text : std::string();
}

Topology Parse(const std::string& text) {
  absl::StatusOr<Topology> t = ParseNvidiaSmiTopo(text);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *t : Topology();
}

const std::vector<std::string> kFixtures = {"dgx_h100_550_terminal.txt", "a100_pcie_4gpu_535.txt",
                                            "workstation_2gpu_phb_560_terminal.txt",
                                            "dgx1_v100_450.txt", "gb200_nvl_570_terminal.txt"};

// Every field the parser fills, in one comparable string.
std::string Describe(const Topology& t) {
  std::string s;
  for (const Gpu& g : t.gpus) {
    s += g.name + " cpus=" + g.cpu_affinity + " numa=" + std::to_string(g.numa_node) + "\n";
  }
  for (const Nic& n : t.nics) s += n.name + " numa=" + std::to_string(n.numa_node) + "\n";
  for (const auto& row : t.links) {
    for (const Link& l : row) s += LinkSymbol(l) + " ";
    s += "\n";
  }
  return s;
}

// `expand`: tabs to spaces up to the next multiple of 8, as a terminal shows
// them (and as a copy out of it gives them).
std::string Expand(const std::string& text) {
  std::string out;
  size_t col = 0;
  for (char c : text) {
    if (c == '\t') {
      do {
        out.push_back(' ');
      } while (++col % 8 != 0);
    } else {
      out.push_back(c);
      col = c == '\n' ? 0 : col + 1;
    }
  }
  return out;
}

// The same text with its escape sequences as copies and logs deliver them.
std::vector<std::pair<std::string, std::string>> Variants(const std::string& raw) {
  return {
      {"escapes removed", absl::StrReplaceAll(raw, {{"\x1b[4m", ""}, {"\x1b[0m", ""}})},
      {"ESC byte lost", absl::StrReplaceAll(raw, {{"\x1b", ""}})},
      {"cat -v", absl::StrReplaceAll(raw, {{"\x1b", "^["}})},
      {"\\e spelled out", absl::StrReplaceAll(raw, {{"\x1b", "\\e"}})},
      {"\\033 spelled out", absl::StrReplaceAll(raw, {{"\x1b", "\\033"}})},
      {"U+241B for ESC", absl::StrReplaceAll(raw, {{"\x1b", "\xe2\x90\x9b"}})},
      {"bold instead of underline", absl::StrReplaceAll(raw, {{"\x1b[4m", "\x1b[1m"}})},
      {"tput sgr0 reset", absl::StrReplaceAll(raw, {{"\x1b[0m", "\x1b(B\x1b[m"}})},
      {"tabs expanded to spaces", Expand(raw)},
      {"ESC lost and tabs expanded", Expand(absl::StrReplaceAll(raw, {{"\x1b", ""}}))},
      {"CRLF", absl::StrReplaceAll(raw, {{"\n", "\r\n"}})},
      {"inside a shell session", "user@host:~$ nvidia-smi topo -m\n" + raw + "user@host:~$ \n"},
  };
}

TEST(NvidiaSmiFixtures, DgxH100WithBondedStorageNic) {
  Topology t = Parse(Fixture("dgx_h100_550_terminal.txt"));
  ASSERT_EQ(t.gpus.size(), 8u);
  ASSERT_EQ(t.nics.size(), 9u);
  EXPECT_EQ(t.nics[1].name, "mlx5_3");
  EXPECT_EQ(t.nics[8].name, "mlx5_bond_0");
  EXPECT_EQ(LinkSymbol(t.link(0, 7)), "NV18");
  EXPECT_EQ(LinkSymbol(t.gpu_nic(5, 5)), "PIX");
  EXPECT_EQ(LinkSymbol(t.gpu_nic(5, 8)), "SYS");
  EXPECT_EQ(t.gpus[5].cpu_affinity, "56-111,168-223");
  EXPECT_EQ(t.gpus[5].numa_node, 1);
  EXPECT_EQ(t.nics[5].numa_node, 1);   // PIX to GPU5
  EXPECT_EQ(t.nics[8].numa_node, -1);  // NODE to GPUs 0-3 says nothing certain
  EXPECT_EQ(t.numa_nodes, 2);
}

TEST(NvidiaSmiFixtures, A100PcieFourGpusOnTwoSockets) {
  Topology t = Parse(Fixture("a100_pcie_4gpu_535.txt"));
  ASSERT_EQ(t.gpus.size(), 4u);
  ASSERT_EQ(t.nics.size(), 2u);
  EXPECT_EQ(LinkSymbol(t.link(0, 1)), "NODE");
  EXPECT_EQ(LinkSymbol(t.link(1, 2)), "SYS");
  EXPECT_EQ(LinkSymbol(t.gpu_nic(2, 1)), "PXB");
  EXPECT_EQ(t.nics[1].name, "mlx5_1");
  EXPECT_EQ(t.nics[1].numa_node, 1);
  EXPECT_EQ(t.gpus[3].cpu_affinity, "32-63,96-127");
}

TEST(NvidiaSmiFixtures, WorkstationTwoGpusNoNics) {
  Topology t = Parse(Fixture("workstation_2gpu_phb_560_terminal.txt"));
  ASSERT_EQ(t.gpus.size(), 2u);
  EXPECT_TRUE(t.nics.empty());
  EXPECT_EQ(LinkSymbol(t.link(0, 1)), "PHB");
  EXPECT_EQ(t.gpus[1].cpu_affinity, "0-23");
  EXPECT_EQ(t.gpus[1].numa_node, 0);
}

TEST(NvidiaSmiFixtures, OlderDriverWithoutGpuNumaIdAndNicsNamedInTheHeader) {
  Topology t = Parse(Fixture("dgx1_v100_450.txt"));
  ASSERT_EQ(t.gpus.size(), 8u);
  ASSERT_EQ(t.nics.size(), 4u);
  EXPECT_EQ(t.nics[2].name, "mlx5_2");
  EXPECT_EQ(LinkSymbol(t.link(0, 3)), "NV2");
  EXPECT_EQ(LinkSymbol(t.link(0, 1)), "NV1");
  EXPECT_EQ(LinkSymbol(t.link(0, 5)), "SYS");
  EXPECT_EQ(t.gpus[6].cpu_affinity, "20-39,60-79");
  EXPECT_EQ(t.gpus[6].numa_node, 1);
  EXPECT_EQ(t.nics[3].numa_node, 1);
}

TEST(NvidiaSmiFixtures, Gb200TrayNumaAffinityIsTheCpuNodeNotTheGpuMemoryNode) {
  Topology t = Parse(Fixture("gb200_nvl_570_terminal.txt"));
  ASSERT_EQ(t.gpus.size(), 4u);
  ASSERT_EQ(t.nics.size(), 6u);
  EXPECT_EQ(LinkSymbol(t.link(1, 2)), "NV18");
  EXPECT_EQ(LinkSymbol(t.gpu_nic(2, 2)), "NODE");
  // GPU NUMA ID (the GPU's own memory node, 18 here) is not the CPU side.
  EXPECT_EQ(t.gpus[2].numa_node, 1);
  EXPECT_EQ(t.gpus[2].cpu_affinity, "72-143");
}

TEST(NvidiaSmiFixtures, TerminalFormattingAndCopiesReadTheSame) {
  for (const std::string& name : kFixtures) {
    const std::string raw = Fixture(name);
    const std::string reference = Describe(Parse(raw));
    ASSERT_FALSE(reference.empty()) << name;
    for (const auto& [how, text] : Variants(raw)) {
      absl::StatusOr<Topology> t = ParseNvidiaSmiTopo(text);
      ASSERT_TRUE(t.ok()) << name << ", " << how << ": " << t.status();
      EXPECT_EQ(Describe(*t), reference) << name << ", " << how;
    }
  }
}

TEST(NvidiaSmiParser, EmptyAffinityCellsAsWindowsPrintsThem) {
  // Driver 610 on Windows: no CPU or NUMA affinity, then the extra tab.
  Topology t = Parse(
      "\t\x1b[4mGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
      "GPU0\t X \t\t\t\tN/A\n\nLegend:\n\n  X    = Self\n");
  ASSERT_EQ(t.gpus.size(), 1u);
  EXPECT_EQ(t.gpus[0].cpu_affinity, "");
  EXPECT_EQ(t.gpus[0].numa_node, -1);
}

TEST(NvidiaSmiParser, AHeaderLostInTheCopyIsNamed) {
  std::string raw = Fixture("a100_pcie_4gpu_535.txt");
  std::string headless = raw.substr(raw.find('\n') + 1);
  absl::StatusOr<Topology> t = ParseNvidiaSmiTopo(headless);
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(),
              HasSubstr("line 1 is the row of GPU0, but no header line naming the devices"));
  t = ParseNvidiaSmiTopo("\tGPU0\tGPU1\tCPU Affinity\tNUMA Afinity\nGPU0\t X \tPIX\t0-3\t0\n");
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(),
              HasSubstr("header line 1: after the devices, 'CPU Affinity NUMA Afinity' is not"));
}

}  // namespace
}  // namespace strata
