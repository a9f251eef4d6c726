// Growing back (ElasticLoop::Join) with ranks as threads: real Gloo
// communicators over a memory store. A process that was not part of the
// job asks to join; the members admit it at a step boundary, the regroup
// makes a fresh job communicator through the store, and the joiner either
// completes a replica (dp grows back to the job's first dp; it receives its
// position's parameters from its dp group) or stands by as a spare. Every
// survivor ends on the reference computed here (the global batch is kept,
// so the reference does not depend on dp). Also: a joiner with another
// config is refused (by itself and by the agreement), and a joiner that
// dies right after its regroup is dropped again while the members train on.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "comm/gloo/gloo_communicator.h"
#include "elastic/internal/keys.h"
#include "reference_model.h"
#include "strata/base/status.h"
#include "strata/elastic/elastic_loop.h"
#include "strata/parallel/world.h"

namespace strata::elastic {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

using testing::Grad;
using testing::kGlobalBatch;
using testing::kLr;
using testing::kParams;
using testing::Reference;

ElasticOptions TestOptions(const std::string& config = "model-a") {
  ElasticOptions o = testing::ThreadRankOptions();
  o.join_timeout = absl::Seconds(30);
  o.config = config;
  return o;
}

// One rank's training: the step of the loop tests (a dp and a tp
// all-reduce), and a restore that gives every rank new to its position (a
// placed spare, a grown joiner) its dp group's parameters.
struct Trainer {
  std::vector<double> params = std::vector<double>(kParams, 1.0);
  std::vector<double> grad = std::vector<double>(kParams);
  std::function<void(int64_t)> before_step;  // the test's gate

  LoopCallbacks Callbacks(World& world) {
    LoopCallbacks cb;
    cb.step = [this](const StepContext& ctx) -> absl::Status {
      if (before_step) before_step(ctx.step);
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
        STRATA_ASSIGN_OR_RETURN(Communicator * g, ctx.world->Group(axes));
        STRATA_ASSIGN_OR_RETURN(
            std::unique_ptr<Work> w,
            g->AllReduce(ConstBuffer(grad.data(), kParams, DataType::kFloat64),
                         Buffer::Of(grad.data(), kParams),
                         std::string(axes) == "dp" ? ReduceOp::kSum : ReduceOp::kAvg));
        STRATA_RETURN_IF_ERROR(w->Wait());
      }
      return absl::OkStatus();
    };
    cb.apply = [this](const StepContext&) {
      for (int p = 0; p < kParams; ++p) params[p] -= kLr * grad[p];
      return absl::OkStatus();
    };
    cb.restore = [this, &world](RecoveryEvent& e) -> absl::Status {
      std::vector<int> arrived = e.grown;
      for (const auto& pair : e.replaced) arrived.push_back(pair.second);
      if (arrived.empty()) return absl::OkStatus();
      STRATA_ASSIGN_OR_RETURN(std::vector<int> group, world.mesh().GroupOf(world.rank(), "dp"));
      int source = -1;
      bool gains = false;
      for (int i = 0; i < static_cast<int>(group.size()); ++i) {
        const int job = e.members[group[i]];
        const bool is_new = std::find(arrived.begin(), arrived.end(), job) != arrived.end();
        gains = gains || is_new;
        if (!is_new && source < 0) source = i;
      }
      if (!gains) return absl::OkStatus();
      STRATA_ASSIGN_OR_RETURN(Communicator * dp, world.Group("dp"));
      STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Work> b,
                              dp->Broadcast(Buffer::Of(params.data(), kParams), source));
      return b->Wait();
    };
    return cb;
  }
};

struct Result {
  absl::Status status;
  LoopResult loop;
  std::vector<double> params;
  Membership membership;
};

// A member of a world of `n` ranks (`spares` of them spares) over a mesh of
// `tp`, made through `store`.
absl::StatusOr<std::unique_ptr<World>> MemberWorld(const std::shared_ptr<Store>& store, int r,
                                                   int n, int tp, int spares = 0) {
  RootOptions ro;
  ro.comm.timeout = absl::Seconds(60);
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<gloo::GlooCommunicator> root,
                          gloo::GlooCommunicator::CreateRoot(ro, store, r, n));
  MeshSpec spec;
  spec.world_size = n - spares;
  spec.tp = tp;
  WorldOptions wo;
  wo.root.comm.timeout = absl::Seconds(60);
  wo.spares = spares;
  STRATA_ASSIGN_OR_RETURN(Mesh mesh, Mesh::Create(spec));
  return World::FromRoot(std::move(root), mesh, wo);
}

// The number of join requests so far (what the test gates steps on: the
// members wait at `gate` until a joiner asked, so that it is admitted at a
// known point of the run).
int64_t Joins(Store& store) {
  absl::StatusOr<int64_t> n =
      store.Add(internal::Keys("default", 0).Joins(), 0, absl::Now() + absl::Seconds(5));
  return n.ok() ? *n : -1;
}

// Whether the agreement of `epoch` decided (the death's recovery, here).
bool Decided(Store& store, uint64_t epoch) {
  return store.Get(internal::Keys("default", epoch).Decision(), absl::InfinitePast()).ok();
}

void WaitForJoins(Store& store, int64_t count) {
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (Joins(store) < count && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(5));
}

// Runs a member: Run to `steps`, or, when `die_at` >= 0, a hand-written
// loop up to that step, then "dies" (its monitor stops, its connections
// close).
Result RunMember(const std::shared_ptr<Store>& store, int r, int n, int tp, int64_t steps,
                 int64_t die_at, int64_t gate, const ElasticOptions& options) {
  Result out;
  absl::StatusOr<std::unique_ptr<World>> world = MemberWorld(store, r, n, tp);
  if (!world.ok()) return Result{world.status()};
  absl::StatusOr<std::unique_ptr<ElasticLoop>> loop = ElasticLoop::Create(**world, store, options);
  if (!loop.ok()) return Result{loop.status()};
  Trainer t;
  t.before_step = [&](int64_t step) {
    if (step == gate) WaitForJoins(*store, 1);
  };
  LoopCallbacks cb = t.Callbacks(**world);
  if (die_at >= 0) {
    for (int64_t step = 0; step < die_at;) {
      StepContext ctx;
      ctx.step = step;
      ctx.world = world->get();
      absl::Status s = (*loop)->BeginStep(step);
      if (s.ok()) s = cb.step(ctx);
      if (!s.ok()) (*loop)->ReportFailure(s);
      absl::StatusOr<bool> committed = (*loop)->Commit(step, s.ok());
      if (!committed.ok()) return Result{committed.status()};
      if (*committed) {
        (void)cb.apply(ctx);
        ++step;
        if (!(*loop)->joiners_waiting()) continue;
        (void)(*loop)->Admit(step);
      }
      absl::StatusOr<ElasticLoop::Recovery> rec = (*loop)->Recover();
      if (!rec.ok()) return Result{rec.status()};
      if (absl::Status restored = cb.restore(rec->event); !restored.ok()) return Result{restored};
    }
    loop->reset();
    (*world)->AbortAll();
    return Result{absl::CancelledError("this rank died")};
  }
  absl::StatusOr<LoopResult> result = (*loop)->Run(cb, 0, steps);
  out.membership = (*loop)->membership();
  if (!result.ok()) return Result{result.status()};
  out.loop = *result;
  out.params = t.params;
  return out;
}

// A joiner: asks once `start` says so, then runs (or, with `die`, drops
// its World and loop right after the regroup, before any state arrives).
Result RunJoiner(const std::shared_ptr<Store>& store, int64_t steps,
                 const std::function<bool()>& start, const ElasticOptions& options,
                 bool die = false) {
  while (!start()) absl::SleepFor(absl::Milliseconds(5));
  JoinOptions jo;
  jo.world.root.comm.timeout = absl::Seconds(60);
  absl::StatusOr<Joined> joined = ElasticLoop::Join(store, options, jo);
  if (!joined.ok()) return Result{joined.status()};
  if (die) {
    joined->loop.reset();
    joined->world->AbortAll();
    return Result{absl::CancelledError("the joiner died")};
  }
  Trainer t;
  absl::StatusOr<LoopResult> result =
      joined->loop->Run(t.Callbacks(*joined->world), joined->event.step, steps);
  Result out;
  out.membership = joined->loop->membership();
  if (!result.ok()) return Result{result.status()};
  out.loop = *result;
  out.params = t.params;
  return out;
}

// Runs `members` member threads (member(r)) and one joiner thread
// (joiner()) to the end; results[r] for the members, results[members] for
// the joiner.
std::vector<Result> RunAll(int members, const std::function<Result(int)>& member,
                           const std::function<Result()>& joiner) {
  std::vector<Result> results(static_cast<size_t>(members) + 1);
  std::vector<std::thread> threads;
  for (int r = 0; r < members; ++r) {
    threads.emplace_back([&, r] { results[r] = member(r); });
  }
  threads.emplace_back([&] { results[members] = joiner(); });
  for (std::thread& t : threads) t.join();
  return results;
}

TEST(ElasticJoinTest, AJoinerGrowsDpBackAndTrainsToTheReference) {
  // dp4: rank 3 dies at step 2 (dp3); a joiner asks once the members are
  // at step 5, is admitted there, completes a fourth replica (dp4 again)
  // and receives its parameters; all four end on the reference.
  auto store = MakeMemoryStore();
  std::vector<Result> results = RunAll(
      4, [&](int r) { return RunMember(store, r, 4, 1, 10, r == 3 ? 2 : -1, 5, TestOptions()); },
      [&] {
        return RunJoiner(
            store, 10, [&] { return Decided(*store, 1); }, TestOptions());
      });
  for (int r : {0, 1, 2, 4}) {
    const Result& res = results[r];
    ASSERT_TRUE(res.status.ok()) << "rank " << r << ": " << res.status;
    EXPECT_EQ(res.params, Reference(10)) << "rank " << r;
    EXPECT_EQ(res.membership.mesh.dp, 4) << "rank " << r;
    EXPECT_THAT(res.membership.members, ElementsAre(0, 1, 2, 4));
    EXPECT_EQ(res.membership.joins_seen, 1);
  }
  const std::vector<RecoveryEvent>& events = results[0].loop.events;
  ASSERT_EQ(events.size(), 2u);
  EXPECT_THAT(events[0].failed, ElementsAre(3));
  EXPECT_EQ(events[0].mesh_after.dp, 3);
  EXPECT_EQ(events[1].cause.source, DetectionSource::kJoin) << events[1].ToJson();
  EXPECT_THAT(events[1].joined, ElementsAre(4));
  EXPECT_THAT(events[1].grown, ElementsAre(4));
  EXPECT_EQ(events[1].mesh_after.dp, 4);
  // Admitted at a step boundary after the death's recovery, by step 5.
  EXPECT_GE(events[1].step, 3);
  EXPECT_LE(events[1].step, 6);
  const std::vector<RecoveryEvent>& mine = results[4].loop.events;
  ASSERT_EQ(mine.size(), 1u);
  EXPECT_TRUE(mine[0].placed);
  EXPECT_EQ(mine[0].step, events[1].step);
}

TEST(ElasticJoinTest, AJoinerThatAsksDuringARecoveryIsTakenInByIt) {
  // dp4: rank 3 dies at step 2; the joiner asks as soon as the epoch's
  // alarm is up, while the leader still waits to hear from rank 3 (its
  // heartbeat must go stale first). The leader of that agreement answers
  // the request: the replica of rank 3 is dropped and the joiner completes
  // a new one in the same decision, so dp never drops below 4. (Were the
  // joiner slower, the next step boundary would take it in.)
  auto store = MakeMemoryStore();
  std::vector<Result> results = RunAll(
      4, [&](int r) { return RunMember(store, r, 4, 1, 10, r == 3 ? 2 : -1, -1, TestOptions()); },
      [&] {
        return RunJoiner(
            store, 10,
            [&] {
              return store->Get(internal::Keys("default", 1).Alarm(), absl::InfinitePast()).ok();
            },
            TestOptions());
      });
  for (int r : {0, 1, 2, 4}) {
    const Result& res = results[r];
    ASSERT_TRUE(res.status.ok()) << "rank " << r << ": " << res.status;
    EXPECT_EQ(res.params, Reference(10)) << "rank " << r;
    EXPECT_EQ(res.membership.mesh.dp, 4);
    EXPECT_THAT(res.membership.members, ElementsAre(0, 1, 2, 4));
  }
  const std::vector<RecoveryEvent>& events = results[0].loop.events;
  ASSERT_FALSE(events.empty());
  EXPECT_THAT(events[0].failed, ElementsAre(3));
  if (events.size() == 1) {
    EXPECT_THAT(events[0].joined, ElementsAre(4));
    EXPECT_THAT(events[0].grown, ElementsAre(4));
    EXPECT_EQ(events[0].mesh_after.dp, 4);
  } else {
    ADD_FAILURE() << "the joiner asked after the agreement answered (a loaded host?): "
                  << events[1].ToJson();
  }
}

TEST(ElasticJoinTest, AJoinerStandsByWhenDpIsFullThenTakesAFailedPlace) {
  // dp2 x tp2 and nothing lost: the joiner (job rank 4) becomes a spare at
  // step 3; rank 1 dies at step 6 and the spare takes its place (dp stays).
  auto store = MakeMemoryStore();
  std::vector<Result> results = RunAll(
      4, [&](int r) { return RunMember(store, r, 4, 2, 10, r == 1 ? 6 : -1, 3, TestOptions()); },
      [&] {
        return RunJoiner(
            store, 10, [] { return true; }, TestOptions());
      });
  for (int r : {0, 2, 3, 4}) {
    const Result& res = results[r];
    ASSERT_TRUE(res.status.ok()) << "rank " << r << ": " << res.status;
    EXPECT_EQ(res.params, Reference(10)) << "rank " << r;
    EXPECT_EQ(res.membership.mesh.dp, 2);
    EXPECT_THAT(res.membership.members, ElementsAre(0, 4, 2, 3));
  }
  const std::vector<RecoveryEvent>& events = results[0].loop.events;
  ASSERT_EQ(events.size(), 2u);
  EXPECT_THAT(events[0].joined, ElementsAre(4));
  EXPECT_TRUE(events[0].grown.empty());
  EXPECT_THAT(events[0].spares, ElementsAre(4));
  EXPECT_EQ(events[0].mesh_after.dp, 2);
  EXPECT_THAT(events[1].failed, ElementsAre(1));
  EXPECT_THAT(events[1].replaced, ElementsAre(std::make_pair(1, 4)));
  EXPECT_FALSE(results[4].loop.stood_by);
}

TEST(ElasticJoinTest, AJoinerWithAnotherConfigIsRefused) {
  // The joiner's own check, against the job's facts: refused at once,
  // naming both configs. A request with another config written straight
  // into the store (as an older joiner would have) is refused by the
  // agreement; the members regroup onto themselves and train on.
  auto store = MakeMemoryStore();
  std::vector<Result> results(4);
  std::vector<std::thread> threads;
  for (int r = 0; r < 4; ++r) {
    threads.emplace_back(
        [&, r] { results[r] = RunMember(store, r, 4, 2, 8, -1, 3, TestOptions()); });
  }
  absl::StatusOr<Joined> refused;
  std::thread joiner([&] {
    refused = ElasticLoop::Join(store, TestOptions("model-b"), JoinOptions{});
    const internal::Keys keys("default", 0);
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    absl::StatusOr<int64_t> n = store->Add(keys.Joins(), 1, deadline);
    ASSERT_TRUE(n.ok()) << n.status();
    ASSERT_TRUE(store->Set(keys.Join(*n), R"({"rank": 9, "config": "model-c"})", deadline).ok());
  });
  joiner.join();
  for (std::thread& t : threads) t.join();
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("'model-b' is not the job's 'model-a'"));
  absl::StatusOr<std::string> answer =
      store->Get(internal::Keys("default", 0).JoinAnswer(1), absl::Now() + absl::Seconds(1));
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_THAT(*answer, HasSubstr("its config 'model-c' is not the job's 'model-a'"));
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(results[r].status.ok()) << "rank " << r << ": " << results[r].status;
    EXPECT_EQ(results[r].params, Reference(8));
    EXPECT_THAT(results[r].membership.members, ElementsAre(0, 1, 2, 3));
    ASSERT_EQ(results[r].loop.events.size(), 1u);
    EXPECT_TRUE(results[r].loop.events[0].joined.empty());
  }
}

TEST(ElasticJoinTest, AJoinerFindsTheJobFinishedWhileItWaitsOrBeforeItAsks) {
  // The members finish while a joiner waits for its answer (a request made
  // during their last step is never answered): the joiner returns without
  // a World (finished()), not after join_timeout. A joiner that comes later
  // returns at once, without asking.
  auto store = MakeMemoryStore();
  std::atomic<bool> finish{false};
  std::vector<absl::Status> members(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      absl::StatusOr<std::unique_ptr<World>> world = MemberWorld(store, r, 2, 1);
      if (!world.ok()) {
        members[r] = world.status();
        return;
      }
      auto loop = ElasticLoop::Create(**world, store, TestOptions());
      if (!loop.ok()) {
        members[r] = loop.status();
        return;
      }
      while (!finish.load()) absl::SleepFor(absl::Milliseconds(5));
      members[r] = (*loop)->Finish();
    });
  }
  ElasticOptions o = TestOptions();
  o.join_timeout = absl::Seconds(60);
  absl::StatusOr<Joined> waited;
  absl::Time returned;
  std::thread joiner([&] {
    waited = ElasticLoop::Join(store, o, JoinOptions{});
    returned = absl::Now();
  });
  WaitForJoins(*store, 1);
  ASSERT_EQ(Joins(*store), 1);
  absl::SleepFor(absl::Milliseconds(300));
  const absl::Time finished_at = absl::Now();
  finish = true;
  joiner.join();
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(members[r].ok()) << "rank " << r << ": " << members[r];
  ASSERT_TRUE(waited.ok()) << waited.status();
  EXPECT_TRUE(waited->finished());
  EXPECT_EQ(waited->world, nullptr);
  EXPECT_LT(returned - finished_at, absl::Seconds(10)) << "the joiner waited for its answer";

  absl::StatusOr<Joined> late = ElasticLoop::Join(store, o, JoinOptions{});
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_TRUE(late->finished());
  EXPECT_EQ(Joins(*store), 1) << "a joiner asked a finished job";
}

TEST(ElasticJoinTest, AJoinerThatDiesBeforeItsStateArrivesIsDroppedAgain) {
  // dp4, rank 3 dies at step 2 (dp3); a joiner completes a fourth replica
  // at step 5 and dies at once: the members' broadcast of its state fails,
  // they recover again without it (dp3) and end on the reference.
  auto store = MakeMemoryStore();
  std::vector<Result> results = RunAll(
      4, [&](int r) { return RunMember(store, r, 4, 1, 10, r == 3 ? 2 : -1, 5, TestOptions()); },
      [&] {
        return RunJoiner(
            store, 10, [&] { return Decided(*store, 1); }, TestOptions(), /*die=*/true);
      });
  EXPECT_EQ(results[4].status.code(), absl::StatusCode::kCancelled) << results[4].status;
  for (int r : {0, 1, 2}) {
    const Result& res = results[r];
    ASSERT_TRUE(res.status.ok()) << "rank " << r << ": " << res.status;
    EXPECT_EQ(res.params, Reference(10)) << "rank " << r;
    EXPECT_EQ(res.membership.mesh.dp, 3);
    EXPECT_THAT(res.membership.members, ElementsAre(0, 1, 2));
    const std::vector<RecoveryEvent>& events = res.loop.events;
    ASSERT_GE(events.size(), 3u);
    EXPECT_THAT(events[1].grown, ElementsAre(4));
    EXPECT_THAT(events.back().failed, ElementsAre(4));
  }
}

}  // namespace
}  // namespace strata::elastic
