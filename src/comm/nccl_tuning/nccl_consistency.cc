// CheckNcclConsistency: do all ranks of a communicator run with the same NCCL
// settings? Differences (one node with a stale /etc/nccl.conf, a launcher
// that exports a variable on some hosts only) make NCCL choose different
// algorithms or transports on different ranks, which hangs or corrupts.
//
// Communication is O(N) in the world size: one all-reduce of two 8-byte
// values answers "all equal?"; only when not, an all-gather of the 8-byte
// hashes groups the ranks, and one representative per distinct configuration
// (at most max_detailed_configs) broadcasts its settings. No rank ever sends
// its full settings to every other rank.
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "strata/base/status.h"
#include "strata/comm/nccl_lint.h"

namespace strata {
namespace {

constexpr char kContext[] = "checking NCCL settings across ranks";

// Sorted NAME=VALUE lines; the same text on every rank with the same settings.
std::string Canonical(const EffectiveSettings& settings, const std::vector<std::string>& ignore) {
  std::string out;
  for (const auto& [name, value] : settings.EffectiveNccl()) {
    if (std::find(ignore.begin(), ignore.end(), name) != ignore.end()) continue;
    absl::StrAppend(&out, name, "=", value, "\n");
  }
  return out;
}

std::map<std::string, std::string> ParseCanonical(const std::string& text) {
  std::map<std::string, std::string> out;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    size_t eq = line.find('=');
    out[std::string(line.substr(0, eq))] =
        eq == absl::string_view::npos ? "" : std::string(line.substr(eq + 1));
  }
  return out;
}

absl::Status Wait(absl::StatusOr<std::unique_ptr<Work>> work, absl::Duration timeout) {
  if (!work.ok()) return work.status();
  return (*work)->Wait(absl::Now() + timeout);
}

std::string RankList(const std::vector<int>& ranks) {
  // "0-5,7"
  std::vector<std::string> parts;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    parts.push_back(j == i ? absl::StrCat(ranks[i]) : absl::StrCat(ranks[i], "-", ranks[j]));
    i = j + 1;
  }
  return absl::StrJoin(parts, ",");
}

absl::Status CheckImpl(Communicator& comm, const EffectiveSettings& settings,
                       const ConsistencyOptions& options, ConsistencyReport* report) {
  const std::string mine = Canonical(settings, options.ignore);
  uint64_t h = XXH64(mine.data(), mine.size(), /*seed=*/0x5354524154414e43ULL);
  int64_t hash;
  std::memcpy(&hash, &h, sizeof(hash));

  // min(hash) and min(~hash) = ~max(hash), in one all-reduce.
  int64_t both[2] = {hash, ~hash};
  STRATA_RETURN_IF_ERROR(Wait(comm.AllReduce(Buffer::Of(both, 2), Buffer::Of(both, 2),
                                             ReduceOp::kMin, OpOptions{options.timeout, nullptr}),
                              options.timeout));
  if (both[0] == ~both[1]) return absl::OkStatus();

  report->consistent = false;
  const int n = comm.size();
  std::vector<int64_t> hashes(n);
  STRATA_RETURN_IF_ERROR(Wait(
      comm.AllGather(ConstBuffer(&hash, 1, DataType::kInt64),
                     Buffer::Of(hashes.data(), hashes.size()), OpOptions{options.timeout, nullptr}),
      options.timeout));
  std::map<int64_t, std::vector<int>> by_hash;
  for (int r = 0; r < n; ++r) by_hash[hashes[r]].push_back(r);
  for (auto& [h2, ranks] : by_hash) report->groups.push_back(std::move(ranks));
  // Reference first: the most common configuration, ties to the lowest rank.
  std::sort(report->groups.begin(), report->groups.end(),
            [](const std::vector<int>& a, const std::vector<int>& b) {
              if (a.size() != b.size()) return a.size() > b.size();
              return a.front() < b.front();
            });

  const size_t detailed = std::min(report->groups.size(),
                                   static_cast<size_t>(std::max(options.max_detailed_configs, 2)));
  std::vector<std::map<std::string, std::string>> configs;
  for (size_t g = 0; g < detailed; ++g) {
    const int root = report->groups[g].front();
    int64_t len = comm.rank() == root ? static_cast<int64_t>(mine.size()) : 0;
    STRATA_RETURN_IF_ERROR(
        Wait(comm.Broadcast(Buffer::Of(&len, 1), root, OpOptions{options.timeout, nullptr}),
             options.timeout));
    if (len < 0 || len > (int64_t{64} << 20)) {
      return absl::InternalError(
          absl::StrCat("rank ", root, " announced ", len, " bytes of settings"));
    }
    std::string text = comm.rank() == root ? mine : std::string(static_cast<size_t>(len), '\0');
    STRATA_RETURN_IF_ERROR(Wait(comm.Broadcast(Buffer{text.data(), text.size(), DataType::kUInt8},
                                               root, OpOptions{options.timeout, nullptr}),
                                options.timeout));
    configs.push_back(ParseCanonical(text));
  }
  std::set<std::string> names;
  for (const auto& c : configs) {
    for (const auto& [name, value] : c) names.insert(name);
  }
  for (const std::string& name : names) {
    ConsistencyDifference d;
    d.name = name;
    bool differs = false;
    for (const auto& c : configs) {
      auto it = c.find(name);
      d.values.push_back(it == c.end() ? "" : it->second);
      differs |= d.values.back() != d.values.front();
    }
    if (differs) report->differences.push_back(std::move(d));
  }
  return absl::OkStatus();
}

}  // namespace

std::string ConsistencyReport::ToString() const {
  if (consistent) return "all ranks run with the same NCCL settings";
  std::vector<std::string> who;
  for (size_t g = 0; g < groups.size(); ++g) {
    who.push_back(absl::StrCat("ranks ", RankList(groups[g]), g == 0 ? " (most common)" : ""));
  }
  std::string out = absl::StrCat("NCCL settings differ across ranks: ", groups.size(),
                                 " configurations: ", absl::StrJoin(who, " | "));
  for (const ConsistencyDifference& d : differences) {
    std::vector<std::string> vals;
    for (const std::string& v : d.values)
      vals.push_back(v.empty() ? "unset" : absl::StrCat("'", v, "'"));
    absl::StrAppend(&out, "\n  ", d.name, ": ", absl::StrJoin(vals, " vs "));
  }
  if (groups.size() > 0 && differences.empty()) {
    absl::StrAppend(&out, "\n  (the compared configurations differ only beyond the detailed ones)");
  }
  return out;
}

absl::StatusOr<ConsistencyReport> CheckNcclConsistency(Communicator& comm,
                                                       const EffectiveSettings& settings,
                                                       const ConsistencyOptions& options) {
  ConsistencyReport report;
  absl::Status st = CheckImpl(comm, settings, options, &report);
  if (!st.ok()) return internal::Annotate(st, kContext);
  if (report.consistent) {
    // One configuration, held by every rank.
    report.groups.assign(1, std::vector<int>(comm.size()));
    for (int r = 0; r < comm.size(); ++r) report.groups[0][r] = r;
  }
  return report;
}

}  // namespace strata
