// Lookup and near-miss suggestions over the NCCL variable table.
#include "comm/topology/nccl_vars.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "strata/comm/nccl_lint.h"

namespace strata {
namespace {

// Optimal string alignment distance (edits, including swaps of neighbours).
int EditDistance(absl::string_view a, absl::string_view b) {
  const size_t n = a.size(), m = b.size();
  std::vector<std::vector<int>> d(n + 1, std::vector<int>(m + 1));
  for (size_t i = 0; i <= n; ++i) d[i][0] = static_cast<int>(i);
  for (size_t j = 0; j <= m; ++j) d[0][j] = static_cast<int>(j);
  for (size_t i = 1; i <= n; ++i) {
    for (size_t j = 1; j <= m; ++j) {
      int cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[n][m];
}

absl::string_view Stem(absl::string_view name) {
  if (absl::StartsWith(name, "NCCL_")) name.remove_prefix(5);
  return name;
}

}  // namespace

absl::Span<const NcclVarInfo> NcclVariables() {
  // Built once from the two constant halves; immutable afterwards.
  static const std::vector<NcclVarInfo>* const all = [] {
    auto* v = new std::vector<NcclVarInfo>();
    for (const NcclVarInfo& r : topology_internal::DocumentedNcclVars()) v->push_back(r);
    for (const NcclVarInfo& r : topology_internal::InternalNcclVars()) v->push_back(r);
    return v;
  }();
  return *all;
}

const NcclVarInfo* FindNcclVariable(absl::string_view name) {
  for (const NcclVarInfo& v : NcclVariables()) {
    if (name == v.name) return &v;
  }
  return nullptr;
}

std::vector<std::string> SuggestNcclVariables(absl::string_view name, int max) {
  absl::string_view stem = Stem(name);
  if (stem.size() > 128) return {};  // nothing real is that long; bounds the work
  std::vector<absl::string_view> words = absl::StrSplit(stem, '_', absl::SkipEmpty());
  struct Candidate {
    int distance;
    int shared;
    const char* name;
  };
  std::vector<Candidate> found;
  for (const NcclVarInfo& v : NcclVariables()) {
    absl::string_view other = Stem(v.name);
    if (other == stem) continue;
    int dist = EditDistance(stem, other);
    std::vector<absl::string_view> other_words = absl::StrSplit(other, '_', absl::SkipEmpty());
    int shared = 0;
    for (absl::string_view w : words) {
      if (w.size() >= 3 &&
          std::find(other_words.begin(), other_words.end(), w) != other_words.end()) {
        ++shared;
      }
    }
    bool close = dist <= std::max<int>(1, static_cast<int>(stem.size()) / 4);
    // Most words in common and about the same length: a reordered or
    // pluralised name (MAX_NRING vs MAX_NRINGS, TIMEOUT_IB vs IB_TIMEOUT).
    bool similar = !words.empty() && shared * 2 >= static_cast<int>(words.size()) + 1 &&
                   shared * 2 >= static_cast<int>(other_words.size());
    if (close || similar) found.push_back({dist, shared, v.name});
  }
  std::sort(found.begin(), found.end(), [](const Candidate& a, const Candidate& b) {
    if (a.distance != b.distance) return a.distance < b.distance;
    return a.shared > b.shared;
  });
  std::vector<std::string> out;
  for (const Candidate& c : found) {
    if (static_cast<int>(out.size()) >= max) break;
    out.emplace_back(c.name);
  }
  return out;
}

}  // namespace strata
