// World generations on real ranks: the ranks of one data-parallel replica
// leave, the survivors shrink the root and rebuild the World in place on a
// smaller mesh; every group is then the new mesh's, handles taken before
// follow (or, pinned to a layout that changed, say so), pipeline runners
// follow or refuse, and work of the old generation fails with Aborted.
// Also: AbortAll from another thread, and a failed rebuild that leaves the
// World saying so until a later one repairs it.
#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "harness.h"
#include "pipeline_test_model.h"
#include "strata/parallel/pipeline/generate.h"
#include "strata/parallel/pipeline/runner.h"
#include "strata/parallel/world.h"
#include "world_test_util.h"

namespace strata::testing {
namespace {

using pipeline::PipelineRunner;
using pipeline::RunnerOptions;
using pipeline::Schedule;
using pipeline::StepResult;
using pipeline::testing::TestFunctions;
using pipeline::testing::TestModel;

class WorldRebuildTest : public MultiRankTest {
 protected:
  // How a wait on a group of an aborted (or rebuilt) generation ends:
  // Aborted by this rank's abort, or, over Gloo, Unavailable when a peer's
  // abort closed the connections first.
  static void ExpectEndedByAbort(const absl::Status& s) {
    EXPECT_TRUE(s.code() == absl::StatusCode::kAborted ||
                (BackendIs("gloo") && s.code() == absl::StatusCode::kUnavailable))
        << s;
  }

  static CommOptions RootOptionsNamed(const std::string& name) {
    CommOptions o;
    o.name = name;
    o.timeout = absl::Seconds(60);
    return o;
  }

  // A runner of a 1F1B schedule with one stage per rank of `group`.
  static std::unique_ptr<PipelineRunner> Runner(const GroupHandle& group, int ranks) {
    pipeline::ScheduleOptions generate;  // 1F1B
    generate.num_ranks = ranks;
    generate.num_microbatches = 2 * ranks;
    absl::StatusOr<Schedule> schedule = pipeline::GenerateSchedule(generate);
    EXPECT_TRUE(schedule.ok()) << schedule.status();
    if (!schedule.ok()) return nullptr;
    RunnerOptions options;
    options.timeout = absl::Seconds(60);
    absl::StatusOr<std::unique_ptr<PipelineRunner>> runner =
        PipelineRunner::Create(*schedule, group, options);
    EXPECT_TRUE(runner.ok()) << runner.status();
    return runner.ok() ? std::move(runner).value() : nullptr;
  }

  static absl::Status Step(PipelineRunner& runner) {
    TestModel model(runner.schedule().num_stages());
    return runner.Step(TestFunctions(&model, /*variable=*/true, /*split=*/false)).status();
  }
};

TEST_F(WorldRebuildTest, SurvivorsOfALeavingDpReplicaRebuildInPlace) {
  if (size() != 8) GTEST_SKIP() << "needs 8 ranks";
  MeshSpec spec;
  spec.world_size = 8;
  spec.tp = 2;  // dp 4: replicas {0,1} {2,3} {4,5} {6,7}
  absl::StatusOr<LaunchEnv> env = LaunchEnv::Detect();
  ASSERT_TRUE(env.ok());
  STRATA_ASSERT_OK_AND_ASSIGN(auto world, World::Create(*env, MakeMesh(spec), WorldTestOptions()));
  // Handles taken in generation 1, one of a group created on request.
  STRATA_ASSERT_OK_AND_ASSIGN(GroupHandle tp, world->Handle("tp"));
  STRATA_ASSERT_OK_AND_ASSIGN(GroupHandle dp, world->Handle("dp"));
  STRATA_ASSERT_OK_AND_ASSIGN(GroupHandle tp_dp, world->Handle("dp-tp"));
  STRATA_ASSERT_OK_AND_ASSIGN(GroupHandle whole, world->Handle("world"));
  STRATA_ASSERT_OK_AND_ASSIGN(GroupHandle tp_pinned, tp.Pin("tensor-parallel layer"));
  STRATA_ASSERT_OK_AND_ASSIGN(GroupHandle dp_pinned, dp.Pin("pipeline runner"));
  EXPECT_EQ(tp_dp.name(), "tp-dp");
  EXPECT_EQ(dp_pinned.layout_change(), LayoutChange::kRefuse);
  // Pipeline runners over tp (whose layout survives) and dp (whose does not).
  std::unique_ptr<PipelineRunner> over_tp = Runner(tp, 2);
  std::unique_ptr<PipelineRunner> over_dp = Runner(dp, 4);
  ASSERT_NE(over_tp, nullptr);
  ASSERT_NE(over_dp, nullptr);
  STRATA_EXPECT_OK(Step(*over_tp));
  STRATA_EXPECT_OK(Step(*over_dp));
  const int old_dp_rank = rank() / 2;

  // World ranks 2 and 3 (dp replica 1) leave: they destroy their World and
  // take no part in anything that follows.
  if (rank() == 2 || rank() == 3) {
    world.reset();
    EXPECT_EQ(tp.Resolve().status().code(), absl::StatusCode::kFailedPrecondition);
    return;
  }
  // Work of generation 1 still in flight at the rebuild: a receive nobody
  // will send.
  std::unique_ptr<Work> pending;
  int32_t never = 0;
  if (rank() == 0) {
    STRATA_ASSERT_OK_AND_ASSIGN(Communicator * old_dp, dp.Resolve());
    STRATA_ASSERT_OK_AND_ASSIGN(pending, old_dp->Recv(Buffer::Of(&never, 1), 1));
  }

  // The survivors shrink the root without the leavers and rebuild on dp3 x tp2.
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Communicator> shrunk,
                              world->root().Shrink({2, 3}, RootOptionsNamed("world")));
  ASSERT_NE(shrunk, nullptr);
  MeshSpec smaller = spec;
  smaller.world_size = 6;
  const Mesh mesh = MakeMesh(smaller);
  STRATA_ASSERT_OK(world->Rebuild(std::move(shrunk), mesh));
  const int new_rank = rank() < 2 ? rank() : rank() - 2;
  EXPECT_EQ(world->generation(), 2u);
  EXPECT_EQ(world->rank(), new_rank);
  EXPECT_EQ(world->size(), 6);
  EXPECT_EQ(world->mesh().dp(), 3);
  STRATA_EXPECT_OK(world->status());

  if (pending != nullptr) ExpectEndedByAbort(pending->Wait(absl::Now() + absl::Seconds(30)));

  // Every standard group is the new mesh's and works.
  CheckGroups(*world, world->GroupNames());
  // Handles taken before resolve to the new groups ("tp-dp", not standard,
  // is created again on its first use, by every survivor alike).
  for (const GroupHandle* h : {&tp, &dp, &tp_dp, &whole}) {
    absl::StatusOr<Communicator*> c = h->Resolve();
    ASSERT_TRUE(c.ok()) << h->name() << ": " << c.status();
    CheckGroup(*world, **c, h->name());
  }
  // Pinned: tp keeps its layout and is followed; dp does not.
  STRATA_ASSERT_OK_AND_ASSIGN(Communicator * new_tp, tp_pinned.Resolve());
  EXPECT_EQ(new_tp->size(), 2);
  absl::StatusOr<Communicator*> refused = dp_pinned.Resolve();
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  const std::string layout_error =
      absl::StrCat("group 'dp' was rank ", old_dp_rank,
                   " of 4 at world generation 1; at generation 2 this "
                   "rank is rank ",
                   new_rank / 2,
                   " of 3: this pipeline runner was built for the old layout; "
                   "build a new one");
  EXPECT_EQ(refused.status().message(), layout_error);

  // The runners resolve at each step: tp's follows, dp's refuses.
  STRATA_EXPECT_OK(Step(*over_tp));
  absl::Status stale = Step(*over_dp);
  EXPECT_EQ(stale.code(), absl::StatusCode::kFailedPrecondition) << stale;
  EXPECT_TRUE(absl::StrContains(stale.message(), layout_error)) << stale;
  // A runner built now, for the new layout, works.
  std::unique_ptr<PipelineRunner> fresh = Runner(dp, 3);
  ASSERT_NE(fresh, nullptr);
  STRATA_EXPECT_OK(Step(*fresh));
}

// AbortAll from another thread ends a wait on a group at once; the world
// is then rebuilt over a spare root and works again.
TEST_F(WorldRebuildTest, AbortAllFromAnotherThreadThenRebuild) {
  MeshSpec spec;
  spec.world_size = size();
  absl::StatusOr<LaunchEnv> env = LaunchEnv::Detect();
  ASSERT_TRUE(env.ok());
  STRATA_ASSERT_OK_AND_ASSIGN(auto world, World::Create(*env, MakeMesh(spec), WorldTestOptions()));
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Communicator> spare,
                              world->root().Split(0, world->rank(), RootOptionsNamed("spare")));
  STRATA_ASSERT_OK_AND_ASSIGN(GroupHandle dp, world->Handle("dp"));
  STRATA_ASSERT_OK_AND_ASSIGN(Communicator * comm, dp.Resolve());
  int32_t never = 0;
  STRATA_ASSERT_OK_AND_ASSIGN(auto recv, comm->Recv(Buffer::Of(&never, 1), comm->size() - 1));
  std::atomic<bool> waiting{false};
  std::thread aborter([&] {
    while (!waiting.load()) std::this_thread::yield();
    absl::SleepFor(absl::Milliseconds(50));
    world->AbortAll();
  });
  waiting.store(true);
  const absl::Time start = absl::Now();
  absl::Status s = recv->Wait(absl::Now() + absl::Seconds(100));  // only the abort ends it
  aborter.join();
  ExpectEndedByAbort(s);
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  absl::StatusOr<std::unique_ptr<Work>> later = comm->Barrier();
  EXPECT_EQ(later.status().code(), absl::StatusCode::kFailedPrecondition) << later.status();
  world->AbortAll();  // idempotent

  STRATA_ASSERT_OK(world->Rebuild(std::move(spare), world->mesh()));
  EXPECT_EQ(world->generation(), 2u);
  CheckGroups(*world, world->GroupNames());
  STRATA_ASSERT_OK_AND_ASSIGN(Communicator * again, dp.Resolve());
  CheckGroup(*world, *again, "dp");
}

// A thread waiting for work of the old generation while another rebuilds
// the World gets Aborted, and the wait never touches the destroyed
// communicator (Gloo: a waiter may be running the transfer's completion
// itself; the communicator waits for it to leave).
TEST_F(WorldRebuildTest, WorkWaitedForOnAnotherThreadDuringARebuild) {
  MeshSpec spec;
  spec.world_size = size();
  absl::StatusOr<LaunchEnv> env = LaunchEnv::Detect();
  ASSERT_TRUE(env.ok());
  STRATA_ASSERT_OK_AND_ASSIGN(auto world, World::Create(*env, MakeMesh(spec), WorldTestOptions()));
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Communicator> spare,
                              world->root().Split(0, world->rank(), RootOptionsNamed("spare")));
  STRATA_ASSERT_OK_AND_ASSIGN(Communicator * dp, world->Group("dp"));
  int32_t never = 0;
  const int from = (dp->rank() + 1) % dp->size();
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Work> recv, dp->Recv(Buffer::Of(&never, 1), from));
  absl::Status waited;
  std::atomic<bool> started{false};
  std::thread waiter([&] {
    started.store(true);
    waited = recv->Wait(absl::Now() + absl::Seconds(100));  // only the rebuild ends it
  });
  while (!started.load()) std::this_thread::yield();
  absl::SleepFor(absl::Milliseconds(100));
  const absl::Time start = absl::Now();
  STRATA_ASSERT_OK(world->Rebuild(std::move(spare), world->mesh()));
  waiter.join();
  ExpectEndedByAbort(waited);
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  EXPECT_EQ(recv->Wait(absl::Now()).code(), waited.code());  // again, after
  EXPECT_EQ(recv->Test().status().code(), waited.code());
  CheckGroups(*world, {"dp"});
}

// Bad arguments leave the World as it was; a rebuild that fails later
// leaves it broken at the new generation, saying why, until a rebuild
// succeeds.
TEST_F(WorldRebuildTest, AFailedRebuildSaysSoUntilOneSucceeds) {
  MeshSpec spec;
  spec.world_size = size();
  absl::StatusOr<LaunchEnv> env = LaunchEnv::Detect();
  ASSERT_TRUE(env.ok());
  STRATA_ASSERT_OK_AND_ASSIGN(auto world, World::Create(*env, MakeMesh(spec), WorldTestOptions()));
  std::vector<std::unique_ptr<Communicator>> spares;
  for (int i = 0; i < 3; ++i) {
    STRATA_ASSERT_OK_AND_ASSIGN(
        std::unique_ptr<Communicator> s,
        world->root().Split(0, world->rank(), RootOptionsNamed(absl::StrCat("spare", i))));
    spares.push_back(std::move(s));
  }
  STRATA_ASSERT_OK_AND_ASSIGN(GroupHandle tp, world->Handle("tp"));

  absl::Status null_root = world->Rebuild(nullptr, world->mesh());
  EXPECT_EQ(null_root.code(), absl::StatusCode::kInvalidArgument) << null_root;
  MeshSpec twice = spec;
  twice.world_size = 2 * size();
  absl::Status wrong_mesh = world->Rebuild(std::move(spares[0]), MakeMesh(twice));
  EXPECT_EQ(wrong_mesh.code(), absl::StatusCode::kInvalidArgument) << wrong_mesh;
  EXPECT_TRUE(absl::StrContains(wrong_mesh.message(), "the mesh is for")) << wrong_mesh;
  EXPECT_EQ(world->generation(), 1u);
  STRATA_EXPECT_OK(world->status());
  STRATA_EXPECT_OK(tp.Resolve().status());

  // An aborted root: the new groups cannot be split from it.
  STRATA_EXPECT_OK(spares[1]->Abort());
  absl::Status failed = world->Rebuild(std::move(spares[1]), world->mesh());
  EXPECT_FALSE(failed.ok());
  EXPECT_TRUE(absl::StrContains(failed.message(), "rebuilding the World to generation 2"))
      << failed;
  EXPECT_EQ(world->generation(), 2u);
  EXPECT_EQ(world->status().code(), absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<Communicator*> broken = world->Group("tp");
  EXPECT_EQ(broken.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(broken.status().message(),
                                "group 'tp': world generation 2 is unusable: its rebuild failed"))
      << broken.status();
  EXPECT_EQ(tp.Resolve().status().code(), absl::StatusCode::kFailedPrecondition);
  world->AbortAll();

  STRATA_ASSERT_OK(world->Rebuild(std::move(spares[2]), world->mesh()));
  EXPECT_EQ(world->generation(), 3u);
  STRATA_EXPECT_OK(world->status());
  CheckGroups(*world, world->GroupNames());
  STRATA_ASSERT_OK_AND_ASSIGN(Communicator * again, tp.Resolve());
  CheckGroup(*world, *again, "tp");
}

}  // namespace
}  // namespace strata::testing
