// ParseNvidiaSmiTopo: the matrix printed by `nvidia-smi topo -m`.
//
// The header row names the devices (GPU0.., NIC0.. or, from older drivers,
// the RDMA device names themselves) and then "CPU Affinity", "NUMA Affinity"
// and "GPU NUMA ID"; each device row gives one cell per device column, and
// GPU rows add the affinity columns. A "NIC Legend" maps NIC# to device names.
// Terminals get ANSI underline escapes in the header; they are stripped.
#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "comm/topology/text_util.h"
#include "strata/comm/topology.h"

namespace strata {
namespace {

// Bounds the matrix (devices^2 cells) for hostile input; real machines have
// a few dozen devices.
constexpr size_t kMaxDevices = 512;

std::vector<absl::string_view> Tokens(absl::string_view line) {
  return absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
}

bool IsAffinityHeader(absl::string_view token) {
  return token == "CPU" || token == "NUMA" || token == "Affinity" || token == "ID";
}

bool ParseCell(absl::string_view cell, Link* link) {
  if (cell == "X") {
    link->type = PathType::kSelf;
  } else if (absl::StartsWith(cell, "NV")) {
    int n = 0;
    if (!absl::SimpleAtoi(cell.substr(2), &n) || n <= 0 || n > 1024) return false;
    *link = {PathType::kNvLink, n};
  } else if (cell == "PIX") {
    link->type = PathType::kPix;
  } else if (cell == "PXB") {
    link->type = PathType::kPxb;
  } else if (cell == "PHB") {
    link->type = PathType::kPhb;
  } else if (cell == "NODE") {
    link->type = PathType::kNode;
  } else if (cell == "SYS" || cell == "SOC") {  // SOC: older drivers' name for SYS
    link->type = PathType::kSys;
  } else {
    return false;
  }
  return true;
}

bool IsGpuLabel(absl::string_view label) {
  int n;
  return absl::StartsWith(label, "GPU") && absl::SimpleAtoi(label.substr(3), &n);
}

}  // namespace

absl::StatusOr<Topology> ParseNvidiaSmiTopo(absl::string_view input) {
  std::string text = topology_internal::StripAnsi(input);
  std::vector<absl::string_view> lines = topology_internal::Lines(text);

  // Header: the first line whose first token is GPU0.
  size_t header = lines.size();
  for (size_t i = 0; i < lines.size(); ++i) {
    std::vector<absl::string_view> t = Tokens(lines[i]);
    if (!t.empty() && t[0] == "GPU0") {
      header = i;
      break;
    }
  }
  if (header == lines.size()) {
    return absl::InvalidArgumentError(
        "not `nvidia-smi topo -m` output: no header line starting with GPU0");
  }
  std::vector<std::string> labels;
  for (absl::string_view tok : Tokens(lines[header])) {
    if (IsAffinityHeader(tok)) break;
    labels.emplace_back(tok);
  }
  if (labels.size() > kMaxDevices) {
    return absl::InvalidArgumentError(absl::StrCat("header line ", header + 1, " names ",
                                                   labels.size(), " devices; at most ", kMaxDevices,
                                                   " are supported"));
  }
  std::map<std::string, size_t> column;
  for (size_t i = 0; i < labels.size(); ++i) {
    if (!column.emplace(labels[i], i).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("header line ", header + 1, " names device ", labels[i], " twice"));
    }
  }

  const size_t n = labels.size();
  Topology t;
  t.source = "nvidia-smi topo -m";
  t.nvlink_known = true;
  t.links.assign(n, std::vector<Link>(n));
  std::vector<bool> seen(n, false);
  std::vector<std::string> affinity(n), numa(n);
  std::map<std::string, std::string> nic_names;
  bool in_legend = false;
  for (size_t li = header + 1; li < lines.size(); ++li) {
    std::vector<absl::string_view> tok = Tokens(lines[li]);
    if (tok.empty()) continue;
    if (tok[0] == "Legend:" || tok[0] == "NIC") {
      in_legend = true;
      continue;
    }
    if (in_legend) {
      // "NIC0: mlx5_0"
      if (tok.size() == 2 && absl::EndsWith(tok[0], ":")) {
        nic_names[std::string(tok[0].substr(0, tok[0].size() - 1))] = std::string(tok[1]);
      }
      continue;
    }
    auto col = column.find(std::string(tok[0]));
    if (col == column.end()) {
      return absl::InvalidArgumentError(absl::StrCat("line ", li + 1, ": row label '", tok[0],
                                                     "' is not a device of the header"));
    }
    size_t row = col->second;
    if (seen[row]) {
      return absl::InvalidArgumentError(absl::StrCat("line ", li + 1, ": second row for ", tok[0]));
    }
    seen[row] = true;
    if (tok.size() < n + 1) {
      return absl::InvalidArgumentError(absl::StrCat("line ", li + 1, ": ", tok[0], " has ",
                                                     tok.size() - 1, " cells, expected ", n));
    }
    for (size_t c = 0; c < n; ++c) {
      if (!ParseCell(tok[c + 1], &t.links[row][c])) {
        return absl::InvalidArgumentError(
            absl::StrCat("line ", li + 1, ": cell '", tok[c + 1], "' (", tok[0], " to ", labels[c],
                         ") is not one of X, NV#, PIX, PXB, PHB, NODE, SYS"));
      }
    }
    if (t.links[row][row].type != PathType::kSelf) {
      return absl::InvalidArgumentError(absl::StrCat(
          "line ", li + 1, ": ", tok[0], " to itself is '", tok[row + 1], "', expected X"));
    }
    if (tok.size() > n + 1) affinity[row] = std::string(tok[n + 1]);
    if (tok.size() > n + 2) numa[row] = std::string(tok[n + 2]);
  }
  for (size_t i = 0; i < n; ++i) {
    if (!seen[i]) {
      return absl::InvalidArgumentError(
          absl::StrCat("device ", labels[i], " of the header has no row"));
    }
  }

  // GPUs keep their header order (GPU0, GPU1, ...); NICs follow.
  std::vector<size_t> order;
  for (size_t i = 0; i < n; ++i) {
    if (IsGpuLabel(labels[i])) order.push_back(i);
  }
  for (size_t i = 0; i < n; ++i) {
    if (!IsGpuLabel(labels[i])) order.push_back(i);
  }
  std::vector<std::vector<Link>> links(n, std::vector<Link>(n));
  for (size_t a = 0; a < n; ++a) {
    for (size_t b = 0; b < n; ++b) links[a][b] = t.links[order[a]][order[b]];
  }
  t.links = std::move(links);
  for (size_t k = 0; k < n; ++k) {
    size_t i = order[k];
    if (IsGpuLabel(labels[i])) {
      Gpu g;
      g.index = static_cast<int>(t.gpus.size());
      g.name = labels[i];
      if (affinity[i] != "N/A") g.cpu_affinity = affinity[i];
      int node;
      if (absl::SimpleAtoi(numa[i], &node)) g.numa_node = node;
      t.gpus.push_back(std::move(g));
    } else {
      Nic nic;
      auto name = nic_names.find(labels[i]);
      nic.name = name != nic_names.end() ? name->second : labels[i];
      nic.kind = NicKind::kRdma;  // the matrix does not say InfiniBand or RoCE
      t.nics.push_back(std::move(nic));
    }
  }
  // A NIC's NUMA node is that of a GPU it reaches without crossing sockets
  // through PCIe only (PIX/PXB/PHB); NODE/SYS say nothing certain.
  for (size_t ni = 0; ni < t.nics.size(); ++ni) {
    for (const Gpu& g : t.gpus) {
      PathType p = t.gpu_nic(g.index, static_cast<int>(ni)).type;
      if (g.numa_node >= 0 && (p == PathType::kPix || p == PathType::kPxb || p == PathType::kPhb)) {
        t.nics[ni].numa_node = g.numa_node;
        break;
      }
    }
  }
  int max_numa = -1;
  for (const Gpu& g : t.gpus) max_numa = std::max(max_numa, g.numa_node);
  t.numa_nodes = std::max(1, max_numa + 1);
  t.notes.push_back("read from nvidia-smi topo -m: NIC link layers (InfiniBand or RoCE) unknown");
  return t;
}

}  // namespace strata
