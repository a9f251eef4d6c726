// The store agreement with ranks as threads over a memory store: for every
// subset of failed ranks of an 8-rank dp4 x tp2 world, every survivor gets
// the same decision, and it is the reference one (the failed set, the
// replicas that leave, the new mesh, or a stop for a minority or a mesh
// without a complete replica). Then: failed ranks nobody reported are
// found by the settle timeout; a leader that dies is replaced; keys of an
// old epoch are not read; of members that checked in but could not reach
// each other (a cut the store does not see), the one cut off is taken.
#include "strata/elastic/agreement.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "elastic/internal/keys.h"
#include "strata/elastic/heartbeat.h"

namespace strata::elastic {
namespace {

using ::testing::HasSubstr;

Membership Dp4Tp2() {
  MeshSpec s;
  s.world_size = 8;
  s.tp = 2;
  return InitialMembership(Mesh::Create(s)->spec());
}

ElasticOptions Fast() {
  ElasticOptions o;
  o.settle_timeout = absl::Seconds(5);  // never reached where evidence exists
  o.decision_timeout = absl::Seconds(5);
  o.probe_processes = false;  // the "failed" ranks are threads of this process
  return o;
}

void RaiseAlarm(Store& store, const ElasticOptions& o, uint64_t epoch, int reporter) {
  Detection d;
  d.source = DetectionSource::kBackend;
  d.reporter = reporter;
  d.detail = "test";
  d.found_at = d.failed_at = absl::Now();
  ASSERT_TRUE(store
                  .CompareSet(internal::Keys(o.job, epoch).Alarm(), "", EncodeDetection(d),
                              absl::Now() + absl::Seconds(5))
                  .ok());
}

// Runs the agreement of `m` on the live ranks (threads); `failed` ranks do
// nothing, and their failure is recorded as monitors would (suspect keys)
// when `evidence`. Returns each live rank's decision (or error).
std::vector<absl::StatusOr<Decision>> AgreeOn(const Membership& m, const std::vector<int>& failed,
                                              bool evidence, const ElasticOptions& o,
                                              std::shared_ptr<Store> store = MakeMemoryStore()) {
  const internal::Keys keys(o.job, m.epoch);
  std::vector<int> live;
  for (int r : m.members) {
    if (std::find(failed.begin(), failed.end(), r) == failed.end()) live.push_back(r);
  }
  if (!live.empty()) RaiseAlarm(*store, o, m.epoch, live[0]);
  if (evidence) {
    for (int f : failed) {
      EXPECT_TRUE(store->Set(keys.Suspect(f), "test: gone", absl::Now() + absl::Seconds(5)).ok());
    }
  }
  std::vector<absl::StatusOr<Decision>> out(live.size(), absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < live.size(); ++i) {
    threads.emplace_back([&, i] {
      absl::Status in = CheckInForTest(*store, o, m.epoch, live[i]);
      if (!in.ok()) {
        out[i] = in;
        return;
      }
      auto agreement = MakeStoreAgreement(store, o);
      out[i] = agreement->Agree(m, live[i], {});
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

TEST(StoreAgreementTest, EverySubsetOfFailedRanksOfEightGetsOneDecision) {
  const Membership m = Dp4Tp2();
  const Mesh mesh = *Mesh::Create(m.mesh);
  const ElasticOptions o = Fast();
  for (int mask = 1; mask < 255; ++mask) {
    std::vector<int> failed;
    for (int r = 0; r < 8; ++r) {
      if (mask & (1 << r)) failed.push_back(r);
    }
    const std::string where = absl::StrCat("failed [", absl::StrJoin(failed, ","), "]");
    std::vector<absl::StatusOr<Decision>> got = AgreeOn(m, failed, /*evidence=*/true, o);
    // Every live rank holds the same decision.
    ASSERT_TRUE(got[0].ok()) << where << ": " << got[0].status();
    for (const auto& d : got) {
      ASSERT_TRUE(d.ok()) << where << ": " << d.status();
      EXPECT_EQ(d->Encode(), got[0]->Encode()) << where;
    }
    const Decision& d = *got[0];
    EXPECT_EQ(d.epoch, 1u);
    EXPECT_EQ(d.next_epoch, 2u);
    EXPECT_EQ(d.failed, failed) << where;
    const int live = 8 - static_cast<int>(failed.size());
    absl::StatusOr<RegroupPlan> plan = PlanRegroup(mesh, failed);
    if (live * 2 <= 8) {
      EXPECT_EQ(d.kind, Decision::Kind::kStop) << where;
      EXPECT_THAT(d.stop_reason, HasSubstr(absl::StrCat("only ", live, " of the 8 members")));
      EXPECT_THAT(d.stop_reason, HasSubstr("not a majority"));
    } else if (!plan.ok()) {
      EXPECT_EQ(d.kind, Decision::Kind::kStop) << where;
      EXPECT_THAT(d.stop_reason, HasSubstr("no complete model replica")) << where;
    } else {
      EXPECT_EQ(d.kind, Decision::Kind::kContinue) << where;
      EXPECT_EQ(d.leaving, plan->leaving) << where;  // job ranks = root ranks at epoch 1
      EXPECT_EQ(d.mesh.dp, plan->new_mesh.dp) << where;
      Membership next = d.Next();
      EXPECT_EQ(next.epoch, 2u);
      EXPECT_EQ(next.members, plan->survivors) << where;
    }
  }
}

TEST(StoreAgreementTest, SilentRanksAreTakenAsFailedAtTheSettleTimeout) {
  ElasticOptions o = Fast();
  o.settle_timeout = absl::Milliseconds(300);
  const absl::Time start = absl::Now();
  std::vector<absl::StatusOr<Decision>> got = AgreeOn(Dp4Tp2(), {5}, /*evidence=*/false, o);
  const absl::Duration took = absl::Now() - start;
  ASSERT_TRUE(got[0].ok()) << got[0].status();
  EXPECT_EQ(got[0]->failed, std::vector<int>{5});
  EXPECT_THAT(got[0]->failed_why[0], HasSubstr("no check-in within 300ms"));
  EXPECT_EQ(got[0]->leaving, std::vector<int>{4});
  EXPECT_GE(took, absl::Milliseconds(300));
  EXPECT_LT(took, absl::Seconds(5));
}

// Rank 5 does not check in by the settle timeout but its heartbeat goes on
// (a loaded host): the leader waits for it, up to decision_timeout / 2.
// With `check_in_after` it checks in then; without, it is taken as failed
// at the end of that patience, saying why.
std::vector<absl::StatusOr<Decision>> AgreeWithASlowRank(
    const ElasticOptions& o, std::optional<absl::Duration> check_in_after) {
  const Membership m = Dp4Tp2();
  const internal::Keys keys(o.job, m.epoch);
  std::shared_ptr<Store> store = MakeMemoryStore();
  std::atomic<bool> done{false};
  std::thread slow([&] {
    const absl::Time start = absl::Now();
    for (int beat = 1; !done.load(); ++beat) {
      (void)store->Set(keys.Heartbeat(5), absl::StrCat(beat, " host boot 1 1"),
                       absl::Now() + absl::Seconds(5));
      if (check_in_after.has_value() && absl::Now() - start >= *check_in_after) {
        EXPECT_TRUE(CheckInForTest(*store, o, m.epoch, 5).ok());
        check_in_after.reset();
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
  });
  std::vector<absl::StatusOr<Decision>> got = AgreeOn(m, {5}, /*evidence=*/false, o, store);
  done = true;
  slow.join();
  return got;
}

TEST(StoreAgreementTest, ASlowRankWhoseHeartbeatGoesOnGetsMoreTimeToCheckIn) {
  ElasticOptions o = Fast();
  o.settle_timeout = absl::Milliseconds(300);
  o.decision_timeout = absl::Seconds(6);
  std::vector<absl::StatusOr<Decision>> got = AgreeWithASlowRank(o, absl::Seconds(1));
  for (const auto& d : got) {
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_TRUE(d->failed.empty()) << d->Encode();
    EXPECT_EQ(d->kind, Decision::Kind::kContinue);
  }
}

TEST(StoreAgreementTest, ASlowRankThatNeverChecksInIsTakenAsFailedAfterThePatience) {
  ElasticOptions o = Fast();
  o.settle_timeout = absl::Milliseconds(300);
  o.decision_timeout = absl::Seconds(3);
  const absl::Time start = absl::Now();
  std::vector<absl::StatusOr<Decision>> got = AgreeWithASlowRank(o, std::nullopt);
  const absl::Duration took = absl::Now() - start;
  ASSERT_TRUE(got[0].ok()) << got[0].status();
  EXPECT_EQ(got[0]->failed, std::vector<int>{5});
  EXPECT_THAT(got[0]->failed_why[0], HasSubstr("its heartbeat went on: alive, but too slow"));
  EXPECT_GE(took, absl::Milliseconds(1500));
  EXPECT_LT(took, absl::Seconds(3));
}

TEST(StoreAgreementTest, ADeadLeaderIsReplaced) {
  ElasticOptions o = Fast();
  o.decision_timeout = absl::Milliseconds(300);
  auto store = MakeMemoryStore();
  // Rank 6 took the leadership, then died (it is also among the failed).
  const internal::Keys keys(o.job, 1);
  ASSERT_TRUE(store->CompareSet(keys.Leader(), "", "6", absl::Now() + absl::Seconds(1)).ok());
  std::vector<absl::StatusOr<Decision>> got = AgreeOn(Dp4Tp2(), {6}, /*evidence=*/true, o, store);
  for (const auto& d : got) {
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(d->Encode(), got[0]->Encode());
  }
  EXPECT_NE(got[0]->leader, 6);
  EXPECT_EQ(got[0]->failed, std::vector<int>{6});
}

TEST(StoreAgreementTest, WithoutAnyLeaderTheWaitEndsNamingTheKey) {
  ElasticOptions o = Fast();
  o.decision_timeout = absl::Milliseconds(100);
  o.max_leader_takeovers = 0;
  auto store = MakeMemoryStore();
  const internal::Keys keys(o.job, 1);
  ASSERT_TRUE(store->CompareSet(keys.Leader(), "", "7", absl::Now() + absl::Seconds(1)).ok());
  auto agreement = MakeStoreAgreement(store, o);
  absl::StatusOr<Decision> d = agreement->Agree(Dp4Tp2(), 0, {});
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(d.status().message(), HasSubstr(keys.Decision()));
  EXPECT_THAT(d.status().message(), HasSubstr("the last leader, rank 7, never wrote it"));
}

TEST(StoreAgreementTest, AnOldEpochsDecisionIsNotRead) {
  ElasticOptions o = Fast();
  auto store = MakeMemoryStore();
  Decision stale;
  stale.epoch = 1;
  stale.next_epoch = 2;
  stale.failed = {0, 1, 2, 3};
  ASSERT_TRUE(
      store
          ->Set(internal::Keys(o.job, 1).Decision(), stale.Encode(), absl::Now() + absl::Seconds(1))
          .ok());
  Membership m = Dp4Tp2();
  m.epoch = 2;
  std::vector<absl::StatusOr<Decision>> got = AgreeOn(m, {3}, /*evidence=*/true, o, store);
  ASSERT_TRUE(got[0].ok()) << got[0].status();
  EXPECT_EQ(got[0]->epoch, 2u);
  EXPECT_EQ(got[0]->failed, std::vector<int>{3});
}

// Every member of `m` checks in, each with the ranks its last regroup
// could not connect to (`reports`), as after a shrink across a network cut
// that the store does not see.
std::vector<absl::StatusOr<Decision>> AgreeWithReports(
    const Membership& m, const std::map<int, std::vector<int>>& reports, const ElasticOptions& o) {
  std::shared_ptr<Store> store = MakeMemoryStore();
  RaiseAlarm(*store, o, m.epoch, m.members[0]);
  std::vector<absl::StatusOr<Decision>> out(m.members.size(), absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < m.members.size(); ++i) {
    threads.emplace_back([&, i] {
      const int r = m.members[i];
      auto mine = reports.find(r);
      absl::Status in = CheckInForTest(*store, o, m.epoch, r,
                                       mine == reports.end() ? std::vector<int>{} : mine->second);
      if (!in.ok()) {
        out[i] = in;
        return;
      }
      out[i] = MakeStoreAgreement(store, o)->Agree(m, r, {});
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& d : out) {
    EXPECT_TRUE(d.ok()) << d.status();
    if (d.ok() && out[0].ok()) EXPECT_EQ(d->Encode(), out[0]->Encode());
  }
  return out;
}

// Rank 5's data network is cut, its store connection is not: it checks in,
// and its shrink and the others' gave up on each other (each names the
// first peer it waited for). It alone is taken as failed, its replica
// leaves, the other 6 go on.
TEST(StoreAgreementTest, ARankCutOffFromTheOthersButNotFromTheStoreIsTakenAsFailed) {
  const Membership m = Dp4Tp2();
  std::map<int, std::vector<int>> reports = {{5, {0}}};
  for (int r : m.members) {
    if (r != 5) reports[r] = {5};
  }
  std::vector<absl::StatusOr<Decision>> got = AgreeWithReports(m, reports, Fast());
  ASSERT_TRUE(got[0].ok()) << got[0].status();
  EXPECT_EQ(got[0]->kind, Decision::Kind::kContinue);
  EXPECT_EQ(got[0]->failed, std::vector<int>{5});
  EXPECT_THAT(got[0]->failed_why[0], HasSubstr("rank(s) [0, 1, 2, 3, 4, 6, 7] and it could not "
                                               "connect to each other"));
  EXPECT_EQ(got[0]->leaving, std::vector<int>{4});
  EXPECT_EQ(got[0]->Next().members, (std::vector<int>{0, 1, 2, 3, 6, 7}));
}

// Two members that only cannot reach each other (one link): the higher
// rank is taken, whether one or both reported it. Without reports, nobody.
TEST(StoreAgreementTest, OfTwoMembersThatCannotReachEachOtherTheHigherRankIsTaken) {
  const Membership m = Dp4Tp2();
  for (const auto& reports :
       std::vector<std::map<int, std::vector<int>>>{{{2, {6}}, {6, {2}}}, {{6, {2}}}, {{2, {6}}}}) {
    std::vector<absl::StatusOr<Decision>> got = AgreeWithReports(m, reports, Fast());
    ASSERT_TRUE(got[0].ok()) << got[0].status();
    EXPECT_EQ(got[0]->failed, std::vector<int>{6});
    EXPECT_EQ(got[0]->kind, Decision::Kind::kContinue);
  }
  std::vector<absl::StatusOr<Decision>> none = AgreeWithReports(m, {}, Fast());
  ASSERT_TRUE(none[0].ok()) << none[0].status();
  EXPECT_TRUE(none[0]->failed.empty());
}

// Reports naming a rank that is no member, or the reporter itself, are
// ignored.
TEST(StoreAgreementTest, ReportsOutsideTheLiveMembersAreIgnored) {
  Membership m = Dp4Tp2();
  std::vector<absl::StatusOr<Decision>> got =
      AgreeWithReports(m, {{1, {1, 9, -1}}, {3, {42}}}, Fast());
  ASSERT_TRUE(got[0].ok()) << got[0].status();
  EXPECT_TRUE(got[0]->failed.empty()) << got[0]->Encode();
}

TEST(DecisionTest, RoundTrips) {
  Decision d;
  d.epoch = 3;
  d.next_epoch = 4;
  d.failed = {2};
  d.failed_why = {"gone"};
  d.leaving = {3};
  d.mesh = Dp4Tp2().mesh;
  d.cause.detail = "x";
  d.cause.evict = {1};
  d.cause.source = DetectionSource::kJoin;
  d.joined = {8};
  d.grown = {8};
  d.refused = {{2, "its config 'b' is not the job's 'a'"}};
  d.full_dp = 4;
  d.joins_seen = 2;
  absl::StatusOr<Decision> back = Decision::Decode(d.Encode());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->Encode(), d.Encode());
  EXPECT_EQ(back->Next().joins_seen, 2);
  EXPECT_EQ(back->Next().full_dp, 4);
  EXPECT_FALSE(Decision::Decode("{").ok());
}

}  // namespace
}  // namespace strata::elastic
