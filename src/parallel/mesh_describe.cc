// Mesh::Describe and Mesh::CheckTopology: the human-facing views of a mesh.
#include <algorithm>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "strata/parallel/mesh.h"

namespace strata {
namespace {

// "[0 1 2 3]", eliding the middle of long groups.
std::string FormatGroup(absl::Span<const int> g) {
  constexpr size_t kMax = 12;
  if (g.size() <= kMax) return absl::StrCat("[", absl::StrJoin(g, " "), "]");
  return absl::StrCat("[", absl::StrJoin(g.subspan(0, kMax - 2), " "), " ... ", g[g.size() - 1],
                      "] (", g.size(), " ranks)");
}

// How many groups contain ranks of more than one node.
int GroupsSpanningNodes(const RankGroups& groups, int ranks_per_node) {
  int spanning = 0;
  for (int g = 0; g < groups.num_groups(); ++g) {
    absl::Span<const int> members = groups.group(g);
    const int node = members[0] / ranks_per_node;
    for (int r : members) {
      if (r / ranks_per_node != node) {
        ++spanning;
        break;
      }
    }
  }
  return spanning;
}

struct AxisCheck {
  const char* axis;
  bool expert;
  int size;
};

// Spanning counts for tp, cp and ep (in that priority) under `mesh`.
std::array<int, 3> Spans(const Mesh& mesh, int ranks_per_node) {
  const AxisCheck checks[] = {
      {"tp", false, mesh.tp()}, {"cp", false, mesh.cp()}, {"ep", true, mesh.ep()}};
  std::array<int, 3> spans{};
  for (size_t i = 0; i < 3; ++i) {
    if (checks[i].size <= 1) continue;
    absl::StatusOr<RankGroups> groups =
        checks[i].expert ? mesh.ExpertGroups(checks[i].axis) : mesh.Groups(checks[i].axis);
    if (groups.ok()) spans[i] = GroupsSpanningNodes(*groups, ranks_per_node);
  }
  return spans;
}

}  // namespace

std::vector<TopologyWarning> Mesh::CheckTopology(int ranks_per_node) const {
  if (ranks_per_node <= 0) ranks_per_node = spec_.ranks_per_node;
  if (ranks_per_node <= 0 || ranks_per_node >= spec_.world_size) return {};

  const std::array<int, 3> spans = Spans(*this, ranks_per_node);
  const AxisCheck checks[] = {
      {"tp", false, spec_.tp}, {"cp", false, spec_.cp}, {"ep", true, spec_.ep}};
  if (spans == std::array<int, 3>{}) return {};

  // Search the other orders of the same sizes for one that keeps more of the
  // axes (tp first, then cp, then ep) inside a node, preferring the order
  // closest to the current one.
  std::vector<std::string> order = order_;
  std::vector<std::string> candidate = order;
  std::sort(candidate.begin(), candidate.end());
  std::optional<std::tuple<std::array<int, 3>, int, std::string>> best;
  do {
    MeshSpec s = spec_;
    s.order = absl::StrJoin(candidate, "-");
    absl::StatusOr<Mesh> m = Mesh::Create(s);
    if (!m.ok()) continue;
    // Kendall distance: pairs of axes whose relative order changed.
    int distance = 0;
    for (size_t i = 0; i < candidate.size(); ++i) {
      for (size_t j = i + 1; j < candidate.size(); ++j) {
        const auto pi = std::find(order.begin(), order.end(), candidate[i]);
        const auto pj = std::find(order.begin(), order.end(), candidate[j]);
        distance += pi > pj;
      }
    }
    auto score = std::make_tuple(Spans(*m, ranks_per_node), distance, s.order);
    if (!best || score < *best) best = score;
  } while (std::next_permutation(candidate.begin(), candidate.end()));

  std::vector<TopologyWarning> warnings;
  for (size_t i = 0; i < 3; ++i) {
    if (spans[i] == 0) continue;
    const AxisCheck& c = checks[i];
    TopologyWarning w;
    w.axis = c.axis;
    w.groups_spanning = spans[i];
    const int num_groups = spec_.world_size / c.size;
    w.message = absl::StrCat(spans[i], " of ", num_groups, " ", c.axis, " groups (size ", c.size,
                             ") span more than one node of ", ranks_per_node, " ranks with order '",
                             spec_.order, "'");
    if (c.size > ranks_per_node) {
      w.suggestion = absl::StrCat(c.axis, "=", c.size, " is larger than a node (", ranks_per_node,
                                  " ranks): no order keeps it in one node; use ", c.axis,
                                  " <= ", ranks_per_node);
    } else if (best && std::get<0>(*best)[i] == 0) {
      w.suggestion = absl::StrCat("order '", std::get<2>(*best), "' keeps every ", c.axis,
                                  " group inside a node");
    } else if (ranks_per_node % c.size != 0) {
      w.suggestion = absl::StrCat(c.axis, "=", c.size, " does not divide the ", ranks_per_node,
                                  " ranks of a node; choose a divisor of ", ranks_per_node);
    } else {
      w.suggestion = absl::StrCat("no order of these sizes keeps ", c.axis,
                                  " inside a node together with the axes before it; reduce the "
                                  "product of the sizes of tp, cp and ep to at most ",
                                  ranks_per_node);
    }
    warnings.push_back(std::move(w));
  }
  return warnings;
}

std::string Mesh::Describe(int max_groups) const {
  const MeshSpec& s = spec_;
  std::string out = absl::StrFormat("mesh: %d ranks = tp %d x cp %d x dp %d x pp %d, order %s\n",
                                    s.world_size, s.tp, s.cp, s.dp, s.pp, s.order);
  const bool has_expert = s.ep > 1 || s.etp != s.tp;
  if (has_expert) {
    absl::StrAppendFormat(&out, "expert mesh: etp %d x ep %d x edp %d x pp %d\n", s.etp, s.ep, edp_,
                          s.pp);
  }
  struct Row {
    std::string label;
    std::string axes;
    bool expert;
  };
  std::vector<Row> rows = {
      {"tp", "tp", false}, {"cp", "cp", false}, {"dp", "dp", false}, {"pp", "pp", false}};
  if (s.cp > 1) rows.push_back({"dp-cp", "dp-cp", false});
  if (s.tp > 1 && s.pp > 1) rows.push_back({"tp-pp (model)", "tp-pp", false});
  if (has_expert) {
    rows.push_back({"expert ep", "ep", true});
    rows.push_back({"expert tp", "tp", true});
    rows.push_back({"expert dp", "dp", true});
  }
  absl::StrAppendFormat(&out, "%-14s %6s %7s  %s\n", "axis", "size", "groups", "ranks");
  for (const Row& row : rows) {
    absl::StatusOr<RankGroups> groups = row.expert ? ExpertGroups(row.axes) : Groups(row.axes);
    if (!groups.ok()) continue;
    std::vector<std::string> shown;
    const int n = groups->num_groups();
    for (int g = 0; g < n && g < max_groups; ++g) shown.push_back(FormatGroup(groups->group(g)));
    if (n > max_groups) shown.push_back(absl::StrCat("... (", n - max_groups, " more)"));
    absl::StrAppendFormat(&out, "%-14s %6d %7d  %s\n", row.label, groups->group_size(), n,
                          absl::StrJoin(shown, " "));
  }
  if (s.pp > 1) {
    absl::StatusOr<std::vector<int>> emb = EmbeddingGroup(0);
    if (emb.ok()) {
      absl::StrAppendFormat(&out, "embedding group of rank 0 (first and last stage): %s\n",
                            FormatGroup(*emb));
    }
  }
  for (const TopologyWarning& w : CheckTopology()) {
    absl::StrAppend(&out, "warning: ", w.message, "; ", w.suggestion, "\n");
  }
  return out;
}

}  // namespace strata
