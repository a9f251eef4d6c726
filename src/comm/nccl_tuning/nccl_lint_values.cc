// Value checks of the NCCL lint: what NCCL makes of each value, by type, and
// the ranges and quirks its source and documentation state (see the rows of
// nccl_vars.tsv for where each fact comes from).
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "comm/nccl_tuning/nccl_lint_internal.h"

namespace strata {
namespace nccl_tuning_internal {
namespace {

bool EqualsAny(absl::string_view value, absl::string_view values, bool case_sensitive,
               std::string* canonical = nullptr) {
  for (absl::string_view v : absl::StrSplit(values, '|')) {
    if (case_sensitive ? value == v : absl::EqualsIgnoreCase(value, v)) return true;
    if (canonical != nullptr && absl::EqualsIgnoreCase(value, v)) *canonical = std::string(v);
  }
  return false;
}

std::string Choices(absl::string_view values) {
  return absl::StrJoin(absl::StrSplit(values, '|'), ", ");
}

// NCCL_NTHREADS / NCCL_LL128_NTHREADS: what getNthreads() in tuning.cc does.
std::string ThreadsReplacement(int64_t v, int64_t min, int64_t max) {
  if (v <= 0) return "the default";
  if (v % 32 != 0 || v > max) return absl::StrCat(max);
  if (v < min) return absl::StrCat(min);
  return absl::StrCat(v);
}

void CheckInt(const LintContext& ctx, const Setting& s, const NcclVarInfo& var) {
  NcclIntParse p = ParseLikeStrtoll(s.value);
  if (!p.digits) {
    ctx.Add(Severity::kError, s, "not-a-number",
            absl::StrCat("'", s.value, "' is not a number; NCCL reads it as 0 without a warning",
                         var.min <= var.max && (0 < var.min || 0 > var.max)
                             ? absl::StrCat(", which is outside ", var.min, "..", var.max)
                             : ""),
            absl::StrCat("set a decimal number",
                         var.min <= var.max ? absl::StrCat(" in ", var.min, "..", var.max) : ""));
    return;
  }
  if (p.overflow) {
    ctx.Add(Severity::kError, s, "out-of-range",
            absl::StrCat("'", s.value, "' does not fit in 64 bits; NCCL ignores it and uses ",
                         var.default_value),
            "use a smaller number");
    return;
  }
  if (!p.rest.empty()) {
    ctx.Add(Severity::kError, s, "trailing-text",
            absl::StrCat("NCCL reads only the leading number of '", s.value, "', ", p.value,
                         ", and ignores '", p.rest, "' (no units or suffixes)"),
            absl::StrCat("write the plain number NCCL should use"));
  }
  if (p.octal) {
    ctx.Add(Severity::kWarning, s, "octal",
            absl::StrCat("'", s.value, "' starts with 0, so NCCL reads it as octal: ", p.value),
            "drop the leading zero");
  }
  const int64_t v = p.value;
  std::string name = var.name;
  if (name == "NCCL_NTHREADS" || name == "NCCL_LL128_NTHREADS") {
    if (v > 0 && (v % 32 != 0 || v < var.min || v > var.max)) {
      ctx.Add(
          Severity::kError, s, "out-of-range",
          absl::StrCat(v, " is not a multiple of 32 in ", var.min, "..", var.max,
                       "; NCCL silently replaces it with ", ThreadsReplacement(v, var.min, var.max),
                       " (an INFO log line is all it says)"),
          name == "NCCL_NTHREADS" ? "unset it (NCCL picks 256 or 512), or use 64, 128, 256 or 512"
                                  : "unset it");
    }
    return;
  }
  if (name == "NCCL_IB_TIMEOUT") {
    if (v <= 0 || v >= 32) {
      ctx.Add(Severity::kError, s, "infinite-timeout",
              absl::StrCat("NCCL_IB_TIMEOUT=", v,
                           " means no timeout: a dead peer is never detected and the job hangs"),
              "unset it (default 20, about 34 s to detect a dead peer) or use 1..31");
      return;
    }
    int64_t retry = std::clamp<int64_t>(ctx.IntOr("NCCL_IB_RETRY_CNT", 7), 0, 7);
    absl::Duration t = IbFailureDetectionTime(v, retry);
    absl::Duration per = IbFailureDetectionTime(v, 0);
    std::string what = absl::StrCat(
        "a dead InfiniBand peer is detected after about ",
        absl::FormatDuration(absl::Trunc(t, absl::Milliseconds(100))), " (4.096 us x 2^", v, " = ",
        absl::FormatDuration(absl::Trunc(per, absl::Milliseconds(1))), " per attempt, ", retry + 1,
        " attempts with NCCL_IB_RETRY_CNT=", retry, ")");
    if (t > ctx.options.failure_detection_budget) {
      ctx.Add(Severity::kWarning, s, "slow-failure-detection",
              absl::StrCat(what, "; longer than the ",
                           absl::FormatDuration(ctx.options.failure_detection_budget),
                           " budget, so a failed rank stalls the job that long before "
                           "strata's recovery can start"),
              "lower it (20 is NCCL's default since 2.23) unless the fabric is very large");
    } else {
      ctx.Add(Severity::kInfo, s, "failure-detection", what, "");
    }
    return;
  }
  int64_t max = var.max;
  if ((name == "NCCL_MAX_CTAS" || name == "NCCL_MIN_CTAS") &&
      ctx.options.nccl_version < NcclVersion{2, 25, 0}) {
    max = 32;  // 64 since 2.25 (NCCL docs)
  }
  if (var.min <= max && (v < var.min || v > max)) {
    std::string does = *var.out_of_range ? var.out_of_range : "NCCL does not check it";
    ctx.Add(Severity::kError, s, "out-of-range",
            absl::StrCat(v, " is outside the valid range ", var.min, "..", max, "; ", does),
            absl::StrCat("use a value in ", var.min, "..", max, " or unset it"));
  } else if (var.type == NcclVarType::kBool && var.min > var.max) {
    // A boolean without a declared range: nothing more to say.
  }
  if (name == "NCCL_SOCKET_NTHREADS" || name == "NCCL_NSOCKS_PERTHREAD") {
    int64_t threads = ctx.IntOr("NCCL_SOCKET_NTHREADS", 0);
    int64_t socks = ctx.IntOr("NCCL_NSOCKS_PERTHREAD", 0);
    if (name == "NCCL_NSOCKS_PERTHREAD" && threads > 0 && socks > 0 && threads * socks > 64) {
      ctx.Add(Severity::kError, s, "out-of-range",
              absl::StrCat("NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD = ", threads * socks,
                           " exceeds 64; NCCL cuts NCCL_NSOCKS_PERTHREAD to ", 64 / threads),
              "keep the product at 64 or below (4 x 4 suits a 100 Gb/s network)");
    }
  }
}

void CheckEnum(const LintContext& ctx, const Setting& s, const NcclVarInfo& var) {
  std::string canonical;
  if (EqualsAny(s.value, var.values, var.case_sensitive, &canonical)) {
    std::string name = var.name;
    if (name == "NCCL_LAUNCH_MODE" && absl::EqualsIgnoreCase(s.value, "GROUP")) {
      ctx.Add(Severity::kWarning, s, "deprecated-value",
              "NCCL_LAUNCH_MODE=GROUP is deprecated since NCCL 2.9", "unset it (PARALLEL)");
    }
    if (name == "NCCL_DEBUG" &&
        (absl::EqualsIgnoreCase(s.value, "INFO") || absl::EqualsIgnoreCase(s.value, "TRACE"))) {
      ctx.Add(Severity::kInfo, s, "verbose-logging",
              absl::StrCat("NCCL_DEBUG=", s.value,
                           " logs every rank's initialization in detail; right for debugging, "
                           "heavy for a production job"),
              "use WARN in production: errors still come with an explanation");
    }
    return;
  }
  std::string does = "NCCL ignores it and keeps its default";
  if (std::string(var.name) == "NCCL_DEBUG") does = "NCCL then logs nothing, warnings included";
  ctx.Add(Severity::kError, s, "bad-value",
          absl::StrCat("'", s.value, "' is not one of ", Choices(var.values),
                       var.case_sensitive ? " (case-sensitive)" : "", "; ", does),
          canonical.empty() ? absl::StrCat("use one of ", Choices(var.values))
                            : absl::StrCat("write it as ", canonical));
}

void CheckLevel(const LintContext& ctx, const Setting& s, const NcclVarInfo& var) {
  std::string canonical;
  if (EqualsAny(s.value, var.values, true, &canonical)) return;
  if (!s.value.empty() && absl::ascii_isdigit(static_cast<unsigned char>(s.value[0]))) {
    ctx.Add(Severity::kWarning, s, "legacy-integer",
            absl::StrCat("integer levels are legacy: their meaning changed across NCCL versions "
                         "(values above 4 mean SYS)"),
            "use a name: LOC, PIX, PXB, PHB or SYS");
    return;
  }
  std::string hint = canonical.empty() && absl::EqualsIgnoreCase(s.value, "NODE")
                         ? " ('NODE' is nvidia-smi's word; NCCL calls that PHB or SYS)"
                         : "";
  ctx.Add(
      Severity::kError, s, "bad-value",
      absl::StrCat("'", s.value, "' is not a path level NCCL knows (", Choices(var.values),
                   ", case-sensitive)", hint, "; NCCL ignores it without a warning"),
      canonical.empty() ? "use LOC, NVL, PIX, PXB, PHB or SYS" : absl::StrCat("write ", canonical));
}

// NCCL_ALGO / NCCL_PROTO: "[func:]list[;func:list...]", list "a,b" or "^a,b".
void CheckAlgoProto(const LintContext& ctx, const Setting& s, const NcclVarInfo& var) {
  const bool algo = std::string(var.name) == "NCCL_ALGO";
  const NcclVersion& version = ctx.options.nccl_version;
  std::vector<std::string> bad;
  bool per_function = false;
  for (absl::string_view entry : absl::StrSplit(s.value, ';', absl::SkipEmpty())) {
    absl::string_view list = entry;
    size_t colon = entry.find(':');
    if (colon != absl::string_view::npos) {
      per_function = true;
      absl::string_view func = absl::StripAsciiWhitespace(entry.substr(0, colon));
      if (!EqualsAny(func, "Broadcast|Reduce|AllGather|ReduceScatter|AllReduce", false)) {
        bad.push_back(absl::StrCat("function '", func, "'"));
      }
      list = entry.substr(colon + 1);
    }
    list = absl::StripAsciiWhitespace(list);
    if (absl::ConsumePrefix(&list, "^")) list = absl::StripAsciiWhitespace(list);
    for (absl::string_view tok : absl::StrSplit(list, ',', absl::SkipEmpty())) {
      tok = absl::StripAsciiWhitespace(tok);
      if (!EqualsAny(tok, var.values, false)) {
        bad.push_back(absl::StrCat("'", tok, "'"));
        continue;
      }
      if (!algo) continue;
      // Algorithm names by release (NCCL docs, NCCL_ALGO table).
      std::string up = absl::AsciiStrToUpper(tok);
      NcclVersion since{2, 5, 0};
      if (up == "COLLNETDIRECT" || up == "COLLNETCHAIN") since = {2, 14, 0};
      if (up == "NVLS") since = {2, 17, 0};
      if (up == "NVLSTREE") since = {2, 18, 0};
      if (up == "PAT") since = {2, 23, 0};
      if (version < since || (up == "COLLNET" && version >= NcclVersion{2, 14, 0})) {
        bad.push_back(absl::StrCat("'", tok, "' (not in NCCL ", version.ToString(), ")"));
      }
    }
  }
  if (per_function && version < NcclVersion{2, 24, 0}) {
    ctx.Add(Severity::kError, s, "bad-value",
            absl::StrCat("per-function syntax (func:list) needs NCCL 2.24; NCCL ",
                         version.ToString(), " does not understand it"),
            "use a plain comma-separated list");
  }
  if (!bad.empty()) {
    ctx.Add(Severity::kError, s, "bad-value",
            absl::StrCat("unknown ", algo ? "algorithm" : "protocol", " token(s) ",
                         absl::StrJoin(bad, ", "),
                         "; NCCL 2.24+ fails at init on them, older versions ignore them"),
            absl::StrCat("use ", Choices(var.values)));
  }
}

void CheckSubsystems(const LintContext& ctx, const Setting& s, const NcclVarInfo& var) {
  absl::string_view list = s.value;
  absl::ConsumePrefix(&list, "^");
  std::vector<std::string> bad;
  for (absl::string_view tok : absl::StrSplit(list, ',', absl::SkipEmpty())) {
    tok = absl::StripAsciiWhitespace(absl::StripPrefix(tok, "^"));
    if (!EqualsAny(tok, var.values, false)) bad.emplace_back(tok);
  }
  if (!bad.empty()) {
    ctx.Add(Severity::kWarning, s, "bad-value",
            absl::StrCat("unknown name(s) ", absl::StrJoin(bad, ", "), "; NCCL ignores them"),
            absl::StrCat("use ", Choices(var.values)));
  }
}

void CheckPath(const LintContext& ctx, const Setting& s) {
  if (absl::StrContains(s.value, '~')) {
    ctx.Add(Severity::kError, s, "tilde-path",
            "NCCL does not expand '~' in file names; it looks for a directory literally named '~'",
            "write the absolute path");
  }
}

}  // namespace

NcclIntParse ParseLikeStrtoll(const std::string& text) {
  NcclIntParse p;
  const char* begin = text.c_str();
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(begin, &end, 0);
  p.overflow = errno == ERANGE;
  p.value = v;
  p.digits = end != begin;
  if (p.digits) {
    // strtoll's base 0: a leading 0 (not 0x) is octal.
    const char* d = begin;
    while (absl::ascii_isspace(static_cast<unsigned char>(*d))) ++d;
    if (*d == '+' || *d == '-') ++d;
    p.octal = d[0] == '0' && absl::ascii_isdigit(static_cast<unsigned char>(d[1]));
    p.rest = std::string(absl::StripAsciiWhitespace(absl::string_view(end)));
  }
  return p;
}

void CheckValue(const LintContext& ctx, const Setting& s, const NcclVarInfo& var) {
  if (s.value.empty()) {
    ctx.Add(Severity::kInfo, s, "empty-value",
            "the value is empty; NCCL treats the variable as unset", "remove the line");
    return;
  }
  std::string name = var.name;
  switch (var.type) {
    case NcclVarType::kInt:
    case NcclVarType::kBool:
      CheckInt(ctx, s, var);
      break;
    case NcclVarType::kEnum:
      CheckEnum(ctx, s, var);
      break;
    case NcclVarType::kLevel:
      CheckLevel(ctx, s, var);
      break;
    case NcclVarType::kList:
      if (name == "NCCL_ALGO" || name == "NCCL_PROTO") CheckAlgoProto(ctx, s, var);
      if (name == "NCCL_DEBUG_SUBSYS" || name == "NCCL_DEBUG_TIMESTAMP_LEVELS") {
        CheckSubsystems(ctx, s, var);
      }
      break;
    case NcclVarType::kString:
      break;
  }
  if (name == "NCCL_CONF_FILE" || name == "NCCL_DEBUG_FILE" || name == "NCCL_TOPO_FILE" ||
      name == "NCCL_TOPO_DUMP_FILE" || name == "NCCL_GRAPH_FILE") {
    CheckPath(ctx, s);
  }
}

}  // namespace nccl_tuning_internal

absl::Duration IbFailureDetectionTime(int64_t timeout, int64_t retry_cnt) {
  if (timeout <= 0 || timeout >= 32) return absl::InfiniteDuration();
  retry_cnt = std::clamp<int64_t>(retry_cnt, 0, 7);
  double per_us = 4.096 * std::ldexp(1.0, static_cast<int>(timeout));
  return absl::Microseconds(per_us) * static_cast<double>(retry_cnt + 1);
}

}  // namespace strata
