// ParseNvidiaSmiTopo: the matrix printed by `nvidia-smi topo -m`.
//
// What current drivers print (columns separated by tabs):
//
//   \t<ESC>[4mGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID<ESC>[0m
//   GPU0\t X \tNV18\tPIX\t0-55,112-167\t0\t\tN/A
//   GPU1\tNV18\t X \tNODE\t0-55,112-167\t0\t\tN/A
//   NIC0\tPIX\tNODE\t X \t\t\t\t
//
//   Legend:
//     X    = Self
//     ...
//   NIC Legend:
//     NIC0: mlx5_bond_0
//
// The header row is underlined (ANSI SGR sequences) when nvidia-smi writes to
// a terminal. The affinity cells may be empty (Windows prints none), and an
// extra tab precedes GPU NUMA ID. Older drivers print fewer affinity columns
// (no GPU NUMA ID; before that no NUMA Affinity) and name NICs by their RDMA
// device (mlx5_0) instead of NIC#. Text copied out of a terminal may have its
// tabs turned into spaces and the escape sequences' ESC byte lost or shown
// as "^[" / "\e" / "\033" / U+241B, leaving "[4m" in the header; all of
// these are accepted.
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

// Removes what is left of SGR sequences ("ESC [ 4 m") once StripAnsi took
// the intact ones: the bracket part "[<digits and ;>m" with whatever stood
// for the ESC byte in front of it ("^[", "\e", "\033", "\x1b", U+241B) or
// nothing. Such text cannot occur in the matrix itself.
std::string StripSgrRemnants(absl::string_view text) {
  static constexpr absl::string_view kEscSpellings[] = {"^[",    "\\e",   "\\033",
                                                        "\\x1b", "\\x1B", "\xe2\x90\x9b"};
  std::string out;
  out.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    size_t start = i;
    for (absl::string_view esc : kEscSpellings) {
      if (absl::StartsWith(text.substr(i), esc) && i + esc.size() < text.size() &&
          text[i + esc.size()] == '[') {
        start = i + esc.size();
        break;
      }
    }
    if (text[start] == '[') {
      size_t j = start + 1;
      while (j < text.size() &&
             (absl::ascii_isdigit(static_cast<unsigned char>(text[j])) || text[j] == ';')) {
        ++j;
      }
      if (j < text.size() && text[j] == 'm') {
        i = j + 1;
        continue;
      }
    }
    out.push_back(text[i]);
    ++i;
  }
  return out;
}

// StripAnsi leaves an ESC that does not start a CSI sequence; character-set
// selections such as "ESC ( B" (what `tput sgr0` adds) are dropped here.
std::string StripOtherEscapes(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '\x1b') {
      out.push_back(text[i]);
      continue;
    }
    if (i + 1 < text.size() && (text[i + 1] == '(' || text[i + 1] == ')')) {
      i += 2;  // ESC ( B: the designator too
    } else {
      i += 1;  // a two-byte escape: ESC and its letter
    }
  }
  return out;
}

std::vector<absl::string_view> Words(absl::string_view line) {
  return absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
}

// One line as fields: split at tabs when it has any (empty fields kept, each
// trimmed: " X " is "X"), else at runs of spaces (a paste that lost its tabs).
struct Fields {
  std::vector<absl::string_view> f;
  bool tabs = false;
};

Fields SplitFields(absl::string_view line) {
  Fields out;
  if (line.find('\t') == absl::string_view::npos) {
    out.f = Words(line);
    return out;
  }
  out.tabs = true;
  for (absl::string_view f : absl::StrSplit(line, '\t')) {
    out.f.push_back(absl::StripAsciiWhitespace(f));
  }
  // The header starts with a tab (the label column is empty there).
  while (!out.f.empty() && out.f.front().empty()) out.f.erase(out.f.begin());
  return out;
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

bool IsCell(absl::string_view word) {
  Link unused;
  return ParseCell(word, &unused);
}

bool IsGpuLabel(absl::string_view label) {
  int n;
  return absl::StartsWith(label, "GPU") && absl::SimpleAtoi(label.substr(3), &n);
}

// The trailing columns of the header, in the order nvidia-smi prints them.
enum class Extra { kCpuAffinity, kNumaAffinity, kGpuNumaId };

// Reads the header's extra columns from its words after the device labels
// ("CPU Affinity NUMA Affinity GPU NUMA ID"); false on anything else.
bool ParseExtras(const std::vector<absl::string_view>& words, std::vector<Extra>* extras) {
  size_t i = 0;
  auto next_is = [&](std::initializer_list<absl::string_view> want) {
    if (i + want.size() > words.size()) return false;
    size_t k = i;
    for (absl::string_view w : want) {
      if (words[k++] != w) return false;
    }
    i = k;
    return true;
  };
  while (i < words.size()) {
    if (next_is({"CPU", "Affinity"})) {
      extras->push_back(Extra::kCpuAffinity);
    } else if (next_is({"NUMA", "Affinity"})) {
      extras->push_back(Extra::kNumaAffinity);
    } else if (next_is({"GPU", "NUMA", "ID"})) {
      extras->push_back(Extra::kGpuNumaId);
    } else {
      return false;
    }
  }
  return true;
}

struct Header {
  std::vector<std::string> labels;
  std::vector<Extra> extras;
};

// The header's words: device labels up to the first extra column.
absl::StatusOr<Header> ParseHeader(absl::string_view line, size_t line_no) {
  std::vector<absl::string_view> words = Words(line);
  Header h;
  size_t i = 0;
  for (; i < words.size(); ++i) {
    absl::string_view w = words[i];
    // "GPU" alone starts "GPU NUMA ID"; GPU# is a device.
    if (w == "CPU" || w == "NUMA" || w == "GPU") break;
    if (IsCell(w)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header line ", line_no, ": '", w,
          "' is a link symbol, not a device name (is this line a row of the matrix?)"));
    }
    h.labels.emplace_back(w);
  }
  std::vector<absl::string_view> rest(words.begin() + i, words.end());
  if (!ParseExtras(rest, &h.extras)) {
    std::string tail;
    for (absl::string_view w : rest) absl::StrAppend(&tail, tail.empty() ? "" : " ", w);
    return absl::InvalidArgumentError(
        absl::StrCat("header line ", line_no, ": after the devices, '", tail,
                     "' is not a list of CPU Affinity, NUMA Affinity, GPU NUMA ID"));
  }
  return h;
}

// Finds the header: the first line whose first word is GPU0 and whose
// second is not a link symbol (a GPU0 row has "X" or a link there).
absl::StatusOr<size_t> FindHeader(const std::vector<absl::string_view>& lines) {
  for (size_t i = 0; i < lines.size(); ++i) {
    std::vector<absl::string_view> w = Words(lines[i]);
    if (w.empty() || w[0] != "GPU0") continue;
    if (w.size() >= 2 && IsCell(w[1])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "line ", i + 1,
          " is the row of GPU0, but no header line naming the devices (GPU0 "
          "GPU1 ... CPU Affinity ...) comes before it; was the header lost or garbled when the "
          "output was copied?"));
    }
    return i;
  }
  return absl::InvalidArgumentError(
      "not `nvidia-smi topo -m` output: no header line starting with GPU0");
}

// The affinity values of a GPU row, from the fields after its cells.
struct Affinity {
  std::string cpu, numa;
};

Affinity ReadAffinity(const Fields& row, size_t cells, const std::vector<Extra>& extras) {
  Affinity a;
  std::vector<absl::string_view> tail(row.f.begin() + std::min(row.f.size(), 1 + cells),
                                      row.f.end());
  auto assign = [&a](Extra e, absl::string_view v) {
    if (e == Extra::kCpuAffinity) a.cpu = std::string(v);
    if (e == Extra::kNumaAffinity) a.numa = std::string(v);
  };
  if (row.tabs) {
    // One field per column in order, except that GPU NUMA ID comes after an
    // extra tab: it is the last non-empty field.
    size_t k = 0;
    for (Extra e : extras) {
      if (e == Extra::kGpuNumaId) break;
      if (k < tail.size()) assign(e, tail[k]);
      ++k;
    }
    return a;
  }
  // Spaces only: empty cells left no trace, so the words are the columns
  // only when there are as many as the header has.
  if (tail.size() == extras.size()) {
    for (size_t k = 0; k < extras.size(); ++k) assign(extras[k], tail[k]);
  }
  return a;
}

}  // namespace

absl::StatusOr<Topology> ParseNvidiaSmiTopo(absl::string_view input) {
  std::string text = StripSgrRemnants(StripOtherEscapes(topology_internal::StripAnsi(input)));
  std::vector<absl::string_view> lines = topology_internal::Lines(text);

  absl::StatusOr<size_t> found = FindHeader(lines);
  if (!found.ok()) return found.status();
  const size_t header = *found;
  absl::StatusOr<Header> parsed = ParseHeader(lines[header], header + 1);
  if (!parsed.ok()) return parsed.status();
  std::vector<std::string> labels = std::move(parsed->labels);
  const std::vector<Extra> extras = std::move(parsed->extras);
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
  std::vector<Affinity> affinity(n);
  std::map<std::string, std::string> nic_names;
  bool in_legend = false;
  for (size_t li = header + 1; li < lines.size(); ++li) {
    Fields row = SplitFields(lines[li]);
    if (row.f.empty()) continue;
    absl::string_view first = row.f[0];
    if (first == "Legend:" ||
        absl::StartsWith(absl::StripLeadingAsciiWhitespace(lines[li]), "NIC Legend")) {
      in_legend = true;
      continue;
    }
    if (in_legend) {
      // "NIC0: mlx5_0", "NIC4: mlx5_bond_0"
      std::vector<absl::string_view> w = Words(lines[li]);
      if (w.size() == 2 && absl::EndsWith(w[0], ":") &&
          column.count(std::string(w[0].substr(0, w[0].size() - 1)))) {
        nic_names[std::string(w[0].substr(0, w[0].size() - 1))] = std::string(w[1]);
      }
      continue;
    }
    auto col = column.find(std::string(first));
    if (col == column.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("line ", li + 1, ": row label '", first, "' is not a device of the header"));
    }
    size_t r = col->second;
    if (seen[r]) {
      return absl::InvalidArgumentError(absl::StrCat("line ", li + 1, ": second row for ", first));
    }
    seen[r] = true;
    if (row.f.size() < n + 1) {
      return absl::InvalidArgumentError(absl::StrCat("line ", li + 1, ": ", first, " has ",
                                                     row.f.size() - 1, " cells, expected ", n));
    }
    for (size_t c = 0; c < n; ++c) {
      if (!ParseCell(row.f[c + 1], &t.links[r][c])) {
        return absl::InvalidArgumentError(
            absl::StrCat("line ", li + 1, ": cell '", row.f[c + 1], "' (", first, " to ", labels[c],
                         ") is not one of X, NV#, PIX, PXB, PHB, NODE, SYS"));
      }
    }
    if (t.links[r][r].type != PathType::kSelf) {
      return absl::InvalidArgumentError(absl::StrCat(
          "line ", li + 1, ": ", first, " to itself is '", row.f[r + 1], "', expected X"));
    }
    affinity[r] = ReadAffinity(row, n, extras);
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
      if (!affinity[i].cpu.empty() && affinity[i].cpu != "N/A") g.cpu_affinity = affinity[i].cpu;
      int node;
      if (absl::SimpleAtoi(affinity[i].numa, &node) && node >= 0) g.numa_node = node;
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
