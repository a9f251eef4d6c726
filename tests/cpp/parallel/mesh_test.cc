#include "strata/parallel/mesh.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>

#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace strata {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Groups = std::vector<std::vector<int>>;

MeshSpec Spec(int world, int tp, int pp, int cp = 1, int ep = 1, int etp = 0,
              const std::string& order = "tp-cp-ep-dp-pp") {
  MeshSpec s;
  s.world_size = world;
  s.tp = tp;
  s.pp = pp;
  s.cp = cp;
  s.ep = ep;
  s.etp = etp;
  s.order = order;
  return s;
}

Mesh Make(const MeshSpec& s) {
  absl::StatusOr<Mesh> m = Mesh::Create(s);
  EXPECT_TRUE(m.ok()) << m.status();
  return *m;
}

// An independent implementation of Megatron-Core's rule, written from its
// definition rather than its algorithm: rank = sum(coord_i * stride_i) with
// strides the prefix products of the sizes in order; a group is the set of
// ranks that agree on every unmasked coordinate; members are ordered by their
// masked coordinates (first axis fastest) and groups by their unmasked ones.
Groups Reference(const std::vector<int>& sizes, const std::vector<bool>& mask) {
  int world = 1, group_size = 1;
  for (size_t i = 0; i < sizes.size(); ++i) {
    world *= sizes[i];
    if (mask[i]) group_size *= sizes[i];
  }
  Groups out(world / group_size, std::vector<int>(group_size, -1));
  for (int r = 0; r < world; ++r) {
    long stride = 1, gkey = 0, mkey = 0, gmul = 1, mmul = 1;
    for (size_t i = 0; i < sizes.size(); ++i) {
      const int c = static_cast<int>((r / stride) % sizes[i]);
      stride *= sizes[i];
      if (mask[i]) {
        mkey += c * mmul;
        mmul *= sizes[i];
      } else {
        gkey += c * gmul;
        gmul *= sizes[i];
      }
    }
    out[gkey][mkey] = r;
  }
  return out;
}

// Sizes of `axes_in_order` for the reference, and the mask of `token`.
std::pair<std::vector<int>, std::vector<bool>> RefArgs(const std::vector<std::string>& order,
                                                       const std::map<std::string, int>& size,
                                                       const std::string& token) {
  std::vector<int> sizes;
  std::vector<bool> mask(order.size(), false);
  for (const std::string& a : order) sizes.push_back(size.at(a));
  for (absl::string_view t : absl::StrSplit(token, '-')) {
    mask[std::find(order.begin(), order.end(), t) - order.begin()] = true;
  }
  return {sizes, mask};
}

// ---- Megatron-Core compatibility, tables written by hand ---------------------

TEST(MeshMegatronTest, Tp2Pp4On16Ranks) {
  // Megatron-Core's documented example: 16 GPUs, tp=2, pp=4 (dp=2).
  Mesh m = Make(Spec(16, 2, 4));
  EXPECT_EQ(m.dp(), 2);
  EXPECT_EQ(m.Groups("tp")->ToVectors(),
            (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}));
  EXPECT_EQ(m.Groups("dp")->ToVectors(),
            (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(m.Groups("pp")->ToVectors(),
            (Groups{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}}));
  EXPECT_EQ(m.Groups("tp-pp")->ToVectors(),
            (Groups{{0, 1, 4, 5, 8, 9, 12, 13}, {2, 3, 6, 7, 10, 11, 14, 15}}));
  EXPECT_THAT(m.EmbeddingGroup(5).value(), ElementsAre(1, 13));
  EXPECT_EQ(m.PipelineNext(13).value(), 1);
  EXPECT_EQ(m.PipelinePrev(1).value(), 13);
}

TEST(MeshMegatronTest, Dp2Tp2Pp2On8Ranks) {
  Mesh m = Make(Spec(8, 2, 2));
  EXPECT_EQ(m.Groups("tp")->ToVectors(), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(m.Groups("dp")->ToVectors(), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(m.Groups("pp")->ToVectors(), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(m.RankAt({{"tp", 1}, {"dp", 1}, {"pp", 1}}).value(), 7);
}

TEST(MeshMegatronTest, ContextParallel) {
  // tp=2, cp=2, pp=2 on 16 ranks: dp=2; order tp-cp-ep-dp-pp.
  Mesh m = Make(Spec(16, 2, 2, 2));
  EXPECT_EQ(m.Groups("cp")->ToVectors(),
            (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(m.Groups("dp")->ToVectors(),
            (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}));
  EXPECT_EQ(m.Groups("dp-cp")->ToVectors(),
            (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}}));
  EXPECT_EQ(m.Groups("cp-dp")->ToVectors(), m.Groups("dp-cp")->ToVectors());
  EXPECT_EQ(m.Groups("pp")->ToVectors(),
            (Groups{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}}));
}

TEST(MeshMegatronTest, ExpertParallelFoldedOverDpCp) {
  // 16 ranks, tp=2, cp=2, pp=2 (dp=2), ep=4, etp=1: edp = 16/(1*4*2) = 2.
  Mesh m = Make(Spec(16, 2, 2, 2, 4, 1));
  EXPECT_EQ(m.edp(), 2);
  // Expert mesh order tp(1)-cp(1)-ep(4)-dp(2)-pp(2): ep has stride 1.
  EXPECT_EQ(m.ExpertGroups("ep")->ToVectors(),
            (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}));
  EXPECT_EQ(m.ExpertGroups("dp")->ToVectors(),
            (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}));
  EXPECT_EQ(m.ExpertGroups("tp")->num_groups(), 16);
  EXPECT_EQ(m.ExpertGroups("pp")->ToVectors(), m.Groups("pp")->ToVectors());
  EXPECT_EQ(m.ExpertGroups("tp-ep-pp")->ToVectors(),
            (Groups{{0, 1, 2, 3, 8, 9, 10, 11}, {4, 5, 6, 7, 12, 13, 14, 15}}));
}

TEST(MeshMegatronTest, ExpertTensorParallelEqualsTp) {
  // 8 ranks, tp=2, ep=2 (etp = tp = 2): edp = 8/(2*2*1) = 2, dp = 4.
  Mesh m = Make(Spec(8, 2, 1, 1, 2));
  EXPECT_EQ(m.dp(), 4);
  EXPECT_EQ(m.edp(), 2);
  EXPECT_EQ(m.ExpertGroups("ep")->ToVectors(), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(m.ExpertGroups("dp")->ToVectors(), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(m.ExpertGroups("tp-ep")->ToVectors(), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  std::map<std::string, int> c = m.Coords(6).value();
  EXPECT_EQ(c["tp"], 0);
  EXPECT_EQ(c["dp"], 3);
  EXPECT_EQ(c["ep"], 1);
  EXPECT_EQ(c["edp"], 1);
  EXPECT_EQ(m.RankAt({{"etp", 0}, {"ep", 1}, {"edp", 1}}).value(), 6);
}

TEST(MeshMegatronTest, OtherOrder) {
  // order tp-pp-dp: 8 ranks tp=2 pp=2 dp=2.
  Mesh m = Make(Spec(8, 2, 2, 1, 1, 0, "tp-pp-dp"));
  EXPECT_EQ(m.order(), (std::vector<std::string>{"tp", "pp", "dp", "cp", "ep"}));
  EXPECT_EQ(m.Groups("pp")->ToVectors(), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(m.Groups("dp")->ToVectors(), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
}

// ---- properties over every factorisation and order -----------------------------

std::vector<std::string> AllOrders() {
  std::vector<std::string> axes = {"cp", "dp", "ep", "pp", "tp"};
  std::vector<std::string> orders;
  do {
    orders.push_back(absl::StrJoin(axes, "-"));
  } while (std::next_permutation(axes.begin(), axes.end()));
  return orders;
}

const std::vector<std::string> kDenseTokens = {
    "tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-dp-cp", "tp-cp", "cp-pp", "tp-cp-dp-pp"};
const std::vector<std::string> kExpertTokens = {"tp",    "ep",       "dp",   "pp",
                                                "tp-ep", "tp-ep-pp", "ep-dp"};

// Checks every property of one mesh (fatal failures on the first problem).
// `full` = false checks only the single axes against the reference: used for
// orders that differ from an already-checked one only in where size-1 axes sit.
void CheckMesh(const Mesh& m, bool full) {
  const int w = m.world_size();
  const std::map<std::string, int> dense = {
      {"tp", m.tp()}, {"cp", m.cp()}, {"ep", 1}, {"dp", m.dp()}, {"pp", m.pp()}};
  const std::map<std::string, int> expert = {
      {"tp", m.etp()}, {"cp", 1}, {"ep", m.ep()}, {"dp", m.edp()}, {"pp", m.pp()}};
  for (bool is_expert : {false, true}) {
    const auto& sizes = is_expert ? expert : dense;
    for (const std::string& token : is_expert ? kExpertTokens : kDenseTokens) {
      if (!full && token.find('-') != std::string::npos) continue;
      absl::StatusOr<RankGroups> g = is_expert ? m.ExpertGroups(token) : m.Groups(token);
      ASSERT_TRUE(g.ok()) << g.status();
      int expected_size = 1;
      for (absl::string_view t : absl::StrSplit(token, '-'))
        expected_size *= sizes.at(std::string(t));
      ASSERT_EQ(g->group_size(), expected_size) << token;
      // Partition: every rank exactly once.
      std::vector<int> seen(w, 0);
      for (int r : g->flat()) {
        ASSERT_TRUE(r >= 0 && r < w) << token << " rank " << r;
        ++seen[r];
      }
      ASSERT_TRUE(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; })) << token;
      // Same groups as the independent reference, in the same order.
      auto [ref_sizes, mask] = RefArgs(m.order(), sizes, token);
      ASSERT_EQ(g->ToVectors(), Reference(ref_sizes, mask))
          << (is_expert ? "expert " : "") << token << " order " << m.spec().order;
      // GroupOf agrees with Groups.
      for (int gi = 0; gi < g->num_groups(); gi += std::max(1, g->num_groups() / 3)) {
        absl::Span<const int> grp = g->group(gi);
        const int r = grp[grp.size() / 2];
        absl::StatusOr<std::vector<int>> of =
            is_expert ? m.ExpertGroupOf(r, token) : m.GroupOf(r, token);
        ASSERT_TRUE(std::equal(grp.begin(), grp.end(), of->begin(), of->end())) << token;
      }
    }
  }
  if (!full) return;
  // A combined group is the union of its axes: the dp-cp group of r holds the
  // cp groups of the members of r's dp group.
  for (int r = 0; r < w; r += std::max(1, w / 5)) {
    std::set<int> combined;
    const std::vector<int> dp_group = m.GroupOf(r, "dp").value();
    for (int x : dp_group) {
      const std::vector<int> cp_group = m.GroupOf(x, "cp").value();
      combined.insert(cp_group.begin(), cp_group.end());
    }
    std::vector<int> dpcp = m.GroupOf(r, "dp-cp").value();
    ASSERT_EQ(combined, std::set<int>(dpcp.begin(), dpcp.end()));
  }
  // Coordinates <-> rank is a bijection, on both meshes: RankAt inverts
  // Coords (so Coords is injective), and every coordinate is in range.
  for (int r = 0; r < w; ++r) {
    std::map<std::string, int> c = m.Coords(r).value();
    ASSERT_EQ(m.RankAt(c).value(), r);
    c.erase("etp");
    c.erase("ep");
    c.erase("edp");
    ASSERT_EQ(m.RankAt(c).value(), r);
  }
}

class MeshPropertyTest : public ::testing::TestWithParam<int> {};

TEST_P(MeshPropertyTest, EveryFactorisationAndOrder) {
  const int w = GetParam();
  static const std::vector<std::string> orders = AllOrders();
  int meshes = 0;
  for (int tp = 1; tp <= w; ++tp) {
    if (w % tp) continue;
    for (int cp = 1; cp <= w / tp; ++cp) {
      if ((w / tp) % cp) continue;
      for (int pp = 1; pp <= w / tp / cp; ++pp) {
        if ((w / tp / cp) % pp) continue;
        const int dp = w / tp / cp / pp;
        std::set<std::string> checked;
        // ep: every divisor of dp*cp (etp = tp), plus etp = 1 variants.
        for (int ep = 1; ep <= dp * cp; ++ep) {
          if ((dp * cp) % ep) continue;
          for (int etp : {0, 1}) {
            if (etp == 1 && (tp == 1 || w % (ep * pp) != 0)) continue;
            for (const std::string& order : orders) {
              absl::StatusOr<Mesh> m = Mesh::Create(Spec(w, tp, pp, cp, ep, etp, order));
              if (!m.ok()) {
                // Only the documented expert-layout rules may reject a valid
                // factorisation.
                ASSERT_TRUE(ep > 1 || etp == 1) << m.status();
                ASSERT_THAT(m.status().message(),
                            testing::AnyOf(HasSubstr("does not end with pp"),
                                           HasSubstr("pipeline groups of the expert mesh")));
                continue;
              }
              ++meshes;
              // The layout depends only on the relative order of axes of
              // size > 1 on each mesh.
              std::string signature = std::to_string(ep) + "," + std::to_string(etp) + ":";
              for (const std::string& a : m->order()) {
                const int dense = a == "tp"   ? tp
                                  : a == "cp" ? cp
                                  : a == "dp" ? dp
                                  : a == "pp" ? pp
                                              : 1;
                const int expert = a == "tp"   ? m->etp()
                                   : a == "ep" ? ep
                                   : a == "dp" ? m->edp()
                                   : a == "pp" ? pp
                                               : 1;
                signature += (dense > 1 ? a : "") + "/" + (expert > 1 ? a : "") + ";";
              }
              CheckMesh(*m, checked.insert(signature).second);
              if (HasFatalFailure()) {
                FAIL() << "world " << w << " tp " << tp << " cp " << cp << " pp " << pp << " ep "
                       << ep << " etp " << etp << " order " << order;
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GT(meshes, 0);
}

INSTANTIATE_TEST_SUITE_P(Worlds1To64, MeshPropertyTest, ::testing::Range(1, 65));

// ---- errors ---------------------------------------------------------------------

std::string ErrorOf(const MeshSpec& s) {
  absl::StatusOr<Mesh> m = Mesh::Create(s);
  EXPECT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(m.status().message());
}

TEST(MeshErrorTest, WorldNotDivisible) {
  EXPECT_EQ(ErrorOf(Spec(12, 4, 2)),
            "world size 12 is not divisible by tp*cp*pp = 8 (tp 4, cp 1, pp 2)");
}

TEST(MeshErrorTest, AxisSizeBelowOne) {
  EXPECT_THAT(ErrorOf(Spec(8, 0, 1)), HasSubstr("mesh axis tp has size 0"));
  EXPECT_THAT(ErrorOf(Spec(8, 1, -2)), HasSubstr("mesh axis pp has size -2"));
  MeshSpec s = Spec(8, 1, 1);
  s.dp = -1;
  EXPECT_THAT(ErrorOf(s), HasSubstr("mesh axis dp has size -1"));
  EXPECT_THAT(ErrorOf(Spec(0, 1, 1)), HasSubstr("world size 0 < 1"));
}

TEST(MeshErrorTest, ExplicitDpMustFit) {
  MeshSpec s = Spec(8, 2, 2);
  s.dp = 4;
  EXPECT_THAT(ErrorOf(s), HasSubstr("dp 4 does not fit: tp*cp*dp*pp = 16 but world size is 8"));
  s.dp = 2;
  EXPECT_TRUE(Mesh::Create(s).ok());
}

TEST(MeshErrorTest, Orders) {
  EXPECT_THAT(ErrorOf(Spec(8, 2, 2, 1, 1, 0, "tp-xp-dp-pp")), HasSubstr("unknown axis 'xp'"));
  EXPECT_THAT(ErrorOf(Spec(8, 2, 2, 1, 1, 0, "tp-dp-tp-pp")),
              HasSubstr("axis 'tp' appears twice in order 'tp-dp-tp-pp'"));
  EXPECT_THAT(ErrorOf(Spec(8, 2, 2, 1, 1, 0, "tp-dp")),
              HasSubstr("axis pp has size 2 but is missing from order 'tp-dp'"));
  EXPECT_THAT(ErrorOf(Spec(8, 2, 1, 1, 2, 0, "tp-dp-pp")),
              HasSubstr("axis ep has size 2 but is missing"));
  // Size-1 axes may be left out and are appended.
  EXPECT_TRUE(Mesh::Create(Spec(8, 2, 2, 1, 1, 0, "tp-dp-pp")).ok());
}

TEST(MeshErrorTest, ExpertRules) {
  // ep must divide dp*cp when etp == tp.
  EXPECT_THAT(ErrorOf(Spec(12, 2, 1, 1, 4)),
              HasSubstr("ep 4 does not divide dp*cp = 6 (dp 6, cp 1)"));
  // With a different etp: world divisible by etp*ep*pp.
  EXPECT_THAT(ErrorOf(Spec(12, 2, 1, 1, 3, 8)),
              HasSubstr("world size 12 is not divisible by etp*ep*pp = 24"));
  // pp not last and expert-DP differing from DP.
  EXPECT_THAT(ErrorOf(Spec(16, 2, 2, 1, 2, 0, "tp-pp-ep-dp-cp")),
              HasSubstr("does not end with pp"));
}

TEST(MeshErrorTest, BadQueries) {
  Mesh m = Make(Spec(8, 2, 2, 1, 2));
  EXPECT_THAT(m.Groups("ep").status().message(), HasSubstr("axis of the expert mesh"));
  EXPECT_THAT(m.ExpertGroups("cp").status().message(), HasSubstr("not an axis of the expert mesh"));
  EXPECT_THAT(m.Groups("tp-zz").status().message(), HasSubstr("unknown axis 'zz'"));
  EXPECT_THAT(m.Groups("tp-tp").status().message(), HasSubstr("appears twice"));
  EXPECT_THAT(m.GroupOf(8, "tp").status().message(),
              HasSubstr("rank 8 is not in [0, world size 8)"));
  EXPECT_THAT(m.Coords(-1).status().message(), HasSubstr("rank -1"));
  EXPECT_THAT(m.RankAt({{"tp", 2}}).status().message(),
              HasSubstr("coordinate tp=2 is not in [0, 2)"));
  EXPECT_THAT(m.RankAt({{"xx", 0}}).status().message(), HasSubstr("unknown coordinate 'xx'"));
  EXPECT_THAT(m.RankAt({{"tp", 1}, {"ep", 1}}).status().message(),
              HasSubstr("dense coordinates name rank 1 but expert coordinates name rank 2"));
}

// ---- topology check and describe --------------------------------------------------

TEST(MeshTopologyTest, TpAcrossNodesIsReportedWithAFix) {
  // tp=4 with order dp-tp-pp on 2 nodes of 4: tp has stride 2, spans nodes.
  MeshSpec s = Spec(8, 4, 1, 1, 1, 0, "dp-tp-pp");
  s.ranks_per_node = 4;
  Mesh m = Make(s);
  std::vector<TopologyWarning> w = m.CheckTopology();
  ASSERT_EQ(w.size(), 1u);
  EXPECT_EQ(w[0].axis, "tp");
  EXPECT_EQ(w[0].groups_spanning, 2);
  EXPECT_THAT(w[0].message, HasSubstr("2 of 2 tp groups (size 4) span more than one node of 4"));
  EXPECT_THAT(w[0].suggestion, HasSubstr("keeps every tp group inside a node"));
  // The suggested order indeed fixes it.
  std::string suggested = w[0].suggestion.substr(w[0].suggestion.find('\'') + 1);
  suggested = suggested.substr(0, suggested.find('\''));
  s.order = suggested;
  EXPECT_TRUE(Make(s).CheckTopology().empty());
  // The default order keeps tp in a node.
  EXPECT_TRUE(Make(Spec(8, 4, 1)).CheckTopology(4).empty());
}

TEST(MeshTopologyTest, AxisLargerThanNode) {
  Mesh m = Make(Spec(16, 8, 1));
  std::vector<TopologyWarning> w = m.CheckTopology(4);
  ASSERT_EQ(w.size(), 1u);
  EXPECT_THAT(w[0].suggestion, HasSubstr("tp=8 is larger than a node (4 ranks)"));
}

TEST(MeshTopologyTest, ExpertGroupsChecked) {
  // ep=4 over dp with tp=2: ep stride 2, an ep group covers 8 ranks.
  Mesh m = Make(Spec(16, 2, 1, 1, 4));
  std::vector<TopologyWarning> w = m.CheckTopology(4);
  ASSERT_EQ(w.size(), 1u);
  EXPECT_EQ(w[0].axis, "ep");
}

TEST(MeshDescribeTest, ShowsEveryAxis) {
  Mesh m = Make(Spec(8, 2, 2));
  std::string d = m.Describe();
  EXPECT_THAT(d, HasSubstr("8 ranks = tp 2 x cp 1 x dp 2 x pp 2"));
  EXPECT_THAT(d, HasSubstr("[0 1] [2 3] [4 5] [6 7]"));
  EXPECT_THAT(d, HasSubstr("[0 2] [1 3] [4 6] [5 7]"));
  EXPECT_THAT(d, HasSubstr("[0 4] [1 5] [2 6] [3 7]"));
  std::string big = Make(Spec(1024, 8, 4)).Describe(2);
  EXPECT_THAT(big, HasSubstr("(30 more)"));
  EXPECT_THAT(big, HasSubstr("(32 ranks)"));
}

}  // namespace
}  // namespace strata
