// ElasticLoop end to end with ranks as threads: real Gloo communicators
// over a memory store, a World of dp4 x tp2 (8 ranks), a step of a dp and a
// tp all-reduce. A rank "dies" (its loop stops and its communicators are
// aborted, as a SIGKILL looks to the others) or hangs (it stops taking part
// and heartbeating, as SIGSTOP); the survivors recover, the replica that
// lost the rank leaves, and the parameters after the last step equal a
// reference computed here that applies every step once (the global batch
// is kept, so the reference does not depend on dp). Also: two failures in
// a row, a partition that loses the store (the minority stops, the
// majority trains on; without a majority nobody does), 50 planned regroups in one process without
// leaking threads, file descriptors or memory, heartbeats that go on while an abort of the
// World blocks, and a planned eviction every rank decided (no abort, no minority).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "comm/gloo/gloo_communicator.h"
#include "elastic/internal/keys.h"
#include "proc_counts.h"
#include "reference_model.h"
#include "strata/base/status.h"
#include "strata/elastic/elastic_loop.h"
#include "strata/parallel/world.h"

namespace strata::elastic {
namespace {

using ::testing::ElementsAre;

using testing::CountEntries;
using testing::Grad;
using testing::kGlobalBatch;
using testing::kLr;
using testing::kParams;
using testing::Reference;

ElasticOptions TestOptions() { return testing::ThreadRankOptions(); }

// kCut: at its step the rank loses the store (a network partition between
// it and the store's host; the ranks cut at the same step are one
// partition). It goes on running its loop, as a partitioned process does.
enum class Fate { kLive, kDie, kHang, kCut };

// A store fault injector: the view of one side of a partition. Every
// operation fails (Unavailable, as a store client whose connection is gone
// reports it) once `cut` is set.
class PartitionedStore final : public Store {
 public:
  PartitionedStore(std::shared_ptr<Store> store, std::shared_ptr<std::atomic<bool>> cut)
      : store_(std::move(store)), cut_(std::move(cut)) {}
  absl::Status Set(absl::string_view key, absl::string_view value, absl::Time deadline) override {
    if (*cut_) return Lost(key);
    return store_->Set(key, value, deadline);
  }
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Time deadline) override {
    if (*cut_) return Lost(key);
    return store_->Get(key, deadline);
  }
  absl::Status Wait(absl::Span<const std::string> keys, absl::Time deadline) override {
    if (*cut_) return Lost(keys.empty() ? "" : keys[0]);
    return store_->Wait(keys, deadline);
  }
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta, absl::Time deadline) override {
    if (*cut_) return Lost(key);
    return store_->Add(key, delta, deadline);
  }
  absl::StatusOr<std::string> CompareSet(absl::string_view key, absl::string_view expected,
                                         absl::string_view desired, absl::Time deadline) override {
    if (*cut_) return Lost(key);
    return store_->CompareSet(key, expected, desired, deadline);
  }
  std::string Describe() const override { return "memory store (partitioned by the test)"; }

 private:
  static absl::Status Lost(absl::string_view key) {
    return absl::UnavailableError(absl::StrCat("connection lost (test partition) at '", key, "'"));
  }
  std::shared_ptr<Store> store_;
  std::shared_ptr<std::atomic<bool>> cut_;
};

// Rank `r` of a World of `n` ranks, all data-parallel, over Gloo through
// `store` (ranks as threads).
absl::StatusOr<std::unique_ptr<World>> DpWorld(const std::shared_ptr<Store>& store, int r, int n) {
  RootOptions ro;
  ro.comm.timeout = absl::Seconds(60);
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<gloo::GlooCommunicator> root,
                          gloo::GlooCommunicator::CreateRoot(ro, store, r, n));
  MeshSpec spec;
  spec.world_size = n;
  STRATA_ASSIGN_OR_RETURN(Mesh mesh, Mesh::Create(spec));
  return World::FromRoot(std::move(root), mesh, WorldOptions{});
}

struct RankResult {
  absl::Status status;
  LoopResult loop;
  std::vector<double> params;
  Membership membership;
};

// Runs `steps` steps on `n` threads over a mesh of `tp`; rank `fates[r]`
// at step `at[r]`.
std::vector<RankResult> Train(int n, int tp, int64_t steps,
                              std::map<int, std::pair<Fate, int64_t>> fates,
                              ElasticOptions options = TestOptions(), int spares = 0) {
  auto store = MakeMemoryStore();
  // One partition: the ranks whose fate is kCut lose the store together.
  auto cut = std::make_shared<std::atomic<bool>>(false);
  std::vector<RankResult> results(n);
  std::atomic<bool> survivors_done{false};
  std::atomic<int64_t> progress{0};  // the latest step a member began
  // Spares that die stop first, then the members that die in the same step
  // (or later): "together" means in one agreement. Else, on a loaded host,
  // a member's death could be agreed on before the spare saw its step
  // begin, and the spare would still check in (ASpareThatDiesIsNotPlaced
  // failed so once).
  std::atomic<int> spares_down{0};
  auto spares_dying_by = [&](int64_t step) {
    int count = 0;
    for (const auto& [rank, fate] : fates) {
      count += rank >= n - spares && fate.first == Fate::kDie && fate.second <= step;
    }
    return count;
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      RankResult& out = results[r];
      RootOptions ro;
      ro.comm.timeout = absl::Seconds(60);
      auto root = gloo::GlooCommunicator::CreateRoot(ro, store, r, n);
      if (!root.ok()) {
        out.status = root.status();
        return;
      }
      MeshSpec spec;
      spec.world_size = n - spares;
      spec.tp = tp;
      WorldOptions wo;
      wo.root.comm.timeout = absl::Seconds(60);
      wo.spares = spares;
      auto world = World::FromRoot(*std::move(root), *Mesh::Create(spec), wo);
      if (!world.ok()) {
        out.status = world.status();
        return;
      }
      const auto fate = fates.count(r) ? fates[r] : std::make_pair(Fate::kLive, int64_t{-1});
      // The elastic layer's view of the store (the Gloo communicators
      // bootstrap through the store itself: the partition is between the
      // ranks and the store's host).
      std::shared_ptr<Store> view = store;
      if (fate.first == Fate::kCut) view = std::make_shared<PartitionedStore>(store, cut);
      auto loop = ElasticLoop::Create(**world, view, options);
      if (!loop.ok()) {
        out.status = loop.status();
        return;
      }
      std::vector<double> params(kParams, 1.0);
      std::vector<double> grad(kParams);
      LoopCallbacks cb;
      cb.step = [&](const StepContext& ctx) -> absl::Status {
        if (fate.first == Fate::kCut && ctx.step == fate.second) cut->store(true);
        for (int64_t seen = progress.load(); seen < ctx.step;) {
          if (progress.compare_exchange_weak(seen, ctx.step)) break;
        }
        // This replica's share of the global batch (uneven splits allowed).
        Mesh mesh = ctx.world->mesh();
        const int dp = mesh.dp();
        const int d = (*mesh.Coords(ctx.world->rank())).at("dp");
        const int begin = kGlobalBatch * d / dp, end = kGlobalBatch * (d + 1) / dp;
        for (int p = 0; p < kParams; ++p) {
          grad[p] = 0;
          for (int i = begin; i < end; ++i) grad[p] += Grad(ctx.step * kGlobalBatch + i, p);
          grad[p] /= kGlobalBatch;
        }
        for (const char* axes : {"dp", "tp"}) {
          absl::StatusOr<Communicator*> g = ctx.world->Group(axes);
          if (!g.ok()) return g.status();
          // tp: the ranks of a replica hold the same gradient; summing and
          // dividing keeps it and makes tp take part in every step.
          auto w = (*g)->AllReduce(ConstBuffer(grad.data(), kParams, DataType::kFloat64),
                                   Buffer::Of(grad.data(), kParams),
                                   std::string(axes) == "dp" ? ReduceOp::kSum : ReduceOp::kAvg);
          if (!w.ok()) return w.status();
          if (absl::Status s = (*w)->Wait(); !s.ok()) return s;
        }
        return absl::OkStatus();
      };
      cb.apply = [&](const StepContext&) {
        for (int p = 0; p < kParams; ++p) params[p] -= kLr * grad[p];
        return absl::OkStatus();
      };
      // A spare placed in a dp group gets the parameters of its position
      // from the group's first rank that was no spare.
      cb.restore = [&](RecoveryEvent& e) -> absl::Status {
        if (e.replaced.empty()) return absl::OkStatus();
        World& w = **world;
        std::vector<int> placed;
        for (const auto& pair : e.replaced) placed.push_back(pair.second);
        absl::StatusOr<std::vector<int>> group = w.mesh().GroupOf(w.rank(), "dp");
        if (!group.ok()) return group.status();
        int source = -1;
        bool gains = false;
        for (int i = 0; i < static_cast<int>(group->size()); ++i) {
          const int job = e.members[(*group)[i]];
          const bool is_placed = std::find(placed.begin(), placed.end(), job) != placed.end();
          gains = gains || is_placed;
          if (!is_placed && source < 0) source = i;
        }
        if (!gains) return absl::OkStatus();
        absl::StatusOr<Communicator*> dp = w.Group("dp");
        if (!dp.ok()) return dp.status();
        auto b = (*dp)->Broadcast(Buffer::Of(params.data(), kParams), source);
        if (!b.ok()) return b.status();
        return (*b)->Wait();
      };
      if (fate.first == Fate::kDie || fate.first == Fate::kHang) {
        // A spare fails once the members began that step.
        while ((*world)->is_spare() && progress.load() < fate.second) {
          absl::SleepFor(absl::Milliseconds(2));
        }
        // A hand-written loop (what Run does) up to the step it fails in.
        for (int64_t step = 0; step < fate.second && !(*world)->is_spare();) {
          StepContext ctx;
          ctx.step = step;
          ctx.world = world->get();
          absl::Status s = (*loop)->BeginStep(step);
          if (s.ok()) s = cb.step(ctx);
          if (!s.ok()) (*loop)->ReportFailure(s);
          absl::StatusOr<bool> committed = (*loop)->Commit(step, s.ok());
          if (!committed.ok()) {
            out.status = committed.status();
            return;
          }
          if (*committed) {
            (void)cb.apply(ctx);
            ++step;
            continue;
          }
          absl::StatusOr<ElasticLoop::Recovery> rec = (*loop)->Recover();
          if (!rec.ok() || rec->outcome != ElasticLoop::Outcome::kContinue) {
            out.status = absl::InternalError("a rank meant to fail later failed to recover");
            return;
          }
          if (absl::Status restored = cb.restore(rec->event); !restored.ok()) {
            out.status = restored;
            return;
          }
        }
        if (fate.first == Fate::kDie && !(*world)->is_spare()) {
          const absl::Time patience = absl::Now() + absl::Seconds(10);
          while (spares_down.load() < spares_dying_by(fate.second) && absl::Now() < patience) {
            absl::SleepFor(absl::Milliseconds(1));
          }
        }
        const bool spare = (*world)->is_spare();
        loop->reset();  // its monitor stops: no more heartbeats
        if (spare) spares_down.fetch_add(1);
        if (fate.first == Fate::kDie) {
          (*world)->AbortAll();  // its connections close, as when the process dies
        } else {
          while (!survivors_done.load()) absl::SleepFor(absl::Milliseconds(20));
        }
        out.status = absl::CancelledError("this rank failed");
        return;
      }
      absl::StatusOr<LoopResult> result = (*loop)->Run(cb, 0, steps);
      out.membership = (*loop)->membership();
      if (!result.ok()) {
        out.status = result.status();
        return;
      }
      out.loop = *result;
      out.params = params;
    });
  }
  // The hung rank resumes once the survivors are through.
  for (int r = 0; r < n; ++r) {
    if (!fates.count(r) || fates[r].first != Fate::kHang) {
      threads[r].join();
    }
  }
  survivors_done.store(true);
  for (int r = 0; r < n; ++r) {
    if (threads[r].joinable()) threads[r].join();
  }
  return results;
}

TEST(ElasticLoopTest, NoFailureTrainsLikeTheReference) {
  std::vector<RankResult> results = Train(8, 2, 6, {});
  for (int r = 0; r < 8; ++r) {
    ASSERT_TRUE(results[r].status.ok()) << "rank " << r << ": " << results[r].status;
    EXPECT_EQ(results[r].params, Reference(6));
    EXPECT_TRUE(results[r].loop.events.empty());
  }
}

void ExpectRecovered(const std::vector<RankResult>& results, const std::vector<int>& dead,
                     const std::vector<int>& leaving, int64_t steps, uint64_t epoch, int dp) {
  for (int r = 0; r < static_cast<int>(results.size()); ++r) {
    const RankResult& res = results[r];
    if (std::find(dead.begin(), dead.end(), r) != dead.end()) continue;
    if (std::find(leaving.begin(), leaving.end(), r) != leaving.end()) {
      ASSERT_TRUE(res.status.ok()) << "rank " << r << ": " << res.status;
      EXPECT_TRUE(res.loop.left) << "rank " << r;
      continue;
    }
    ASSERT_TRUE(res.status.ok()) << "rank " << r << ": " << res.status;
    EXPECT_FALSE(res.loop.left);
    EXPECT_EQ(res.loop.next_step, steps);
    EXPECT_EQ(res.params, Reference(steps)) << "rank " << r;
    EXPECT_EQ(res.membership.epoch, epoch) << "rank " << r;
    EXPECT_EQ(res.membership.mesh.dp, dp) << "rank " << r;
    ASSERT_FALSE(res.loop.events.empty());
    if (r == res.membership.members[0]) {
      for (const RecoveryEvent& e : res.loop.events)
        std::fprintf(stderr, "%s\n", e.ToJson().c_str());
    }
    // Every survivor holds the same events.
    const RankResult& first = results[res.membership.members[0]];
    ASSERT_EQ(res.loop.events.size(), first.loop.events.size());
    for (size_t i = 0; i < res.loop.events.size(); ++i) {
      EXPECT_EQ(res.loop.events[i].failed, first.loop.events[i].failed);
      EXPECT_EQ(res.loop.events[i].epoch_after, first.loop.events[i].epoch_after);
      EXPECT_EQ(res.loop.events[i].members, first.loop.events[i].members);
    }
  }
}

TEST(ElasticLoopTest, ARankThatDiesIsDroppedWithItsReplica) {
  std::vector<RankResult> results = Train(8, 2, 8, {{5, {Fate::kDie, 3}}});
  ExpectRecovered(results, {5}, {4}, 8, 2, 3);
  const RecoveryEvent& e = results[0].loop.events.at(0);
  EXPECT_THAT(e.failed, ElementsAre(5));
  EXPECT_THAT(e.leaving, ElementsAre(4));
  EXPECT_THAT(e.members, ElementsAre(0, 1, 2, 3, 6, 7));
  EXPECT_EQ(e.mesh_before.dp, 4);
  EXPECT_EQ(e.mesh_after.dp, 3);
  EXPECT_EQ(e.step, 3);
  EXPECT_GT(e.rebuild, absl::ZeroDuration());
}

TEST(ElasticLoopTest, ASpareTakesTheFailedRanksPlaceAndDpStays) {
  // dp3 x tp2 on ranks 0-5, spares 6 and 7: rank 3 dies at step 3; spare 6
  // takes its mesh position, gets its replica partner's parameters, and
  // the six train on as dp3 to the reference; spare 7 stands by to the end.
  std::vector<RankResult> results = Train(8, 2, 8, {{3, {Fate::kDie, 3}}}, TestOptions(), 2);
  for (int r : {0, 1, 2, 4, 5, 6}) {
    const RankResult& res = results[r];
    ASSERT_TRUE(res.status.ok()) << "rank " << r << ": " << res.status;
    EXPECT_FALSE(res.loop.left);
    EXPECT_EQ(res.loop.next_step, 8);
    EXPECT_EQ(res.params, Reference(8)) << "rank " << r;
    EXPECT_EQ(res.membership.epoch, 2u);
    EXPECT_EQ(res.membership.mesh.dp, 3);
    EXPECT_THAT(res.membership.members, ElementsAre(0, 1, 2, 6, 4, 5, 7));
    ASSERT_EQ(res.loop.events.size(), 1u) << "rank " << r;
    const RecoveryEvent& e = res.loop.events[0];
    EXPECT_THAT(e.failed, ElementsAre(3));
    EXPECT_TRUE(e.leaving.empty());
    EXPECT_THAT(e.replaced, ElementsAre(std::make_pair(3, 6)));
    EXPECT_THAT(e.spares, ElementsAre(7));
    EXPECT_EQ(e.mesh_after.dp, 3);
    EXPECT_EQ(e.step, 3);
    EXPECT_EQ(e.placed, r == 6);
  }
  const RankResult& spare = results[7];
  ASSERT_TRUE(spare.status.ok()) << spare.status;
  EXPECT_TRUE(spare.loop.stood_by);
  EXPECT_FALSE(spare.loop.left);
  EXPECT_TRUE(spare.membership.IsSpare(7));
}

TEST(ElasticLoopTest, WhenTheSparesRunOutTheReplicaIsDropped) {
  // dp3 on ranks 0-2, spare 3: rank 1 dies at step 2 (spare 3 takes its
  // place), rank 0 at step 5 (no spare left: dp3 -> dp2).
  std::vector<RankResult> results =
      Train(4, 1, 8, {{1, {Fate::kDie, 2}}, {0, {Fate::kDie, 5}}}, TestOptions(), 1);
  for (int r : {2, 3}) {
    const RankResult& res = results[r];
    ASSERT_TRUE(res.status.ok()) << "rank " << r << ": " << res.status;
    EXPECT_EQ(res.loop.next_step, 8);
    EXPECT_EQ(res.params, Reference(8)) << "rank " << r;
    EXPECT_EQ(res.membership.epoch, 3u);
    EXPECT_EQ(res.membership.mesh.dp, 2);
    EXPECT_THAT(res.membership.members, ElementsAre(3, 2));
    ASSERT_EQ(res.loop.events.size(), 2u);
    EXPECT_THAT(res.loop.events[0].replaced, ElementsAre(std::make_pair(1, 3)));
    EXPECT_EQ(res.loop.events[0].mesh_after.dp, 3);
    EXPECT_TRUE(res.loop.events[1].replaced.empty());
    EXPECT_THAT(res.loop.events[1].failed, ElementsAre(0));
  }
}

TEST(ElasticLoopTest, ASpareThatDiesIsNotPlaced) {
  // dp2 x tp2 on ranks 0-3, spares 4 and 5: spare 4 and member 2 die at
  // step 3 together; spare 5 (not the dead 4) takes rank 2's place.
  std::vector<RankResult> results =
      Train(6, 2, 8, {{4, {Fate::kDie, 3}}, {2, {Fate::kDie, 3}}}, TestOptions(), 2);
  for (int r : {0, 1, 3, 5}) {
    const RankResult& res = results[r];
    ASSERT_TRUE(res.status.ok()) << "rank " << r << ": " << res.status;
    EXPECT_EQ(res.loop.next_step, 8);
    EXPECT_EQ(res.params, Reference(8)) << "rank " << r;
    EXPECT_EQ(res.membership.mesh.dp, 2);
    EXPECT_THAT(res.membership.members, ElementsAre(0, 1, 5, 3));
    ASSERT_EQ(res.loop.events.size(), 1u);
    EXPECT_THAT(res.loop.events[0].failed, ElementsAre(2, 4));
    EXPECT_THAT(res.loop.events[0].replaced, ElementsAre(std::make_pair(2, 5)));
    EXPECT_TRUE(res.loop.events[0].spares.empty());
  }
}

TEST(ElasticLoopTest, AHungRankIsFoundByItsHeartbeat) {
  std::vector<RankResult> results = Train(8, 2, 6, {{2, {Fate::kHang, 2}}});
  ExpectRecovered(results, {2}, {3}, 6, 2, 3);
  const RecoveryEvent& e = results[0].loop.events.at(0);
  EXPECT_EQ(e.cause.source, DetectionSource::kHeartbeat) << e.ToJson();
  EXPECT_EQ(e.cause.suspect, 2);
  EXPECT_THAT(e.failed, ElementsAre(2));
}

TEST(ElasticLoopTest, TwoFailuresInARow) {
  std::vector<RankResult> results = Train(8, 2, 9, {{5, {Fate::kDie, 2}}, {0, {Fate::kDie, 5}}});
  ExpectRecovered(results, {5, 0}, {4, 1}, 9, 3, 2);
  const std::vector<RecoveryEvent>& events = results[2].loop.events;
  ASSERT_EQ(events.size(), 2u);
  EXPECT_THAT(events[0].failed, ElementsAre(5));
  EXPECT_THAT(events[1].failed, ElementsAre(0));
  EXPECT_EQ(events[1].epoch_after, 3u);
}

// A partition that loses the store (ranks 6 and 7, replica 3 of dp4 x
// tp2) while the other six go on: the six take the two as failed (one by
// its stale heartbeat, one by its missing check-in) and train on, dp3, to
// the reference's parameters; each of the two stops with an error that
// names the store and the epoch's members, and neither trains on.
TEST(ElasticLoopTest, AMinorityPartitionStopsWhileTheMajorityTrainsOn) {
  std::vector<RankResult> results = Train(8, 2, 8, {{6, {Fate::kCut, 3}}, {7, {Fate::kCut, 3}}});
  ExpectRecovered(results, {6, 7}, {}, 8, 2, 3);
  const RecoveryEvent& e = results[0].loop.events.at(0);
  EXPECT_THAT(e.failed, ElementsAre(6, 7)) << e.ToJson();
  EXPECT_TRUE(e.leaving.empty()) << e.ToJson();
  for (int r : {6, 7}) {
    const absl::Status& s = results[r].status;
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << "rank " << r << ": " << s;
    EXPECT_THAT(s.message(), ::testing::HasSubstr(
                                 absl::StrCat("rank ", r,
                                              " stops: it cannot reach the elastic store memory "
                                              "store (partitioned by the test)")))
        << s;
    EXPECT_THAT(s.message(), ::testing::HasSubstr("a majority of the 8 members of epoch 1")) << s;
    EXPECT_TRUE(results[r].params.empty()) << "rank " << r << " trained on";
  }
}

// No split brain when the store's side is the minority: ranks 0-4 lose the
// store, 5-7 keep it. The three see only themselves check in (3 of 8, not
// a majority) and stop with an error naming the counts; the five cannot
// reach the store and stop naming it. Nobody trains on.
TEST(ElasticLoopTest, WithoutAMajorityNobodyTrainsOn) {
  std::map<int, std::pair<Fate, int64_t>> fates;
  for (int r = 0; r < 5; ++r) fates[r] = {Fate::kCut, 2};
  std::vector<RankResult> results = Train(8, 2, 6, fates);
  for (int r = 0; r < 8; ++r) {
    const absl::Status& s = results[r].status;
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << "rank " << r << ": " << s;
    EXPECT_TRUE(results[r].params.empty()) << "rank " << r << " trained on";
    if (r < 5) {
      EXPECT_THAT(s.message(), ::testing::HasSubstr("cannot reach the elastic store")) << s;
    } else {
      EXPECT_THAT(s.message(),
                  ::testing::HasSubstr(absl::StrCat("rank ", r,
                                                    " stops: only 3 of the 8 members of epoch 1 "
                                                    "checked in")))
          << s;
      EXPECT_THAT(s.message(), ::testing::HasSubstr("not a majority")) << s;
    }
  }
}

// The straggler policy's eviction: every rank takes the same decision at
// the same point and asks for it with abort_at_once = false. The World is
// not aborted then (a collective in flight completes: here one started
// after the request), and evicting half of the members is no minority (the
// majority counts the members not evicted): ranks 1 and 3 leave, 0 and 2
// go on as dp2.
TEST(ElasticLoopTest, AnEvictionEveryRankDecidedDoesNotAbortAndIsNoMinority) {
  constexpr int n = 4;
  auto store = MakeMemoryStore();
  std::vector<ElasticLoop::Outcome> outcomes(n);
  std::vector<Membership> after(n);
  std::vector<double> sums(n, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      auto world = DpWorld(store, r, n);
      ASSERT_TRUE(world.ok()) << world.status();
      ElasticOptions o = TestOptions();
      o.job = "evict-half";
      auto loop = ElasticLoop::Create(**world, store, o);
      ASSERT_TRUE(loop.ok()) << loop.status();
      ASSERT_TRUE((*loop)->RequestChange({1, 3}, "test: stragglers", false).ok());
      ASSERT_TRUE((*loop)->alarmed());
      // Still usable: every rank asked the same, nobody aborted.
      double x = 1;
      auto w = (*world)->root().AllReduce(ConstBuffer(&x, 1, DataType::kFloat64), Buffer::Of(&x, 1),
                                          ReduceOp::kSum);
      ASSERT_TRUE(w.ok()) << w.status();
      absl::Status waited = (*w)->Wait();
      ASSERT_TRUE(waited.ok()) << waited;
      sums[r] = x;
      absl::StatusOr<ElasticLoop::Recovery> rec = (*loop)->Recover();
      ASSERT_TRUE(rec.ok()) << "rank " << r << ": " << rec.status();
      outcomes[r] = rec->outcome;
      after[r] = (*loop)->membership();
      if (rec->outcome == ElasticLoop::Outcome::kContinue) {
        EXPECT_EQ(rec->event.cause.source, DetectionSource::kRequest);
        EXPECT_FALSE(rec->event.cause.abort);
        EXPECT_THAT(rec->event.failed, ElementsAre(1, 3));
        double y = 1;
        auto v = (*world)->root().AllReduce(ConstBuffer(&y, 1, DataType::kFloat64),
                                            Buffer::Of(&y, 1), ReduceOp::kSum);
        ASSERT_TRUE(v.ok() && (*v)->Wait().ok());
        EXPECT_EQ(y, 2);
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(sums[r], n) << "rank " << r;
    EXPECT_EQ(outcomes[r], r % 2 ? ElasticLoop::Outcome::kLeave : ElasticLoop::Outcome::kContinue)
        << "rank " << r;
  }
  EXPECT_THAT(after[0].members, ElementsAre(0, 2));
  EXPECT_EQ(after[0].mesh.dp, 2);
  EXPECT_EQ(after[0].epoch, 2u);
}

// A deferred abort still comes when the epoch outlives it: a rank stuck
// after such a request (here: one that never recovers) has its World
// aborted `heartbeat_timeout` after the alarm, not at once.
TEST(ElasticLoopTest, ADeferredAbortComesAfterTheHeartbeatTimeout) {
  auto store = MakeMemoryStore();
  auto world = DpWorld(store, 0, 1);
  ASSERT_TRUE(world.ok()) << world.status();
  std::atomic<int> aborts{0};
  std::atomic<int64_t> aborted_ns{0};
  ElasticHooks hooks;
  hooks.abort_all = [&] {
    aborted_ns.store(absl::ToUnixNanos(absl::Now()));
    ++aborts;
  };
  ElasticOptions o = TestOptions();  // heartbeat_timeout 600 ms
  o.job = "deferred-abort";
  auto loop = ElasticLoop::Create(**world, store, o, hooks);
  ASSERT_TRUE(loop.ok()) << loop.status();
  const absl::Time asked = absl::Now();
  ASSERT_TRUE((*loop)->RequestChange({}, "test: deferred", false).ok());
  absl::SleepFor(o.heartbeat_timeout / 3);
  EXPECT_EQ(aborts.load(), 0) << "aborted at once";
  const absl::Time deadline = asked + o.heartbeat_timeout + absl::Seconds(10);
  while (aborts.load() == 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(aborts.load(), 1) << "no abort within the heartbeat timeout and 10 s";
  EXPECT_GE(absl::FromUnixNanos(aborted_ns.load()) - asked, o.heartbeat_timeout);
  loop->reset();
}

long RssKib() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  }
  return 0;
}

// 50 recoveries in one process (planned regroups onto the same mesh, which
// take the same path as a failure: alarm, abort, agreement, shrink,
// rebuild) leak no threads, file descriptors or memory.
TEST(ElasticLoopTest, FiftyRecoveriesLeakNothing) {
  constexpr int n = 4;
  auto store = MakeMemoryStore();
  auto run = [&](int recoveries, std::vector<int64_t>* epochs) {
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        auto world = DpWorld(store, r, n);
        ASSERT_TRUE(world.ok()) << world.status();
        ElasticOptions o = TestOptions();
        o.job = absl::StrCat("leak", epochs->size());
        auto loop = ElasticLoop::Create(**world, store, o);
        ASSERT_TRUE(loop.ok()) << loop.status();
        for (int i = 0; i < recoveries; ++i) {
          if (r == i % n) {
            // Not before every rank's check of the last regroup returned:
            // the alarm aborts the World, and an allreduce complete on this
            // rank may still be running on another.
            if (i > 0) {
              const std::string key = absl::StrCat("test/", o.job, "/checked/", i - 1);
              while (*store->Add(key, 0, absl::Now() + absl::Seconds(10)) < n) {
                absl::SleepFor(absl::Milliseconds(2));
              }
            }
            ASSERT_TRUE((*loop)->RequestChange({}, "leak test").ok());
          }
          // Wait until this rank knows (as a step blocked in a collective
          // would be woken by its abort).
          while (!(*loop)->alarmed()) absl::SleepFor(absl::Milliseconds(5));
          absl::StatusOr<ElasticLoop::Recovery> rec = (*loop)->Recover();
          ASSERT_TRUE(rec.ok()) << rec.status();
          ASSERT_EQ(rec->outcome, ElasticLoop::Outcome::kContinue);
          double x = 1;
          auto w = (*world)->root().AllReduce(ConstBuffer(&x, 1, DataType::kFloat64),
                                              Buffer::Of(&x, 1), ReduceOp::kSum);
          ASSERT_TRUE(w.ok() && (*w)->Wait().ok());
          ASSERT_EQ(x, n);
          ASSERT_TRUE(store
                          ->Add(absl::StrCat("test/", o.job, "/checked/", i), 1,
                                absl::Now() + absl::Seconds(10))
                          .ok());
        }
        if (r == 0) epochs->push_back(static_cast<int64_t>((*loop)->membership().epoch));
      });
    }
    for (auto& t : threads) t.join();
  };
  std::vector<int64_t> epochs;
  run(2, &epochs);  // warm up: the plugin, thread pools, allocator arenas
  const int threads_before = CountEntries("/proc/self/task");
  const int fds_before = CountEntries("/proc/self/fd");
  const long rss_before = RssKib();
  run(50, &epochs);
  ASSERT_EQ(epochs.size(), 2u);
  EXPECT_EQ(epochs[1], 51);
  EXPECT_EQ(CountEntries("/proc/self/task"), threads_before);
  EXPECT_LE(CountEntries("/proc/self/fd"), fds_before);
  EXPECT_LT(RssKib() - rss_before, 64 * 1024) << "RSS grew from " << rss_before << " KiB";
}

// Sets the epoch's alarm as rank 1 would, so that rank 0's monitor thread
// is the one that sees it.
absl::Status SetAlarmAsRankOne(Store& store, const internal::Keys& keys, absl::Time deadline) {
  Detection d;
  d.source = DetectionSource::kRequest;
  d.reporter = 1;
  d.detail = "set by the test";
  d.found_at = d.failed_at = absl::Now();
  return store.Set(keys.Alarm(), EncodeDetection(d), deadline);
}

// The monitor's heartbeats never wait behind the abort an alarm causes: an
// abort may block (MPI's waits up to seconds for pending receives to be
// cancelled), and a rank whose heartbeat stops meanwhile would be taken as
// hung by the others. The alarm is set in the store as another rank sets
// it, so that this rank's monitor thread is the one that sees it.
TEST(ElasticLoopTest, HeartbeatsGoOnWhileAnAbortBlocks) {
  auto store = MakeMemoryStore();
  auto world = DpWorld(store, 0, 1);
  ASSERT_TRUE(world.ok()) << world.status();

  const absl::Duration blocked_for = absl::Milliseconds(2500);
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  std::atomic<int> aborts{0};
  std::atomic<int64_t> abort_started_ns{0};
  ElasticHooks hooks;
  hooks.abort_all = [&] {
    abort_started_ns.store(absl::ToUnixNanos(absl::Now()));
    ++aborts;
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_for(lock, absl::ToChronoNanoseconds(blocked_for), [&] { return release; });
  };
  ElasticOptions o = TestOptions();
  o.job = "blocked-abort";
  auto loop = ElasticLoop::Create(**world, store, o, hooks);
  ASSERT_TRUE(loop.ok()) << loop.status();

  const internal::Keys keys(o.job, 1);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  // The first heartbeat, then the alarm.
  ASSERT_TRUE(store->Get(keys.Heartbeat(0), deadline).ok());
  ASSERT_TRUE(SetAlarmAsRankOne(*store, keys, deadline).ok());
  while (aborts.load() == 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(aborts.load(), 1) << "the alarm did not abort the World";

  // While the abort blocks, the heartbeat keeps changing.
  const absl::Time start = absl::FromUnixNanos(abort_started_ns.load());
  std::string last = *store->Get(keys.Heartbeat(0), deadline);
  absl::Time last_change = absl::Now();
  absl::Duration longest = absl::ZeroDuration();
  int changes = 0;
  while (absl::Now() < start + blocked_for - absl::Milliseconds(200)) {
    absl::SleepFor(absl::Milliseconds(10));
    std::string v = *store->Get(keys.Heartbeat(0), deadline);
    const absl::Time now = absl::Now();
    if (v != last) {
      longest = std::max(longest, now - last_change);
      last = v;
      last_change = now;
      ++changes;
    }
  }
  longest = std::max(longest, absl::Now() - last_change);
  {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
  }
  cv.notify_all();
  EXPECT_GE(changes, 3) << "the heartbeat changed " << changes << " times in "
                        << absl::FormatDuration(blocked_for) << " of a blocked abort";
  EXPECT_LT(longest, blocked_for / 2)
      << "the heartbeat stood still for " << absl::FormatDuration(longest)
      << " while the abort blocked (interval " << absl::FormatDuration(o.heartbeat_interval) << ")";
  EXPECT_TRUE((*loop)->alarmed());
  loop->reset();  // joins the monitor and the aborter
  EXPECT_EQ(aborts.load(), 1);
}

// The monitor beats (and reads its successor's beat) ten times a
// heartbeat_timeout, not every interval: the beats need only resolve the
// timeout, while the alarm, which a recovery waits on, is looked at every
// interval. With a 20 ms interval and a 1 s timeout, about 15 beats in
// 1.5 s (every interval: about 75).
TEST(ElasticLoopTest, TheMonitorBeatsTenTimesATimeoutAndLooksAtTheAlarmEveryInterval) {
  auto store = MakeMemoryStore();
  auto world = DpWorld(store, 0, 1);
  ASSERT_TRUE(world.ok()) << world.status();
  std::atomic<int> aborts{0};
  ElasticHooks hooks;
  hooks.abort_all = [&] { ++aborts; };
  ElasticOptions o = TestOptions();
  o.job = "beats";
  o.heartbeat_interval = absl::Milliseconds(20);
  o.heartbeat_timeout = absl::Seconds(1);
  auto loop = ElasticLoop::Create(**world, store, o, hooks);
  ASSERT_TRUE(loop.ok()) << loop.status();
  const internal::Keys keys(o.job, 1);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  std::string last = *store->Get(keys.Heartbeat(0), deadline);
  int changes = 0;
  const absl::Time end = absl::Now() + absl::Milliseconds(1500);
  while (absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(2));
    std::string v = *store->Get(keys.Heartbeat(0), deadline);
    if (v != last) ++changes;
    last = v;
  }
  EXPECT_GE(changes, 5);
  EXPECT_LE(changes, 30) << "a beat every interval?";
  // The alarm is still seen: the World is aborted.
  ASSERT_TRUE(SetAlarmAsRankOne(*store, keys, deadline).ok());
  while (aborts.load() == 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(2));
  EXPECT_EQ(aborts.load(), 1);
  EXPECT_TRUE((*loop)->alarmed());
  loop->reset();
}

}  // namespace
}  // namespace strata::elastic
