// MakeNcclProfile: what NCCL should be told on a machine of a given class,
// each value with its reason; user-set values are kept (see nccl_profile.h).
#include "strata/comm/nccl_profile.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"

namespace strata {
namespace {

// NCCL lets these environment variables override the ncclConfig_t field
// (NCCL docs for NCCL_NET, NCCL_COMM_BLOCKING, NCCL_CGA_CLUSTER_SIZE,
// NCCL_MIN_CTAS, NCCL_MAX_CTAS; src/init.cc).
const std::map<std::string, std::string>& ConfigOverrides() {
  static const auto* m = new std::map<std::string, std::string>{
      {"netName", "NCCL_NET"},
      {"blocking", "NCCL_COMM_BLOCKING"},
      {"cgaClusterSize", "NCCL_CGA_CLUSTER_SIZE"},
      {"minCTAs", "NCCL_MIN_CTAS"},
      {"maxCTAs", "NCCL_MAX_CTAS"},
      {"splitShare", "NCCL_COMM_SPLIT_SHARE_RESOURCES"},
  };
  return *m;
}

class Builder {
 public:
  Builder(const ProfileOptions& options, NcclProfile* p) : options_(options), p_(p) {}

  void Env(const std::string& name, const std::string& value, std::string reason) {
    Add(ProfileTarget::kEnv, name, name, value, std::move(reason));
  }
  void Config(const std::string& field, const std::string& value, std::string reason) {
    auto env = ConfigOverrides().find(field);
    Add(ProfileTarget::kConfig, field, env == ConfigOverrides().end() ? "" : env->second, value,
        std::move(reason));
  }
  void Note(std::string note) { p_->notes.push_back(std::move(note)); }

 private:
  void Add(ProfileTarget target, const std::string& name, const std::string& env_name,
           const std::string& value, std::string reason) {
    NcclProfileEntry e;
    e.target = target;
    e.name = name;
    e.value = value;
    e.reason = std::move(reason);
    if (options_.user != nullptr && !env_name.empty()) {
      if (const Setting* s = options_.user->Find(env_name)) {
        e.user_set = true;
        e.user_value = s->value;
        e.user_origin = absl::StrCat(env_name, " in ", s->origin);
      }
    }
    p_->entries.push_back(std::move(e));
  }

  const ProfileOptions& options_;
  NcclProfile* p_;
};

std::string NicList(const std::vector<const Nic*>& nics) {
  return absl::StrJoin(nics, ",", [](std::string* out, const Nic* n) { out->append(n->name); });
}

void RdmaDevices(const Topology& t, NicKind kind, Builder* b) {
  std::vector<const Nic*> use, skip;
  for (const Nic& n : t.nics) {
    if (n.kind == NicKind::kEthernet) continue;
    (n.kind == kind && n.active ? use : skip).push_back(&n);
  }
  if (use.empty() || skip.empty()) return;  // NCCL's default (all devices) is right
  std::vector<std::string> why;
  for (const Nic* n : skip) {
    why.push_back(absl::StrCat(n->name, " (", n->active ? NicKindName(n->kind) : "port down", ")"));
  }
  b->Env("NCCL_IB_HCA", absl::StrCat("=", NicList(use)),
         absl::StrCat("use the ", use.size(), " active ", NicKindName(kind),
                      " device(s) and leave out ", absl::StrJoin(why, ", "),
                      "; '=' makes the names exact (mlx5_1 would also match mlx5_10)"));
}

void RoceGid(const Topology& t, const NcclVersion& v, Builder* b) {
  if (v >= NcclVersion{2, 21, 0}) {
    b->Note(
        "RoCE: NCCL 2.21+ picks a RoCE v2 GID by itself (NCCL_IB_ROCE_VERSION_NUM, "
        "NCCL_IB_ADDR_FAMILY), so NCCL_IB_GID_INDEX stays unset");
    return;
  }
  // Before 2.21 NCCL used GID index 0 unless told otherwise.
  std::set<int> v2;
  int ports = 0;
  for (const Nic& n : t.nics) {
    if (n.kind != NicKind::kRoce || !n.active) continue;
    ++ports;
    // NCCL 2.21's own choice: a RoCE v2 GID holding an IPv4 address
    // (IPv4-mapped, ::ffff:a.b.c.d), the default NCCL_IB_ADDR_FAMILY.
    for (size_t i = 0; i < n.gid_types.size() && i < n.gids.size(); ++i) {
      if (n.gid_types[i] == "RoCE v2" &&
          n.gids[i].rfind("0000:0000:0000:0000:0000:ffff:", 0) == 0) {
        v2.insert(static_cast<int>(i));
        break;
      }
    }
  }
  if (ports > 0 && v2.size() == 1) {
    b->Env("NCCL_IB_GID_INDEX", absl::StrCat(*v2.begin()),
           absl::StrCat("NCCL ", v.ToString(),
                        " uses GID 0 unless told (0 is RoCE v1, not "
                        "routable over IP); index ",
                        *v2.begin(),
                        " is the IPv4 RoCE v2 GID on every RoCE port (the one NCCL "
                        "2.21+ would pick)"));
  } else if (ports > 0) {
    b->Note(
        "RoCE: could not find one RoCE v2 GID index shared by every port; set "
        "NCCL_IB_GID_INDEX by hand (show_gids) or use NCCL 2.21+");
  }
}

void IntraNodeNotes(const Topology& t, const Classification& c, Builder* b) {
  const int n = static_cast<int>(t.gpus.size());
  if (c.intra_node == "nvlink-partial") {
    // NVLink groups: connected components over NVLink edges.
    std::vector<int> group(n, -1);
    std::vector<std::string> groups;
    for (int i = 0; i < n; ++i) {
      if (group[i] >= 0) continue;
      std::vector<int> members{i}, stack{i};
      group[i] = i;
      while (!stack.empty()) {
        int a = stack.back();
        stack.pop_back();
        for (int j = 0; j < n; ++j) {
          if (group[j] < 0 && t.link(a, j).type == PathType::kNvLink) {
            group[j] = i;
            members.push_back(j);
            stack.push_back(j);
          }
        }
      }
      std::sort(members.begin(), members.end());
      groups.push_back(absl::StrCat("{", absl::StrJoin(members, ","), "}"));
    }
    b->Note(absl::StrCat("NVLink groups ", absl::StrJoin(groups, " "),
                         ": place tensor-parallel groups inside them (the mesh's ranks_per_node "
                         "check and order string decide the mapping)"));
  } else if (c.intra_node == "pcie" && t.numa_nodes > 1) {
    std::map<int, std::vector<int>> by_numa;
    for (const Gpu& g : t.gpus) by_numa[g.numa_node].push_back(g.index);
    std::vector<std::string> parts;
    for (const auto& [node, gpus] : by_numa) {
      parts.push_back(absl::StrCat("NUMA ", node, ": GPU ", absl::StrJoin(gpus, ",")));
    }
    b->Note(absl::StrCat(absl::StrJoin(parts, "; "),
                         ". Pairs across sockets are SYS: NCCL routes them through host memory; "
                         "keep tensor-parallel groups within one socket"));
  } else if (c.intra_node == "nvswitch") {
    b->Note(
        "NVSwitch node: NCCL's defaults fit (NVLink SHARP is used where the switches "
        "support it); nothing to set inside the node");
  }
}

std::string ShellQuote(const std::string& v) {
  if (!v.empty() && v.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                        "0123456789_-.,:/+@") == std::string::npos) {
    return v;
  }
  return absl::StrCat("'", absl::StrReplaceAll(v, {{"'", "'\\''"}}), "'");
}

}  // namespace

NcclProfile MakeNcclProfile(const Topology& t, const ProfileOptions& options) {
  NcclProfile p;
  p.nccl_version = options.nccl_version;
  p.classification = Classify(t, options.classify);
  Builder b(options, &p);
  const Classification& c = p.classification;

  switch (c.cls) {
    case TopologyClass::kMultiNodeInfiniBand:
    case TopologyClass::kMultiNodeRoce: {
      bool roce = c.cls == TopologyClass::kMultiNodeRoce;
      RdmaDevices(t, roce ? NicKind::kRoce : NicKind::kInfiniBand, &b);
      if (roce) RoceGid(t, options.nccl_version, &b);
      b.Config("netName", "IB",
               "an RDMA class: fail at init if the verbs stack is broken instead of falling back "
               "to TCP sockets without a word");
      if (roce) {
        b.Note(
            "RoCE: if the switches run lossless traffic on a priority class, set NCCL_IB_TC "
            "(and NCCL_IB_FIFO_TC) to it; that is site configuration strata cannot see");
      }
      break;
    }
    case TopologyClass::kAwsEfa:
      b.Config("netName", "AWS Libfabric",
               "the aws-ofi-nccl plugin's network: fail at init if the plugin is missing instead "
               "of falling back to TCP sockets");
      b.Note(
          "EFA needs the aws-ofi-nccl plugin (libnccl-net.so); libfabric settings (FI_*) "
          "belong to the plugin's documentation for its version");
      break;
    case TopologyClass::kTcpOnly: {
      double fastest = 0;
      bool cloud_nic = false;
      for (const Nic& n : t.nics) {
        if (n.kind != NicKind::kEthernet || !n.active) continue;
        fastest = std::max(fastest, n.speed_gbps);
        // NCCL picks more socket threads by itself on AWS ENA and Google gVNIC.
        cloud_nic |= n.driver == "ena" || n.driver == "gve";
      }
      if (fastest >= 100 && !cloud_nic) {
        b.Env("NCCL_SOCKET_NTHREADS", "4",
              absl::StrCat("a ", fastest,
                           " Gb/s link needs several socket threads; NCCL's docs "
                           "suggest 4 for 100 Gb/s networks (default 1)"));
        b.Env("NCCL_NSOCKS_PERTHREAD", "4",
              "4 sockets per thread (4 x 4 = 16 <= NCCL's limit of 64), as NCCL's docs suggest "
              "for 100 Gb/s");
      }
      if (t.gpus.empty()) {
        b.Note("no GPU on this machine: NCCL cannot run here; CPU ranks use the MPI backend");
      }
      b.Note(
          "TCP only: no RDMA adapter, so NCCL (if used) falls back to sockets; expect a "
          "fraction of an RDMA fabric's bandwidth");
      break;
    }
    case TopologyClass::kSingleNodeNvSwitch:
    case TopologyClass::kNvLinkPartial:
    case TopologyClass::kPcieOnly:
      break;
  }
  IntraNodeNotes(t, c, &b);
  bool rdma_class = c.cls == TopologyClass::kMultiNodeInfiniBand ||
                    c.cls == TopologyClass::kMultiNodeRoce || c.cls == TopologyClass::kAwsEfa;
  if (rdma_class && !t.gpus.empty() && !t.gpudirect.peermem && !t.gpudirect.dmabuf_kernel) {
    b.Note(
        "no GPUDirect RDMA path found (no nvidia_peermem-style module, kernel older than "
        "5.12 or unknown): NCCL stages network traffic through host memory");
  }
  if (!options.comm_name.empty()) {
    b.Config("commName", options.comm_name, "names the communicator in NCCL's logs and RAS output");
  }
  if (options.nonblocking) {
    b.Config("blocking", "0",
             "strata waits on NCCL with deadlines and aborts hung communicators, which needs "
             "nonblocking init and calls");
  }

  for (const NcclProfileEntry& e : p.entries) {
    if (e.target != ProfileTarget::kConfig || e.user_set) continue;
    if (e.name == "netName") p.config.net_name = e.value;
    if (e.name == "commName") p.config.comm_name = e.value;
    if (e.name == "blocking") p.config.blocking = std::stoi(e.value);
  }
  return p;
}

std::string NcclProfile::ExportEnv() const {
  std::string out =
      absl::StrCat("# strata NCCL profile: ", TopologyClassName(classification.cls), " (NCCL ",
                   nccl_version.ToString(), ")\n# ", classification.reason, "\n");
  bool any = false;
  for (const NcclProfileEntry& e : entries) {
    if (e.target != ProfileTarget::kEnv) continue;
    any = true;
    if (e.user_set) {
      absl::StrAppend(&out, "# ", e.name, ": you set '", e.user_value, "' (", e.user_origin,
                      "), kept; the profile would set '", e.value, "': ", e.reason, "\n");
    } else {
      absl::StrAppend(&out, "# ", e.reason, "\nexport ", e.name, "=", ShellQuote(e.value), "\n");
    }
  }
  if (!any) absl::StrAppend(&out, "# nothing to set: NCCL's defaults fit this machine\n");
  for (const NcclProfileEntry& e : entries) {
    if (e.target != ProfileTarget::kConfig) continue;
    absl::StrAppend(&out,
                    "# per communicator (ncclConfig_t, set by strata's NCCL backend): ", e.name,
                    " = ", e.value, " -- ", e.reason,
                    e.user_set ? absl::StrCat(" [overridden by ", e.user_origin, "]") : "", "\n");
  }
  for (const std::string& n : notes) absl::StrAppend(&out, "# note: ", n, "\n");
  return out;
}

std::string NcclProfile::ExportConf() const {
  std::string out =
      absl::StrCat("# strata NCCL profile: ", TopologyClassName(classification.cls), " (NCCL ",
                   nccl_version.ToString(), ")\n# ", classification.reason, "\n");
  for (const NcclProfileEntry& e : entries) {
    if (e.target != ProfileTarget::kEnv) continue;
    if (e.user_set) {
      absl::StrAppend(&out, "# ", e.name, ": you set '", e.user_value, "' (", e.user_origin,
                      "), kept; the profile would set '", e.value, "'\n");
    } else {
      // NCCL keeps quotes and spaces literally: the value goes in bare.
      absl::StrAppend(&out, "# ", e.reason, "\n", e.name, "=", e.value, "\n");
    }
  }
  for (const NcclProfileEntry& e : entries) {
    if (e.target != ProfileTarget::kConfig) continue;
    absl::StrAppend(&out, "# per communicator, not settable here: ", e.name, " = ", e.value, "\n");
  }
  for (const std::string& n : notes) absl::StrAppend(&out, "# note: ", n, "\n");
  return out;
}

}  // namespace strata
