// PlanRegroup over every failed set of every 8-rank mesh of dp, tp, pp, cp
// and ep (and a few orders), against a reference built from each rank's
// coordinates: a replica is the ranks sharing the dp coordinate (the expert
// dp coordinate when ep > 1).
#include "strata/elastic/membership.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "strata/comm/store.h"
#include "strata/elastic/agreement.h"
#include "strata/elastic/options.h"

namespace strata::elastic {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

MeshSpec Spec(int tp, int pp, int cp = 1, int ep = 1, const std::string& order = "tp-cp-ep-dp-pp") {
  MeshSpec s;
  s.world_size = 8;
  s.tp = tp;
  s.pp = pp;
  s.cp = cp;
  s.ep = ep;
  s.order = order;
  return s;
}

// The replica key of `rank`: its dp coordinate, or its expert-dp one.
int ReplicaKey(const Mesh& mesh, int rank) {
  std::map<std::string, int> c = *mesh.Coords(rank);
  return mesh.ep() > 1 ? c.at("edp") : c.at("dp");
}

TEST(PlanRegroupTest, EveryFailedSetOfEveryMeshOfEightRanks) {
  const std::vector<MeshSpec> specs = {
      Spec(1, 1),
      Spec(2, 1),
      Spec(4, 1),
      Spec(8, 1),
      Spec(1, 2),
      Spec(2, 2),
      Spec(1, 4),
      Spec(2, 4),
      Spec(2, 1, 2),
      Spec(1, 2, 2),
      Spec(2, 2, 1, 1, "tp-dp-pp"),
      Spec(2, 2, 1, 1, "dp-tp-pp"),
      Spec(2, 1, 1, 1, "dp-tp"),
      Spec(2, 1, 1, 2),  // dp4 x tp2, ep2: expert replicas are two dense ones
      Spec(1, 2, 1, 2),  // dp4 x pp2 with ep2
  };
  int plans = 0, refusals = 0;
  for (const MeshSpec& spec : specs) {
    absl::StatusOr<Mesh> mesh = Mesh::Create(spec);
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    const std::string name = absl::StrCat(DescribeMesh(mesh->spec()), " order ", spec.order);
    for (int mask = 0; mask < 256; ++mask) {
      std::vector<int> failed;
      for (int r = 0; r < 8; ++r) {
        if (mask & (1 << r)) failed.push_back(r);
      }
      // Reference: replicas hit by a failure leave whole.
      std::set<int> broken;
      for (int r : failed) broken.insert(ReplicaKey(*mesh, r));
      std::vector<int> leaving, survivors;
      for (int r = 0; r < 8; ++r) {
        if (mask & (1 << r)) continue;
        (broken.count(ReplicaKey(*mesh, r)) ? leaving : survivors).push_back(r);
      }
      absl::StatusOr<RegroupPlan> plan = PlanRegroup(*mesh, failed);
      const std::string where = absl::StrCat(name, ", failed [", absl::StrJoin(failed, ","), "]");
      if (survivors.empty()) {
        ASSERT_FALSE(plan.ok()) << where;
        EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition) << where;
        EXPECT_THAT(plan.status().message(), HasSubstr("no complete model replica")) << where;
        ++refusals;
        continue;
      }
      ASSERT_TRUE(plan.ok()) << where << ": " << plan.status();
      ++plans;
      EXPECT_EQ(plan->failed, failed) << where;
      EXPECT_EQ(plan->leaving, leaving) << where;
      EXPECT_EQ(plan->survivors, survivors) << where;
      EXPECT_EQ(plan->excluded.size() + plan->survivors.size(), 8u) << where;
      const int model = spec.tp * spec.pp * spec.cp;
      EXPECT_EQ(plan->new_mesh.world_size, static_cast<int>(survivors.size())) << where;
      EXPECT_EQ(plan->new_mesh.dp, static_cast<int>(survivors.size()) / model) << where;
      EXPECT_EQ(plan->new_mesh.tp, spec.tp);
      EXPECT_EQ(plan->new_mesh.pp, spec.pp);
      EXPECT_EQ(plan->new_mesh.cp, spec.cp);
      EXPECT_EQ(plan->new_mesh.ep, spec.ep);
      // Every survivor keeps its model-parallel coordinates, and the new
      // mesh's model-parallel groups are old groups, renumbered.
      absl::StatusOr<Mesh> next = Mesh::Create(plan->new_mesh);
      ASSERT_TRUE(next.ok()) << where << ": " << next.status();
      for (int i = 0; i < static_cast<int>(survivors.size()); ++i) {
        std::map<std::string, int> a = *mesh->Coords(survivors[i]);
        std::map<std::string, int> b = *next->Coords(i);
        for (const char* axis : {"tp", "cp", "pp"}) EXPECT_EQ(a.at(axis), b.at(axis)) << where;
      }
      for (const char* axes : {"tp", "pp", "cp", "tp-pp"}) {
        RankGroups groups = *next->Groups(axes);
        for (int g = 0; g < groups.num_groups(); ++g) {
          std::vector<int> old;
          for (int r : groups.group(g)) old.push_back(survivors[r]);
          EXPECT_EQ(*mesh->GroupOf(old[0], axes), old) << where << " group " << axes;
        }
      }
      if (spec.ep > 1) {
        RankGroups groups = *next->ExpertGroups("ep");
        for (int g = 0; g < groups.num_groups(); ++g) {
          std::vector<int> old;
          for (int r : groups.group(g)) old.push_back(survivors[r]);
          EXPECT_EQ(*mesh->ExpertGroupOf(old[0], "ep"), old) << where << " group ep";
        }
      }
    }
  }
  EXPECT_GT(plans, 1000);
  EXPECT_GT(refusals, 100);
}

TEST(PlanRegroupTest, NoFailureRebuildsTheSameMesh) {
  Mesh mesh = *Mesh::Create(Spec(2, 2));
  absl::StatusOr<RegroupPlan> plan = PlanRegroup(mesh, {});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->survivors.size(), 8u);
  EXPECT_EQ(plan->new_mesh.dp, 2);
}

TEST(PlanRegroupTest, BadRanksAreNamed) {
  Mesh mesh = *Mesh::Create(Spec(2, 1));
  EXPECT_THAT(PlanRegroup(mesh, {8}).status().message(), HasSubstr("failed rank 8 is not a rank"));
  EXPECT_THAT(PlanRegroup(mesh, {3, 3}).status().message(), HasSubstr("listed twice"));
}

TEST(PlanRegroupTest, TheRefusalNamesEachReplicaAndItsLoss) {
  Mesh mesh = *Mesh::Create(Spec(4, 1));  // dp2 x tp4
  absl::StatusOr<RegroupPlan> plan = PlanRegroup(mesh, {1, 6});
  ASSERT_FALSE(plan.ok());
  EXPECT_THAT(plan.status().message(), HasSubstr("replica [0, 1, 2, 3] lost [1]"));
  EXPECT_THAT(plan.status().message(), HasSubstr("replica [4, 5, 6, 7] lost [6]"));
}

TEST(MembershipTest, RootRanksAndDescriptions) {
  Membership m;
  m.epoch = 2;
  m.members = {0, 1, 4, 5, 6, 7};
  m.mesh = (*Mesh::Create([] {
             MeshSpec s;
             s.world_size = 6;
             s.tp = 2;
             return s;
           }()))
               .spec();
  EXPECT_EQ(m.RootRankOf(4), 2);
  EXPECT_EQ(m.RootRankOf(3), -1);
  EXPECT_EQ(m.ToString(), "epoch 2: 6 ranks [0, 1, 4, 5, 6, 7], dp3 x tp2");
  EXPECT_EQ(DescribeMesh(InitialMembership(m.mesh).mesh), "dp3 x tp2");
}

// PlanChange with spares: dp4 x tp2 on job ranks 0-7, spares 8 (and 9).
TEST(PlanChangeTest, ASpareTakesTheFailedPositionAndDpStays) {
  const Membership m = InitialMembership(Spec(2, 1), 2);
  EXPECT_EQ(m.spares(), 2);
  EXPECT_TRUE(m.IsSpare(9));
  EXPECT_FALSE(m.IsSpare(7));
  EXPECT_THAT(m.ToString(), HasSubstr("spares [8, 9]"));
  absl::StatusOr<ChangePlan> p = PlanChange(m, {3});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT(p->next.members, ElementsAre(0, 1, 2, 8, 4, 5, 6, 7, 9));
  EXPECT_THAT(p->replaced, ElementsAre(std::make_pair(3, 8)));
  EXPECT_TRUE(p->leaving.empty());
  EXPECT_EQ(p->next.mesh.world_size, 8);
  EXPECT_EQ(Mesh::Create(p->next.mesh)->dp(), 4);
}

TEST(PlanChangeTest, SparesGoToTheReplicasThatLostFewest) {
  const Membership m = InitialMembership(Spec(2, 1), 2);
  // Replica {2, 3} lost both, {0, 1} lost 1 and {6, 7} lost 7: two spares
  // keep two replicas whole (one spare each) and {2, 3} is dropped.
  absl::StatusOr<ChangePlan> p = PlanChange(m, {7, 2, 1, 3});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT(p->next.members, ElementsAre(0, 8, 4, 5, 6, 9));
  EXPECT_THAT(p->replaced, ElementsAre(std::make_pair(1, 8), std::make_pair(7, 9)));
  EXPECT_TRUE(p->leaving.empty());
  EXPECT_EQ(p->next.mesh.world_size, 6);
  // Not enough spares for a replica that lost two: it is dropped, its live
  // rank leaves, and the spare stays standing by.
  const Membership one = InitialMembership(Spec(2, 1), 1);
  p = PlanChange(one, {4, 5, 6});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT(p->replaced, ElementsAre(std::make_pair(6, 8)));
  EXPECT_THAT(p->next.members, ElementsAre(0, 1, 2, 3, 8, 7));
  EXPECT_TRUE(p->leaving.empty());
  p = PlanChange(one, {2, 3});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->replaced.empty());
  EXPECT_THAT(p->next.members, ElementsAre(0, 1, 4, 5, 6, 7, 8));
  EXPECT_EQ(p->next.mesh.world_size, 6);
}

TEST(PlanGrowTest, SparesFormANewReplicaUpToTheFirstDp) {
  // dp4 x tp2 lost replica {2, 3} (dp3); two joiners (8, 9) stand by.
  Membership m = InitialMembership(Spec(2, 1));
  EXPECT_EQ(m.full_dp, 4);
  absl::StatusOr<ChangePlan> p = PlanChange(m, {3});
  ASSERT_TRUE(p.ok()) << p.status();
  Membership next = p->next;
  next.full_dp = m.full_dp;
  next.members.push_back(8);
  absl::StatusOr<std::vector<int>> grown = PlanGrow(next);
  ASSERT_TRUE(grown.ok()) << grown.status();
  EXPECT_TRUE(grown->empty());  // one spare is half a replica
  EXPECT_EQ(next.spares(), 1);
  next.members.push_back(9);
  grown = PlanGrow(next);
  ASSERT_TRUE(grown.ok()) << grown.status();
  EXPECT_THAT(*grown, ElementsAre(8, 9));
  EXPECT_THAT(next.members, ElementsAre(0, 1, 4, 5, 6, 7, 8, 9));
  EXPECT_EQ(Mesh::Create(next.mesh)->dp(), 4);
  EXPECT_EQ(next.spares(), 0);
  // At the first dp, spares stay spares.
  next.members.push_back(10);
  next.members.push_back(11);
  grown = PlanGrow(next);
  ASSERT_TRUE(grown.ok()) << grown.status();
  EXPECT_TRUE(grown->empty());
  EXPECT_EQ(next.spares(), 2);
}

TEST(PlanGrowTest, TheNewReplicaTakesTheHighestDpCoordinateInAnyOrder) {
  // dp-first order: a replica is every other rank; the members keep their
  // tp and pp coordinates and the new replica takes dp coordinate 3.
  Membership m = InitialMembership(Spec(2, 1, 1, 1, "dp-tp-cp-ep-pp"));
  absl::StatusOr<ChangePlan> p = PlanChange(m, {1});
  ASSERT_TRUE(p.ok()) << p.status();
  Membership next = p->next;
  next.full_dp = 4;
  next.members.push_back(8);
  next.members.push_back(9);
  absl::StatusOr<std::vector<int>> grown = PlanGrow(next);
  ASSERT_TRUE(grown.ok()) << grown.status();
  ASSERT_THAT(*grown, ElementsAre(8, 9));
  absl::StatusOr<Mesh> before = Mesh::Create(p->next.mesh);
  absl::StatusOr<Mesh> after = Mesh::Create(next.mesh);
  ASSERT_TRUE(before.ok() && after.ok());
  for (int r = 0; r < 8; ++r) {
    const int job = next.members[r];
    const std::map<std::string, int> c = *after->Coords(r);
    if (job >= 8) {
      EXPECT_EQ(c.at("dp"), 3) << "joiner " << job;
      continue;
    }
    const std::map<std::string, int> was = *before->Coords(p->next.RootRankOf(job));
    EXPECT_EQ(c.at("tp"), was.at("tp")) << "rank " << job;
    EXPECT_EQ(c.at("dp"), was.at("dp")) << "rank " << job;
  }
}

TEST(PlanChangeTest, AFailedSpareLeavesThePoolAndNoMemberMoves) {
  const Membership m = InitialMembership(Spec(2, 1), 2);
  absl::StatusOr<ChangePlan> p = PlanChange(m, {8});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT(p->next.members, ElementsAre(0, 1, 2, 3, 4, 5, 6, 7, 9));
  EXPECT_TRUE(p->replaced.empty());
  // A dead spare is never placed: 9 takes 5's place.
  p = PlanChange(m, {8, 5});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT(p->replaced, ElementsAre(std::make_pair(5, 9)));
  EXPECT_THAT(p->next.members, ElementsAre(0, 1, 2, 3, 4, 9, 6, 7));
  // Live ranks of a dropped replica leave when the spares cannot save it.
  p = PlanChange(InitialMembership(Spec(2, 1), 0), {5});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT(p->leaving, ElementsAre(4));
  EXPECT_THAT(PlanChange(m, {12}).status().message(), HasSubstr("failed rank 12 is no member"));
}

TEST(ElasticOptionsTest, BadValuesAreNamed) {
  EXPECT_TRUE(ElasticOptions().Validate().ok());
  ElasticOptions o;
  o.settle_timeout = absl::ZeroDuration();
  EXPECT_THAT(o.Validate().message(), HasSubstr("settle_timeout"));
  o = ElasticOptions();
  o.heartbeat_timeout = absl::Milliseconds(250);
  EXPECT_THAT(o.Validate().message(), HasSubstr("heartbeat_timeout 250ms is less than 3"));
  o = ElasticOptions();
  o.job = "a/b";
  EXPECT_THAT(o.Validate().message(), HasSubstr("job is 'a/b'"));
  o = ElasticOptions();
  o.max_attempts = 0;
  EXPECT_THAT(o.Validate().message(), HasSubstr("max_attempts is 0"));
}

TEST(ElasticOptionsTest, TheUlfmAgreementNeedsAFaultTolerantMpiJob) {
  ElasticOptions o;
  o.agreement = AgreementKind::kUlfm;
  EXPECT_TRUE(o.Validate().ok());
  MeshSpec spec;
  spec.world_size = 1;
  // This process is no `mpirun --with-ft ulfm` job (MPI starts as a
  // singleton without fault tolerance): refused, saying how to launch.
  absl::StatusOr<std::unique_ptr<Agreement>> a =
      MakeUlfmAgreement(MakeMemoryStore(), o, InitialMembership(spec));
#if defined(STRATA_HAVE_ULFM)
  EXPECT_EQ(a.status().code(), absl::StatusCode::kFailedPrecondition) << a.status();
  EXPECT_THAT(a.status().message(), HasSubstr("mpirun --with-ft ulfm"));
#else
  EXPECT_EQ(a.status().code(), absl::StatusCode::kUnimplemented) << a.status();
  EXPECT_THAT(a.status().message(), HasSubstr("ULFM"));
#endif
}

}  // namespace
}  // namespace strata::elastic
