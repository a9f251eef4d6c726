// StageLayout: which layers each stage holds (see layout.h).
#include "strata/parallel/pipeline/layout.h"

#include <cmath>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace strata::pipeline {
namespace {

constexpr int kMaxLayers = 1 << 20;

absl::Status CheckCounts(absl::Span<const int> counts) {
  if (counts.empty()) return absl::InvalidArgumentError("a layout needs at least one stage");
  if (counts.size() > static_cast<size_t>(kMaxStages)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a layout has at most ", kMaxStages, " stages, got ", counts.size()));
  }
  int64_t total = 0;
  for (size_t s = 0; s < counts.size(); ++s) {
    if (counts[s] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("stage ", s, " has ", counts[s], " layers; want >= 0"));
    }
    const bool middle = s > 0 && s + 1 < counts.size();
    if (middle && counts[s] == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("stage ", s,
                       " holds no layers; a stage between the first (embedding) and the last "
                       "(loss) needs at least one"));
    }
    total += counts[s];
  }
  if (total > kMaxLayers) {
    return absl::InvalidArgumentError(
        absl::StrCat("a layout has at most ", kMaxLayers, " layers, got ", total));
  }
  return absl::OkStatus();
}

}  // namespace

StageLayout StageLayout::FromValidCounts(std::vector<int> counts) {
  StageLayout layout;
  layout.first_.reserve(counts.size());
  for (int c : counts) {
    layout.first_.push_back(layout.num_layers_);
    layout.num_layers_ += c;
  }
  layout.counts_ = std::move(counts);
  return layout;
}

absl::StatusOr<StageLayout> StageLayout::FromCounts(absl::Span<const int> layers_per_stage) {
  if (absl::Status st = CheckCounts(layers_per_stage); !st.ok()) return st;
  return FromValidCounts(std::vector<int>(layers_per_stage.begin(), layers_per_stage.end()));
}

absl::StatusOr<StageLayout> StageLayout::Parse(absl::string_view text) {
  std::vector<absl::string_view> stages = absl::StrSplit(text, '|');
  const int n = static_cast<int>(stages.size());
  if (n > kMaxStages) {
    return absl::InvalidArgumentError(
        absl::StrCat("a layout has at most ", kMaxStages, " stages, got ", n));
  }
  std::vector<int> counts(n, 0);
  for (int s = 0; s < n; ++s) {
    std::vector<absl::string_view> items =
        absl::StrSplit(stages[s], absl::ByAnyChar(" \t\n"), absl::SkipEmpty());
    if (items.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stage ", s, " of layout '", text, "' is empty; every stage needs at least one item"));
    }
    for (size_t k = 0; k < items.size(); ++k) {
      const absl::string_view item = items[k];
      auto error = [&](absl::string_view why) {
        return absl::InvalidArgumentError(
            absl::StrCat("stage ", s, " item ", k, " '", item, "' of layout '", text, "': ", why));
      };
      if (item == "E") {
        if (s != 0 || k != 0) return error("the embedding E belongs at the start of stage 0");
        continue;
      }
      if (item == "L") {
        if (s != n - 1 || k + 1 != items.size()) {
          return error(absl::StrCat("the loss head L belongs at the end of the last stage (stage ",
                                    n - 1, ")"));
        }
        continue;
      }
      absl::string_view rest = item;
      if (!absl::ConsumePrefix(&rest, "t")) {
        return error("unknown item (expected E, t, t*n or L)");
      }
      int repeat = 1;
      if (!rest.empty()) {
        if (!absl::ConsumePrefix(&rest, "*") || !absl::SimpleAtoi(rest, &repeat) || repeat < 1 ||
            repeat > kMaxLayers) {
          return error(absl::StrCat("a repeat is t*n with n in 1..", kMaxLayers));
        }
      }
      counts[s] += repeat;
      if (counts[s] > kMaxLayers) return error(absl::StrCat("more than ", kMaxLayers, " layers"));
    }
    if (s == 0 && items.front() != "E") {
      return absl::InvalidArgumentError(
          absl::StrCat("layout '", text, "': stage 0 must start with the embedding E"));
    }
    if (s == n - 1 && items.back() != "L") {
      return absl::InvalidArgumentError(absl::StrCat("layout '", text, "': the last stage (stage ",
                                                     s, ") must end with the loss head L"));
    }
  }
  return FromCounts(counts);
}

absl::StatusOr<StageLayout> StageLayout::Balanced(const BalancedLayoutOptions& o) {
  if (o.num_layers < 0 || o.num_layers > kMaxLayers) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_layers is ", o.num_layers, "; want 0..", kMaxLayers));
  }
  if (o.num_stages < 1 || o.num_stages > kMaxStages) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_stages is ", o.num_stages, "; want 1..", kMaxStages));
  }
  for (const auto& [name, w] :
       {std::pair<const char*, double>{"embedding_weight", o.embedding_weight},
        {"loss_weight", o.loss_weight}}) {
    if (!std::isfinite(w) || w < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " is ", w, "; want a finite weight >= 0"));
    }
  }
  const double total = o.embedding_weight + o.num_layers + o.loss_weight;
  std::vector<int> counts(o.num_stages, 0);
  for (int j = 0; j < o.num_layers; ++j) {
    const double mid = o.embedding_weight + j + 0.5;
    const int s = std::min(o.num_stages - 1, static_cast<int>(mid * o.num_stages / total));
    ++counts[s];
  }
  if (absl::Status st = CheckCounts(counts); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        o.num_layers, " layers (embedding weight ", o.embedding_weight, ", loss weight ",
        o.loss_weight, ") do not fill ", o.num_stages, " stages: ", st.message()));
  }
  return FromValidCounts(std::move(counts));
}

std::string StageLayout::ToText() const {
  std::vector<std::string> stages;
  for (int s = 0; s < num_stages(); ++s) {
    std::vector<std::string> items;
    if (has_embedding(s)) items.push_back("E");
    if (counts_[s] == 1) items.push_back("t");
    if (counts_[s] > 1) items.push_back(absl::StrCat("t*", counts_[s]));
    if (has_loss(s)) items.push_back("L");
    stages.push_back(absl::StrJoin(items, " "));
  }
  return absl::StrJoin(stages, "|");
}

std::string StageLayout::Describe(int num_ranks) const {
  std::string out;
  for (int s = 0; s < num_stages(); ++s) {
    std::vector<std::string> parts;
    if (has_embedding(s)) parts.push_back("embedding");
    if (counts_[s] == 1) parts.push_back(absl::StrCat("layer ", first_[s]));
    if (counts_[s] > 1) {
      parts.push_back(absl::StrCat("layers ", first_[s], "-", first_[s] + counts_[s] - 1));
    }
    if (has_loss(s)) parts.push_back("loss");
    absl::StrAppend(&out, "stage ", s, " (rank ", num_ranks > 0 ? s % num_ranks : s,
                    "): ", absl::StrJoin(parts, ", "), "\n");
  }
  return out;
}

std::vector<double> StageLayout::StageWeights(const LayerWeights& w) const {
  std::vector<double> out(num_stages());
  for (int s = 0; s < num_stages(); ++s) {
    out[s] = counts_[s] * w.layer + (has_embedding(s) ? w.embedding : 0.0) +
             (has_loss(s) ? w.loss : 0.0);
  }
  return out;
}

absl::Status CheckLayoutFits(const StageLayout& layout, const Schedule& schedule) {
  if (layout.num_stages() != schedule.num_stages()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the layout has ", layout.num_stages(), " stages but the schedule",
                     schedule.name().empty() ? "" : absl::StrCat(" '", schedule.name(), "'"),
                     " has ", schedule.num_stages()));
  }
  return absl::OkStatus();
}

}  // namespace strata::pipeline
