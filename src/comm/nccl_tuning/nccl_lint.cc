// The NCCL lint: names (unknown, removed, too new, deprecated, another
// tool's), configuration-file syntax as NCCL reads it, precedence, and
// contradictions with the machine. Value checks are in nccl_lint_values.cc.
#include "strata/comm/nccl_lint.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "comm/nccl_tuning/nccl_lint_internal.h"

namespace strata {
namespace nccl_tuning_internal {

void LintContext::Add(Severity severity, const Setting& s, std::string rule, std::string message,
                      std::string fix) const {
  Finding f;
  f.severity = severity;
  f.rule = std::move(rule);
  f.name = s.name;
  f.value = s.value;
  f.origin = s.origin;
  f.message = std::move(message);
  f.fix = std::move(fix);
  out->push_back(std::move(f));
}

const Setting* LintContext::Find(absl::string_view name) const {
  auto it = index.find(std::string(name));
  return it == index.end() ? nullptr : it->second;
}

int64_t LintContext::IntOr(const char* name, int64_t fallback) const {
  const Setting* s = Find(name);
  if (s == nullptr) return fallback;
  NcclIntParse p = ParseLikeStrtoll(s->value);
  return p.digits && !p.overflow ? p.value : fallback;
}

}  // namespace nccl_tuning_internal

namespace {

using nccl_tuning_internal::LintContext;

std::string Ver(int code) { return NcclVersion::FromCode(code).ToString(); }

// Variables PyTorch's ProcessGroupNCCL reads under an NCCL_ name, as old
// aliases of its TORCH_NCCL_ ones (torch 2.x, ProcessGroupNCCL.hpp).
const std::map<std::string, std::string>& PyTorchAliases() {
  static const auto* m = new std::map<std::string, std::string>{
      {"NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ASYNC_ERROR_HANDLING"},
      {"NCCL_BLOCKING_WAIT", "TORCH_NCCL_BLOCKING_WAIT"},
      {"NCCL_DESYNC_DEBUG", "TORCH_NCCL_DESYNC_DEBUG"},
      {"NCCL_ENABLE_TIMING", "TORCH_NCCL_ENABLE_TIMING"},
      {"NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK", "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"},
  };
  return *m;
}

// Names that circulate in guides but never existed in NCCL, with what the
// author probably wanted.
const std::map<std::string, std::string>& Myths() {
  static const auto* m = new std::map<std::string, std::string>{
      {"NCCL_SOCKET_TIMEOUT",
       "socket connection retries are NCCL_SOCKET_RETRY_CNT and NCCL_SOCKET_RETRY_SLEEP_MSEC "
       "(2.24+); the timeout of a collective belongs to the framework (torch.distributed's "
       "timeout=, strata's CommOptions::timeout)"},
      {"NCCL_BUFFERS_PER_CHANNEL",
       "the buffer size per connection is NCCL_BUFFSIZE (bytes); the number of buffers is fixed"},
      {"NCCL_TIMEOUT",
       "NCCL has no collective timeout; set it in the framework (torch.distributed's timeout=, "
       "strata's CommOptions::timeout)"},
  };
  return *m;
}

bool IsTrue(const LintContext& ctx, const char* name) { return ctx.IntOr(name, 0) != 0; }

// Every active RDMA port is InfiniBand (RoCE settings do not apply).
bool PureInfiniBand(const Topology* t) {
  if (t == nullptr) return false;
  int ib = 0, other = 0;
  for (const Nic& n : t->nics) {
    if (!n.active || n.kind == NicKind::kEthernet) continue;
    (n.kind == NicKind::kInfiniBand ? ib : other)++;
  }
  return ib > 0 && other == 0;
}

void CheckName(const LintContext& ctx, const Setting& s) {
  const NcclVersion& v = ctx.options.nccl_version;
  if (!absl::StartsWith(s.name, "NCCL_")) {
    if (absl::StartsWith(s.name, "TORCH_NCCL_")) {
      ctx.Add(Severity::kWarning, s, "other-tool",
              absl::StrCat(s.name,
                           " is PyTorch's, not NCCL's; in an NCCL configuration file it is "
                           "exported only when NCCL loads the file, after PyTorch has "
                           "read its settings"),
              "set it in the job's environment instead");
    } else {
      ctx.Add(Severity::kInfo, s, "not-nccl",
              absl::StrCat(s.name,
                           " is not an NCCL variable; NCCL still exports it into the "
                           "process environment when it loads this file"),
              "move it to the job's environment if another tool needs it");
    }
    return;
  }
  if (auto alias = PyTorchAliases().find(s.name); alias != PyTorchAliases().end()) {
    ctx.Add(
        Severity::kWarning, s, "other-tool",
        absl::StrCat(s.name,
                     " is not read by NCCL: PyTorch's ProcessGroupNCCL reads it as "
                     "the deprecated name of ",
                     alias->second),
        absl::StrCat("use ", alias->second, "=", s.value, " (PyTorch warns about the old name)"));
    return;
  }
  const NcclVarInfo* var = FindNcclVariable(s.name);
  if (var == nullptr) {
    std::string fix;
    if (auto myth = Myths().find(s.name); myth != Myths().end()) {
      fix = myth->second;
    } else {
      std::vector<std::string> close;
      if (ctx.suggestions_left > 0) {
        --ctx.suggestions_left;
        close = SuggestNcclVariables(s.name, 3);
      }
      fix = close.empty() ? "remove it"
                          : absl::StrCat("did you mean ", absl::StrJoin(close, ", "), "?");
    }
    ctx.Add(Severity::kError, s, "unknown-name",
            absl::StrCat(s.name, " does not exist: no NCCL release from 2.3 to ",
                         NewestKnownNcclVersion().ToString(), " reads it, so it has no effect"),
            fix);
    return;
  }
  if (var->removed != 0 && v.code() >= var->removed) {
    ctx.Add(Severity::kError, s, "removed",
            absl::StrCat(s.name, " was removed in NCCL ", Ver(var->removed), "; NCCL ",
                         v.ToString(), " ignores it"),
            *var->replacement ? absl::StrCat("use ", var->replacement, " if you need its effect")
                              : "remove it");
    return;
  }
  if (v.code() < var->introduced) {
    std::string extra;
    if (s.name == "NCCL_ALLOC_P2P_NET_LL_BUFFERS" && v >= NcclVersion{2, 14, 0}) {
      extra = " (this version reads it as NCCL_NCCL_ALLOC_P2P_NET_LL_BUFFERS, a double prefix)";
    }
    ctx.Add(Severity::kError, s, "too-new",
            absl::StrCat(s.name, " first appears in NCCL ", Ver(var->introduced), "; NCCL ",
                         v.ToString(), " does not read it", extra),
            absl::StrCat("upgrade NCCL to ", Ver(var->introduced), " or later, or remove it"));
    return;
  }
  if (var->deprecated != 0 && v.code() >= var->deprecated) {
    std::string alias_note;
    if (absl::EndsWith(s.name, "_NRINGS") && ctx.Find(var->replacement) != nullptr) {
      alias_note = absl::StrCat("; it is ignored because ", var->replacement, " is also set");
    }
    ctx.Add(Severity::kWarning, s, "deprecated",
            absl::StrCat(s.name, " is deprecated since NCCL ", Ver(var->deprecated),
                         absl::EndsWith(s.name, "_NRINGS") ? " (an old alias)" : "",
                         " in favour of ", var->replacement, alias_note),
            absl::StrCat("use ", var->replacement));
  }
  if (var->debug_only) {
    std::string msg = absl::StrCat(
        "NCCL documents ", s.name,
        " as a debugging setting: forcing it stops NCCL from choosing for itself, which costs "
        "performance (or breaks things) on other machines and NCCL versions");
    if (s.name == "NCCL_ALGO" || s.name == "NCCL_PROTO") {
      msg = absl::StrCat(
          s.name, " forces ", s.name == "NCCL_ALGO" ? "algorithms" : "protocols",
          " that NCCL's tuner otherwise picks per operation and message size; "
          "kept in production it costs bandwidth or latency (NCCL documents it "
          "under Debugging)",
          s.name == "NCCL_PROTO" ? "; forcing LL128 where unsupported can corrupt data" : "");
    }
    ctx.Add(Severity::kWarning, s, "debug-setting", msg,
            "remove it once the problem it works around is understood");
  } else if (!var->documented) {
    ctx.Add(Severity::kInfo, s, "undocumented",
            absl::StrCat(s.name,
                         " is an internal NCCL setting, not in NCCL's documentation; it can "
                         "change or vanish in any release"),
            "keep it only with a reason written next to it");
  }
  nccl_tuning_internal::CheckValue(ctx, s, *var);
  if (s.name == "NCCL_IB_GID_INDEX" && v >= NcclVersion{2, 21, 0} &&
      ctx.IntOr("NCCL_IB_GID_INDEX", -1) >= 0 && !PureInfiniBand(ctx.options.topology)) {
    ctx.Add(Severity::kWarning, s, "pinned-gid",
            absl::StrCat("since NCCL 2.21 NCCL picks the RoCE GID itself (a RoCE v2 GID of "
                         "NCCL_IB_ADDR_FAMILY, default IPv4); a fixed index takes whatever entry "
                         "sits there, which differs between nodes and moves when addresses change"),
            "unset it; steer the choice with NCCL_IB_ADDR_FAMILY, NCCL_IB_ADDR_RANGE or "
            "NCCL_IB_ROCE_VERSION_NUM if needed");
  }
}

// Odd configuration-file lines, as NCCL would read them.
void CheckConfNotes(const LintContext& ctx) {
  const NcclVersion& v = ctx.options.nccl_version;
  for (const ConfLineNote& n : ctx.settings.notes) {
    Setting s;
    s.origin = n.origin;
    s.value = n.line;
    size_t eq = n.line.find('=');
    s.name = eq == std::string::npos ? "" : n.line.substr(0, eq);
    s.value = eq == std::string::npos ? n.line : n.line.substr(eq + 1);
    const std::string& p = n.problem;
    if (p == "crlf") {
      bool old = v < NcclVersion{2, 30, 0};
      ctx.Add(old ? Severity::kError : Severity::kInfo, s, "crlf",
              old ? absl::StrCat("Windows line ending: NCCL ", v.ToString(),
                                 " keeps the '\\r' at the end of the value (only 2.30+ drops it), "
                                 "so a name like 'eth0\\r' matches nothing")
                  : "Windows line ending; NCCL 2.30+ drops the '\\r', older versions keep it",
              "save the file with Unix line endings");
    } else if (p == "space-in-name") {
      ctx.Add(Severity::kError, s, "space-in-name",
              absl::StrCat("NCCL splits at the first '=' without trimming, so the name is '",
                           s.name, "' with its spaces; the line has no effect"),
              "write NAME=VALUE with no spaces around '='");
    } else if (p == "export-prefix") {
      ctx.Add(Severity::kError, s, "export-prefix",
              absl::StrCat("nccl.conf is not a shell script: NCCL takes '", s.name,
                           "' as the name; the line has no effect"),
              "drop 'export '");
    } else if (p == "indented-comment") {
      ctx.Add(Severity::kWarning, s, "indented-comment",
              "'#' is a comment only in the first column; NCCL sets a variable with this odd name",
              "start the comment in the first column");
    } else if (p == "bad-name") {
      ctx.Add(Severity::kWarning, s, "bad-name",
              absl::StrCat("'", s.name, "' is not a variable name"), "check the line");
    } else if (p == "quoted-value") {
      ctx.Add(Severity::kError, s, "quoted-value",
              "NCCL keeps quotes as part of the value (it is not a shell), so this value never "
              "matches and numbers read as 0",
              "remove the quotes");
    } else if (p == "space-around-value") {
      ctx.Add(Severity::kWarning, s, "space-around-value", "NCCL keeps the spaces around the value",
              "remove the spaces");
    } else if (p == "inline-comment") {
      ctx.Add(Severity::kWarning, s, "inline-comment",
              "NCCL has no end-of-line comments: ' # ...' becomes part of the value",
              "put the comment on its own line");
    } else if (p == "no-equals") {
      ctx.Add(Severity::kInfo, s, "no-equals", "a line without '=' is ignored", "");
    } else if (p == "too-long") {
      ctx.Add(Severity::kWarning, s, "too-long", "NCCL cuts names and values at 1023 characters",
              "shorten the value");
    } else if (p == "duplicate") {
      ctx.Add(Severity::kWarning, s, "duplicate",
              "the name is set again later in the same file; NCCL keeps the first line",
              "keep one line per variable");
    } else if (p == "overridden-later") {
      ctx.Add(Severity::kInfo, s, "duplicate",
              "assigned again later in the file; the last assignment wins", "");
    }
  }
}

void CheckSources(const LintContext& ctx) {
  const EffectiveSettings& es = ctx.settings;
  std::map<std::string, const Setting*> winners;
  for (const Setting& s : es.settings) {
    if (s.effective) winners.emplace(s.name, &s);
  }
  for (const Setting& s : es.settings) {
    if (s.effective) continue;
    auto w = winners.find(s.name);
    const Setting* winner = w == winners.end() ? nullptr : w->second;
    if (winner == nullptr || winner->origin == s.origin) continue;
    ctx.Add(Severity::kInfo, s, "shadowed",
            absl::StrCat("not used: ", winner->origin, " sets ", s.name, "=", winner->value,
                         " and takes precedence (environment, then NCCL_CONF_FILE or "
                         "~/.nccl.conf, then /etc/nccl.conf)"),
            "keep each variable in one place");
    if (s.name == "NCCL_CONF_FILE") continue;
  }
  for (const Setting& s : es.settings) {
    if (s.name == "NCCL_CONF_FILE" && s.source != SettingSource::kEnvironment) {
      ctx.Add(Severity::kWarning, s, "conf-file-in-file",
              "NCCL reads NCCL_CONF_FILE from the environment only, before it opens any file",
              "export NCCL_CONF_FILE in the job's environment");
    }
  }
  for (const auto& [path, state] : es.files) {
    const Setting* conf = ctx.Find("NCCL_CONF_FILE");
    if (conf != nullptr && path == conf->value && state != "read") {
      ctx.Add(Severity::kWarning, *conf, "conf-file-missing",
              absl::StrCat("NCCL_CONF_FILE names ", path, " (", state,
                           "); NCCL skips it silently, and ~/.nccl.conf is not read either"),
              "fix the path");
    }
  }
}

void CheckTopology(const LintContext& ctx) {
  const Topology* t = ctx.options.topology;
  if (t == nullptr) return;
  const EffectiveSettings& es = ctx.settings;
  int ib = 0, roce = 0, efa = 0;
  std::vector<const Nic*> rdma;
  for (const Nic& n : t->nics) {
    if (!n.active) continue;
    if (n.kind == NicKind::kInfiniBand) ++ib;
    if (n.kind == NicKind::kRoce) ++roce;
    if (n.kind == NicKind::kEfa) ++efa;
    if (n.kind != NicKind::kEthernet) rdma.push_back(&n);
  }
  const NcclVersion& v = ctx.options.nccl_version;
  if (const Setting* s = ctx.Find("NCCL_IB_DISABLE");
      s && IsTrue(ctx, "NCCL_IB_DISABLE") && ib + roce > 0) {
    ctx.Add(Severity::kError, *s, "ib-disabled",
            absl::StrCat("disables InfiniBand/RoCE on a machine with ", ib + roce,
                         " active RDMA port(s): NCCL falls back to TCP sockets, typically an "
                         "order of magnitude slower"),
            "unset it");
  }
  if (const Setting* s = ctx.Find("NCCL_NET");
      s && absl::EqualsIgnoreCase(s->value, "Socket") && ib + roce > 0) {
    ctx.Add(Severity::kWarning, *s, "socket-on-rdma",
            absl::StrCat("forces TCP sockets although ", ib + roce, " RDMA port(s) are active"),
            "unset it, or use IB");
  }
  if (const Setting* s = ctx.Find("NCCL_NET");
      s && absl::EqualsIgnoreCase(s->value, "IB") && rdma.empty()) {
    ctx.Add(Severity::kError, *s, "no-rdma",
            "forces the IB transport but no active RDMA device is present: initialization fails",
            "unset it on this machine");
  }
  if (const Setting* s = ctx.Find("NCCL_P2P_DISABLE"); s && ctx.IntOr("NCCL_P2P_DISABLE", 0) == 1) {
    int nv = 0;
    for (size_t i = 0; i < t->gpus.size(); ++i) {
      for (size_t j = 0; j < t->gpus.size(); ++j) nv += t->link(i, j).type == PathType::kNvLink;
    }
    if (nv > 0) {
      ctx.Add(Severity::kError, *s, "p2p-disabled-on-nvlink",
              "disables direct GPU-to-GPU transfers on a machine whose GPUs are joined by NVLink: "
              "traffic goes through host memory instead",
              "unset it");
    }
  }
  // Settings that only mean something on RoCE, on a pure InfiniBand fabric.
  if (ib > 0 && roce == 0) {
    for (const char* name : {"NCCL_IB_GID_INDEX", "NCCL_IB_ROCE_VERSION_NUM", "NCCL_IB_ADDR_FAMILY",
                             "NCCL_IB_ADDR_RANGE"}) {
      const Setting* s = ctx.Find(name);
      if (s == nullptr) continue;
      bool ignored = std::string(name) != "NCCL_IB_GID_INDEX" || v >= NcclVersion{2, 22, 0};
      ctx.Add(Severity::kWarning, *s, "roce-only",
              absl::StrCat(name, " is a RoCE setting and every RDMA port here is InfiniBand",
                           ignored ? "; NCCL ignores it on InfiniBand ports" : ""),
              "remove it from InfiniBand nodes");
    }
  }
  if (rdma.empty()) {
    for (const Setting& s : es.settings) {
      if (s.effective && absl::StartsWith(s.name, "NCCL_IB_") && s.name != "NCCL_IB_DISABLE") {
        ctx.Add(Severity::kInfo, s, "no-rdma",
                "no RDMA device on this machine: InfiniBand settings have no effect here", "");
      }
    }
  }
  if (const Setting* s = ctx.Find("NCCL_IB_GID_INDEX"); s && roce > 0) {
    int64_t idx = ctx.IntOr("NCCL_IB_GID_INDEX", -1);
    for (const Nic* n : rdma) {
      if (n->kind != NicKind::kRoce || n->gid_types.empty() || idx < 0) continue;
      if (idx >= static_cast<int64_t>(n->gid_types.size()) || n->gid_types[idx].empty()) {
        ctx.Add(Severity::kError, *s, "bad-gid",
                absl::StrCat("GID index ", idx, " is unused on ", n->name, " port ", n->port),
                "unset it (NCCL 2.21+ picks a RoCE v2 GID) or pick a populated index");
        break;
      }
      if (n->gid_types[idx] != "RoCE v2") {
        ctx.Add(Severity::kWarning, *s, "bad-gid",
                absl::StrCat("GID index ", idx, " on ", n->name, " is ", n->gid_types[idx],
                             ", not RoCE v2 (routable over IP)"),
                "unset it or use a RoCE v2 index");
        break;
      }
    }
  }
  // IB_HCA entries must name devices that exist; a prefix matches more.
  if (const Setting* s = ctx.Find("NCCL_IB_HCA"); s && !rdma.empty()) {
    absl::string_view list = s->value;
    bool exclude = absl::ConsumePrefix(&list, "^");
    bool exact = absl::ConsumePrefix(&list, "=");
    for (absl::string_view entry : absl::StrSplit(list, ',', absl::SkipEmpty())) {
      std::string dev(entry.substr(0, entry.find(':')));
      std::vector<std::string> hits;
      for (const Nic* n : rdma) {
        if (exact ? n->name == dev : absl::StartsWith(n->name, dev)) hits.push_back(n->name);
      }
      if (hits.empty()) {
        ctx.Add(
            exclude ? Severity::kInfo : Severity::kError, *s, "no-such-hca",
            absl::StrCat(
                "'", dev, "' matches no RDMA device here (",
                absl::StrJoin(rdma, ", ", [](std::string* o, const Nic* n) { o->append(n->name); }),
                ")", exclude ? "" : "; if nothing matches, NCCL falls back to sockets"),
            "list devices that exist, with '=' for exact names");
      } else if (!exact && hits.size() > 1) {
        ctx.Add(Severity::kWarning, *s, "prefix-match",
                absl::StrCat("'", dev, "' is a prefix and matches ", absl::StrJoin(hits, ", ")),
                absl::StrCat("write '=", s->value, "' for exact names"));
      }
    }
  }
  if (const Setting* s = ctx.Find("NCCL_SOCKET_IFNAME")) {
    absl::string_view list = s->value;
    bool exclude = absl::ConsumePrefix(&list, "^");
    bool exact = absl::ConsumePrefix(&list, "=");
    std::vector<std::string> netdevs;
    for (const Nic& n : t->nics) netdevs.insert(netdevs.end(), n.netdevs.begin(), n.netdevs.end());
    if (!exclude && !netdevs.empty()) {
      for (absl::string_view entry : absl::StrSplit(list, ',', absl::SkipEmpty())) {
        bool any = std::any_of(netdevs.begin(), netdevs.end(), [&](const std::string& d) {
          return exact ? d == entry : absl::StartsWith(d, entry);
        });
        if (!any && entry != "lo" && !absl::StartsWith(entry, "docker")) {
          ctx.Add(Severity::kWarning, *s, "no-such-interface",
                  absl::StrCat("'", entry, "' matches no network interface here (",
                               absl::StrJoin(netdevs, ", "), ")"),
                  "check the interface names on every node");
        }
      }
    }
  }
  if (efa > 0) {
    if (const Setting* s = ctx.Find("NCCL_PROTO")) {
      ctx.Add(Severity::kInfo, *s, "efa-proto",
              "older AWS guides set NCCL_PROTO=simple for EFA; current aws-ofi-nccl releases do "
              "not need it",
              "drop it unless the plugin's documentation for your version asks for it");
    }
  }
}

}  // namespace

const char* SeverityName(Severity severity) {
  switch (severity) {
    case Severity::kInfo:
      return "info";
    case Severity::kWarning:
      return "warning";
    case Severity::kError:
      return "error";
  }
  return "unknown";
}

std::string Finding::Describe() const {
  std::string s = absl::StrCat(SeverityName(severity), " [", rule, "] ", name);
  if (!value.empty() || !name.empty()) absl::StrAppend(&s, "=", value);
  absl::StrAppend(&s, " (", origin, "): ", message);
  if (!fix.empty()) absl::StrAppend(&s, ". Fix: ", fix);
  return s;
}

int LintReport::count(Severity s) const {
  return static_cast<int>(std::count_if(findings.begin(), findings.end(),
                                        [&](const Finding& f) { return f.severity == s; }));
}

LintReport LintNcclSettings(const EffectiveSettings& settings, const LintOptions& options) {
  LintReport report;
  report.nccl_version = options.nccl_version;
  LintContext ctx{settings, options, &report.findings};
  for (const Setting& s : settings.settings) {
    if (s.effective) ctx.index.emplace(s.name, &s);
  }
  // Lines whose name NCCL mangles are reported once, by CheckConfNotes.
  std::set<std::string> mangled;
  for (const ConfLineNote& n : settings.notes) {
    if (n.problem == "space-in-name" || n.problem == "export-prefix" ||
        n.problem == "indented-comment" || n.problem == "bad-name") {
      mangled.insert(n.origin);
    }
  }
  for (const Setting& s : settings.settings) {
    if (mangled.count(s.origin)) continue;
    CheckName(ctx, s);
  }
  CheckConfNotes(ctx);
  CheckSources(ctx);
  CheckTopology(ctx);
  std::stable_sort(report.findings.begin(), report.findings.end(),
                   [](const Finding& a, const Finding& b) { return a.severity > b.severity; });
  return report;
}

}  // namespace strata
