// Lookup and near-miss suggestions over the NCCL variable table.
#include "comm/nccl_tuning/nccl_vars.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "strata/comm/nccl_lint.h"

namespace strata {
namespace {

// Optimal string alignment distance (edits, including swaps of neighbours),
// in three rolling rows.
int EditDistance(absl::string_view a, absl::string_view b) {
  const size_t m = b.size();
  std::vector<int> rows(3 * (m + 1));
  int* prev2 = rows.data();
  int* prev = prev2 + (m + 1);
  int* cur = prev + (m + 1);
  for (size_t j = 0; j <= m; ++j) prev[j] = static_cast<int>(j);
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = static_cast<int>(i);
    for (size_t j = 1; j <= m; ++j) {
      int cost = a[i - 1] == b[j - 1] ? 0 : 1;
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        cur[j] = std::min(cur[j], prev2[j - 2] + 1);
      }
    }
    std::swap(prev2, prev);
    std::swap(prev, cur);
  }
  return prev[m];
}

absl::string_view Stem(absl::string_view name) {
  if (absl::StartsWith(name, "NCCL_")) name.remove_prefix(5);
  return name;
}

// Every known name's stem and words, split once.
struct KnownName {
  const char* name;
  absl::string_view stem;
  std::vector<absl::string_view> words;
};

const std::vector<KnownName>& KnownNames() {
  static const std::vector<KnownName>* const names = [] {
    auto* v = new std::vector<KnownName>();
    for (const NcclVarInfo& var : NcclVariables()) {
      absl::string_view stem = Stem(var.name);
      v->push_back({var.name, stem, absl::StrSplit(stem, '_', absl::SkipEmpty())});
    }
    return v;
  }();
  return *names;
}

}  // namespace

absl::Span<const NcclVarInfo> NcclVariables() { return nccl_tuning_internal::NcclVarTable(); }

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
  const int limit = std::max<int>(1, static_cast<int>(stem.size()) / 4);
  struct Candidate {
    int distance;
    int shared;
    const char* name;
  };
  std::vector<Candidate> found;
  for (const KnownName& k : KnownNames()) {
    if (k.stem == stem) continue;
    int shared = 0;
    for (absl::string_view w : words) {
      if (w.size() >= 3 && std::find(k.words.begin(), k.words.end(), w) != k.words.end()) ++shared;
    }
    // Most words in common and about the same length: a reordered or
    // pluralised name (TIMEOUT_IB vs IB_TIMEOUT).
    bool similar = !words.empty() && shared * 2 >= static_cast<int>(words.size()) + 1 &&
                   shared * 2 >= static_cast<int>(k.words.size());
    int length_gap = std::abs(static_cast<int>(k.stem.size()) - static_cast<int>(stem.size()));
    if (!similar && length_gap > limit) continue;  // too far for an edit to bridge
    int dist = EditDistance(stem, k.stem);
    if (dist <= limit || similar) found.push_back({dist, shared, k.name});
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
