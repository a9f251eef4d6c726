#include "strata/parallel/mesh.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "strata/base/status.h"

namespace strata {
namespace {

int AxisIndex(absl::string_view name) {
  for (size_t i = 0; i < Mesh::kAxisNames.size(); ++i) {
    if (name == Mesh::kAxisNames[i]) return static_cast<int>(i);
  }
  return -1;
}

// Canonical index -> size, for the dense and the expert mesh.
std::array<int, 5> DenseSizes(const MeshSpec& s) { return {s.tp, s.cp, 1, s.dp, s.pp}; }
std::array<int, 5> ExpertSizes(const MeshSpec& s, int edp) { return {s.etp, 1, s.ep, edp, s.pp}; }

std::string SpecSummary(const MeshSpec& s) {
  return absl::StrCat("tp ", s.tp, ", cp ", s.cp, ", pp ", s.pp, ", dp ", s.dp, ", ep ", s.ep,
                      ", etp ", s.etp);
}

}  // namespace

RankGroups::RankGroups(int group_size, std::vector<int> ranks)
    : group_size_(group_size), ranks_(std::move(ranks)) {}

std::vector<std::vector<int>> RankGroups::ToVectors() const {
  std::vector<std::vector<int>> out;
  out.reserve(num_groups());
  for (int g = 0; g < num_groups(); ++g) {
    absl::Span<const int> s = group(g);
    out.emplace_back(s.begin(), s.end());
  }
  return out;
}

absl::StatusOr<Mesh> Mesh::Create(const MeshSpec& in) {
  MeshSpec spec = in;
  if (spec.version != MeshSpec::kVersion) {
    return absl::InvalidArgumentError(absl::StrCat("MeshSpec version ", spec.version,
                                                   " is not supported (this build reads version ",
                                                   MeshSpec::kVersion, ")"));
  }
  if (spec.world_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("world size ", spec.world_size, " < 1"));
  }
  const std::pair<const char*, int> sizes[] = {
      {"tp", spec.tp}, {"pp", spec.pp}, {"cp", spec.cp}, {"ep", spec.ep}};
  for (const auto& [name, size] : sizes) {
    if (size < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("mesh axis ", name, " has size ", size, "; every axis size must be >= 1"));
    }
  }
  if (spec.etp < 0 || spec.dp < 0) {
    return absl::InvalidArgumentError(absl::StrCat("mesh axis ", spec.etp < 0 ? "etp" : "dp",
                                                   " has size ", spec.etp < 0 ? spec.etp : spec.dp,
                                                   "; every axis size must be >= 1"));
  }
  if (spec.ranks_per_node < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ranks_per_node ", spec.ranks_per_node, " < 0 (0 means unknown)"));
  }
  if (spec.etp == 0) spec.etp = spec.tp;

  // Dense mesh: world = tp * cp * dp * pp.
  const long model = static_cast<long>(spec.tp) * spec.cp * spec.pp;
  if (spec.world_size % model != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("world size ", spec.world_size, " is not divisible by tp*cp*pp = ", model,
                     " (tp ", spec.tp, ", cp ", spec.cp, ", pp ", spec.pp, ")"));
  }
  const long inferred_dp = spec.world_size / model;
  if (spec.dp == 0) {
    spec.dp = static_cast<int>(inferred_dp);
  } else if (spec.dp != inferred_dp) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dp ", spec.dp, " does not fit: tp*cp*dp*pp = ", model * spec.dp, " but world size is ",
        spec.world_size, " (leave dp unset to infer ", inferred_dp, ")"));
  }

  // Expert mesh: world = etp * ep * edp * pp; ep is carved out of dp*cp.
  const long expert_model = static_cast<long>(spec.etp) * spec.ep * spec.pp;
  if (spec.world_size % expert_model != 0) {
    if (spec.etp == spec.tp) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ep ", spec.ep, " does not divide dp*cp = ", static_cast<long>(spec.dp) * spec.cp,
          " (dp ", spec.dp, ", cp ", spec.cp,
          "): expert parallelism is carved out of data and context parallelism"));
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "world size ", spec.world_size, " is not divisible by etp*ep*pp = ", expert_model, " (etp ",
        spec.etp, ", ep ", spec.ep, ", pp ", spec.pp, ")"));
  }

  // Order: known axes, no repeats, every axis > 1 present; missing axes of
  // size 1 are appended (as Megatron-Core does).
  std::vector<std::string> order;
  for (absl::string_view token : absl::StrSplit(spec.order, '-')) {
    if (AxisIndex(token) < 0) {
      return absl::InvalidArgumentError(absl::StrCat("unknown axis '", token, "' in order '",
                                                     spec.order, "' (axes: tp, cp, ep, dp, pp)"));
    }
    if (std::find(order.begin(), order.end(), token) != order.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("axis '", token, "' appears twice in order '", spec.order, "'"));
    }
    order.emplace_back(token);
  }
  const int edp = static_cast<int>(spec.world_size / expert_model);
  const std::array<int, 5> dense = DenseSizes(spec);
  const std::array<int, 5> expert = ExpertSizes(spec, edp);
  for (size_t i = 0; i < kAxisNames.size(); ++i) {
    if (std::find(order.begin(), order.end(), kAxisNames[i]) != order.end()) continue;
    const int size = std::max(dense[i], expert[i]);
    if (size != 1) {
      return absl::InvalidArgumentError(absl::StrCat("axis ", kAxisNames[i], " has size ", size,
                                                     " but is missing from order '", spec.order,
                                                     "'"));
    }
    order.emplace_back(kAxisNames[i]);
  }

  Mesh mesh;
  mesh.order_ = order;
  for (size_t i = 0; i < order.size(); ++i)
    mesh.position_[AxisIndex(order[i])] = static_cast<int>(i);
  mesh.edp_ = edp;
  long ds = 1, es = 1;
  for (size_t i = 0; i < order.size(); ++i) {
    const int axis = AxisIndex(order[i]);
    mesh.dense_.sizes[i] = dense[axis];
    mesh.dense_.strides[i] = ds;
    ds *= dense[axis];
    mesh.expert_.sizes[i] = expert[axis];
    mesh.expert_.strides[i] = es;
    es *= expert[axis];
  }
  spec.order = absl::StrJoin(order, "-");
  mesh.spec_ = spec;

  // Megatron-Core's rules tying the expert mesh to the dense one: both must
  // place every pipeline stage on the same ranks.
  if (spec.ep > 1 || spec.etp != spec.tp) {
    const bool pp_last = order.back() == "pp";
    if (!pp_last && spec.pp > 1 && edp != spec.dp) {
      return absl::InvalidArgumentError(absl::StrCat(
          "order '", spec.order, "' does not end with pp, so expert-DP (", edp, ") must equal DP (",
          spec.dp, "); put pp last or choose ep/etp with etp*ep = tp*cp (", SpecSummary(spec),
          ")"));
    }
    STRATA_ASSIGN_OR_RETURN(RankGroups dense_pp, mesh.Groups("pp"));
    STRATA_ASSIGN_OR_RETURN(RankGroups expert_pp, mesh.ExpertGroups("pp"));
    if (dense_pp.flat() != expert_pp.flat()) {
      for (int g = 0; g < dense_pp.num_groups(); ++g) {
        if (!std::equal(dense_pp.group(g).begin(), dense_pp.group(g).end(),
                        expert_pp.group(g).begin())) {
          return absl::InvalidArgumentError(
              absl::StrCat("pipeline groups of the expert mesh differ from the dense mesh (group ",
                           g, ": [", absl::StrJoin(dense_pp.group(g), " "), "] vs [",
                           absl::StrJoin(expert_pp.group(g), " "), "]) for order '", spec.order,
                           "' and ", SpecSummary(spec), "; put pp last in the order"));
        }
      }
    }
  }
  return mesh;
}

absl::Status Mesh::CheckRank(int rank) const {
  if (rank < 0 || rank >= spec_.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is not in [0, world size ", spec_.world_size, ")"));
  }
  return absl::OkStatus();
}

namespace {

// Parses "dp-cp" into a mask over positions of `order`.
absl::StatusOr<std::array<bool, 5>> ParseAxes(const std::array<int, 5>& position,
                                              absl::string_view axes, bool expert) {
  std::array<bool, 5> mask{};
  if (axes.empty()) return absl::InvalidArgumentError("empty axis name");
  for (absl::string_view token : absl::StrSplit(axes, '-')) {
    absl::string_view name = token;
    if (expert && name == "etp") name = "tp";
    if (expert && name == "edp") name = "dp";
    const int axis = AxisIndex(name);
    if (axis < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown axis '", token, "' in '", axes, "' (",
          expert ? "expert axes: tp (expert-TP), ep, dp (expert-DP), pp" : "axes: tp, cp, dp, pp",
          ")"));
    }
    if (!expert && name == "ep") {
      return absl::InvalidArgumentError(absl::StrCat(
          "'ep' in '", axes, "' is an axis of the expert mesh; use ExpertGroups / expert_groups"));
    }
    if (expert && name == "cp") {
      return absl::InvalidArgumentError(
          absl::StrCat("'cp' in '", axes,
                       "' is not an axis of the expert mesh (expert parallelism folds cp into ep "
                       "and expert-DP)"));
    }
    const int pos = position[axis];
    if (mask[pos]) {
      return absl::InvalidArgumentError(
          absl::StrCat("axis '", token, "' appears twice in '", axes, "'"));
    }
    mask[pos] = true;
  }
  return mask;
}

}  // namespace

absl::StatusOr<RankGroups> Mesh::GroupsIn(const Layout& layout, absl::string_view axes,
                                          bool expert) const {
  STRATA_ASSIGN_OR_RETURN(auto mask, ParseAxes(position_, axes, expert));
  // Offsets of each member relative to its group's base: a mixed-radix count
  // over the masked axes, fastest first.
  std::vector<long> offsets{0};
  std::vector<std::pair<int, long>> unmasked;  // (size, stride)
  for (size_t i = 0; i < 5; ++i) {
    const int size = layout.sizes[i];
    if (!mask[i]) {
      if (size > 1) unmasked.emplace_back(size, layout.strides[i]);
      continue;
    }
    const size_t before = offsets.size();
    offsets.reserve(before * size);
    for (int c = 1; c < size; ++c) {
      for (size_t k = 0; k < before; ++k) offsets.push_back(offsets[k] + c * layout.strides[i]);
    }
  }
  const int group_size = static_cast<int>(offsets.size());
  std::vector<int> ranks(static_cast<size_t>(spec_.world_size));
  std::vector<int> counter(unmasked.size(), 0);
  long base = 0;
  for (size_t out = 0; out < ranks.size(); out += group_size) {
    for (int r = 0; r < group_size; ++r) ranks[out + r] = static_cast<int>(base + offsets[r]);
    // Next group: increment the unmasked counter, fastest axis first.
    for (size_t d = 0; d < unmasked.size(); ++d) {
      base += unmasked[d].second;
      if (++counter[d] < unmasked[d].first) break;
      base -= unmasked[d].second * unmasked[d].first;
      counter[d] = 0;
    }
  }
  return RankGroups(group_size, std::move(ranks));
}

absl::StatusOr<std::vector<int>> Mesh::GroupOfIn(const Layout& layout, int rank,
                                                 absl::string_view axes, bool expert) const {
  STRATA_RETURN_IF_ERROR(CheckRank(rank));
  STRATA_ASSIGN_OR_RETURN(auto mask, ParseAxes(position_, axes, expert));
  long base = rank;
  std::vector<long> offsets{0};
  for (size_t i = 0; i < 5; ++i) {
    if (!mask[i]) continue;
    const int size = layout.sizes[i];
    base -= (rank / layout.strides[i]) % size * layout.strides[i];
    const size_t before = offsets.size();
    for (int c = 1; c < size; ++c) {
      for (size_t k = 0; k < before; ++k) offsets.push_back(offsets[k] + c * layout.strides[i]);
    }
  }
  std::vector<int> group(offsets.size());
  for (size_t k = 0; k < offsets.size(); ++k) group[k] = static_cast<int>(base + offsets[k]);
  return group;
}

absl::StatusOr<RankGroups> Mesh::Groups(absl::string_view axes) const {
  return GroupsIn(dense_, axes, false);
}
absl::StatusOr<RankGroups> Mesh::ExpertGroups(absl::string_view axes) const {
  return GroupsIn(expert_, axes, true);
}
absl::StatusOr<std::vector<int>> Mesh::GroupOf(int rank, absl::string_view axes) const {
  return GroupOfIn(dense_, rank, axes, false);
}
absl::StatusOr<std::vector<int>> Mesh::ExpertGroupOf(int rank, absl::string_view axes) const {
  return GroupOfIn(expert_, rank, axes, true);
}

absl::StatusOr<std::map<std::string, int>> Mesh::Coords(int rank) const {
  STRATA_RETURN_IF_ERROR(CheckRank(rank));
  std::map<std::string, int> coords;
  const bool has_expert = spec_.ep > 1 || spec_.etp != spec_.tp;
  for (size_t i = 0; i < 5; ++i) {
    const std::string& name = order_[i];
    const int dense = static_cast<int>((rank / dense_.strides[i]) % dense_.sizes[i]);
    const int expert = static_cast<int>((rank / expert_.strides[i]) % expert_.sizes[i]);
    if (name != "ep") coords[name] = dense;
    if (!has_expert) continue;
    if (name == "tp") coords["etp"] = expert;
    if (name == "ep") coords["ep"] = expert;
    if (name == "dp") coords["edp"] = expert;
  }
  return coords;
}

absl::StatusOr<int> Mesh::RankAt(const std::map<std::string, int>& coords) const {
  long dense_rank = 0, expert_rank = 0;
  bool any_dense = false, any_expert = false;
  for (const auto& [name, value] : coords) {
    // Which mesh and canonical axis the name refers to.
    const bool pp = name == "pp";
    const bool dense = name == "tp" || name == "cp" || name == "dp";
    const bool expert = name == "etp" || name == "ep" || name == "edp";
    if (!pp && !dense && !expert) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown coordinate '", name, "' (dense: tp, cp, dp, pp; expert: etp, ep, edp, pp)"));
    }
    absl::string_view axis = name;
    if (name == "etp") axis = "tp";
    if (name == "edp") axis = "dp";
    const int pos = position_[AxisIndex(axis)];
    const int size = expert ? expert_.sizes[pos] : dense_.sizes[pos];
    if (value < 0 || value >= size) {
      return absl::InvalidArgumentError(
          absl::StrCat("coordinate ", name, "=", value, " is not in [0, ", size, ")"));
    }
    if (!expert) {
      dense_rank += value * dense_.strides[pos];
      any_dense |= !pp;
    }
    if (!dense) {
      expert_rank += value * expert_.strides[pos];
      any_expert |= !pp;
    }
  }
  if (any_dense && any_expert && dense_rank != expert_rank) {
    return absl::InvalidArgumentError(absl::StrCat("dense coordinates name rank ", dense_rank,
                                                   " but expert coordinates name rank ",
                                                   expert_rank, "; give one kind"));
  }
  return static_cast<int>(any_expert && !any_dense ? expert_rank : dense_rank);
}

absl::StatusOr<int> Mesh::PipelineNext(int rank) const {
  STRATA_ASSIGN_OR_RETURN(std::vector<int> group, GroupOf(rank, "pp"));
  const size_t i = std::find(group.begin(), group.end(), rank) - group.begin();
  return group[(i + 1) % group.size()];
}

absl::StatusOr<int> Mesh::PipelinePrev(int rank) const {
  STRATA_ASSIGN_OR_RETURN(std::vector<int> group, GroupOf(rank, "pp"));
  const size_t i = std::find(group.begin(), group.end(), rank) - group.begin();
  return group[(i + group.size() - 1) % group.size()];
}

absl::StatusOr<std::vector<int>> Mesh::EmbeddingGroup(int rank) const {
  STRATA_ASSIGN_OR_RETURN(std::vector<int> group, GroupOf(rank, "pp"));
  if (group.size() == 1) return group;
  return std::vector<int>{group.front(), group.back()};
}

}  // namespace strata
