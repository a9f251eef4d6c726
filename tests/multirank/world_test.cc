// strata::World on 2, 4 and 8 ranks: every one of the 30 group names of a
// dp2 x tp2 x pp2 mesh and of a mesh with expert parallelism holds exactly
// the ranks the Mesh says, in the Mesh's order, and works; groups beyond
// the standard ones are created on first request, with the ranks' requests
// checked against each other; groups that share a communicator report
// their own names; worlds are rebuilt in one process.
#include "strata/parallel/world.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "harness.h"
#include "world_test_util.h"

namespace strata::testing {
namespace {

class WorldTest : public MultiRankTest {};

// A host communicator that says it works on device memory, so that the
// World takes the path of device roots (NCCL, whose collectives need
// device memory) on CPU ranks: the agreement before a group is created on
// request is then a probe split. Everything else is the host communicator.
class DeviceLike final : public Communicator {
 public:
  explicit DeviceLike(std::unique_ptr<Communicator> host)
      : Communicator(Options(*host), Membership{host->rank(), host->size(), host->world_rank()},
                     host->capabilities()),
        host_(std::move(host)) {}
  absl::string_view backend() const override { return host_->backend(); }
  MemoryKind memory() const override { return MemoryKind::kCuda; }

  int splits() const { return splits_; }

 protected:
  absl::StatusOr<std::unique_ptr<Work>> DoAllReduce(ConstBuffer s, Buffer r, ReduceOp op,
                                                    const ResolvedOptions& o) override {
    return host_->AllReduce(s, r, op, Forward(o));
  }
  absl::StatusOr<std::unique_ptr<Work>> DoBroadcast(Buffer b, int root,
                                                    const ResolvedOptions& o) override {
    return host_->Broadcast(b, root, Forward(o));
  }
  absl::StatusOr<std::unique_ptr<Work>> DoReduce(ConstBuffer s, Buffer r, ReduceOp op, int root,
                                                 const ResolvedOptions& o) override {
    return host_->Reduce(s, r, op, root, Forward(o));
  }
  absl::StatusOr<std::unique_ptr<Work>> DoAllGather(ConstBuffer s, Buffer r,
                                                    const ResolvedOptions& o) override {
    return host_->AllGather(s, r, Forward(o));
  }
  absl::StatusOr<std::unique_ptr<Work>> DoReduceScatter(ConstBuffer s, Buffer r, ReduceOp op,
                                                        const ResolvedOptions& o) override {
    return host_->ReduceScatter(s, r, op, Forward(o));
  }
  absl::StatusOr<std::unique_ptr<Work>> DoAllToAll(ConstBuffer s, Buffer r,
                                                   const ResolvedOptions& o) override {
    return host_->AllToAll(s, r, Forward(o));
  }
  absl::StatusOr<std::unique_ptr<Work>> DoAllToAllV(ConstBuffer s, Buffer r,
                                                    const AllToAllCounts& c,
                                                    const ResolvedOptions& o) override {
    return host_->AllToAllV(s, r, c, Forward(o));
  }
  absl::StatusOr<std::unique_ptr<Work>> DoBarrier(const ResolvedOptions& o) override {
    return host_->Barrier(Forward(o));
  }
  absl::StatusOr<std::unique_ptr<Work>> DoSend(ConstBuffer b, int peer,
                                               const ResolvedOptions& o) override {
    return host_->Send(b, peer, Forward(o));
  }
  absl::StatusOr<std::unique_ptr<Work>> DoRecv(Buffer b, int peer,
                                               const ResolvedOptions& o) override {
    return host_->Recv(b, peer, Forward(o));
  }
  absl::StatusOr<std::unique_ptr<Communicator>> DoSplit(int color, int key, const CommOptions& o,
                                                        const ResolvedOptions&) override {
    ++splits_;
    return host_->Split(color, key, o);
  }
  absl::StatusOr<std::unique_ptr<Communicator>> DoShrink(const ShrinkPlan& plan,
                                                         const CommOptions& o,
                                                         const ResolvedOptions&) override {
    return host_->Shrink(plan.excluded, o);
  }
  absl::Status DoAbort() override { return host_->Abort(); }
  absl::Status DoRevoke() override { return host_->Revoke(); }
  absl::Status DoAsyncError() override { return host_->AsyncError(); }

 private:
  static CommOptions Options(const Communicator& host) {
    CommOptions options;
    options.name = host.name();
    options.timeout = host.timeout();
    return options;
  }
  static OpOptions Forward(const ResolvedOptions& resolved) {
    OpOptions options;
    options.timeout = resolved.timeout;
    options.stream = resolved.stream;
    return options;
  }

  std::unique_ptr<Communicator> host_;
  int splits_ = 0;
};

TEST_F(WorldTest, DenseMeshDp2Tp2Pp2EveryCombination) {
  if (size() != 8) GTEST_SKIP() << "needs 8 ranks";
  MeshSpec spec;
  spec.world_size = 8;
  spec.tp = 2;
  spec.pp = 2;
  absl::StatusOr<LaunchEnv> env = LaunchEnv::Detect();
  ASSERT_TRUE(env.ok());
  STRATA_ASSERT_OK_AND_ASSIGN(auto world, World::Create(*env, MakeMesh(spec), WorldTestOptions()));
  EXPECT_EQ(world->rank(), rank());
  EXPECT_EQ(world->size(), 8);
  EXPECT_EQ(world->generation(), 1u);
  // Only the standard groups exist at first.
  const std::vector<std::string> standard = {"tp",       "cp", "dp",  "pp",  "dp-cp", "tp-pp",
                                             "tp-dp-cp", "ep", "etp", "edp", "etp-ep"};
  EXPECT_EQ(world->GroupNames(), standard);
  // Megatron-Core's tensor-and-data-parallel group (a first contact that
  // failed with "no group 'tp-dp' in this world" before).
  STRATA_ASSERT_OK_AND_ASSIGN(Communicator * tp_dp, world->Group("dp-tp"));
  EXPECT_EQ(tp_dp->name(), "tp-dp");
  EXPECT_EQ(tp_dp->size(), 4);
  // Every name, each created on first request.
  const std::vector<std::string> all = World::AllGroupNames();
  EXPECT_EQ(all.size(), 30u);
  CheckGroups(*world, all);
  EXPECT_EQ(world->GroupNames().size(), 29u);  // all but "world"
  // Any spelling of a combination; "world" is the root.
  STRATA_ASSERT_OK_AND_ASSIGN(Communicator * a, world->Group("cp-dp"));
  STRATA_ASSERT_OK_AND_ASSIGN(Communicator * b, world->Group("dp-cp"));
  EXPECT_EQ(a, b);
  STRATA_ASSERT_OK_AND_ASSIGN(Communicator * root, world->Group("world"));
  EXPECT_EQ(root, &world->root());
  EXPECT_EQ(world->Group("tp-ep").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(world->Group("xp").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(world->generation(), 1u);
}

TEST_F(WorldTest, ExpertMeshEveryCombination) {
  if (size() != 8) GTEST_SKIP() << "needs 8 ranks";
  // tp 2, cp 2 (dp 2), ep 4 carved out of dp*cp, expert-TP 1.
  MeshSpec spec;
  spec.world_size = 8;
  spec.tp = 2;
  spec.cp = 2;
  spec.ep = 4;
  spec.etp = 1;
  absl::StatusOr<LaunchEnv> env = LaunchEnv::Detect();
  ASSERT_TRUE(env.ok());
  STRATA_ASSERT_OK_AND_ASSIGN(auto world, World::Create(*env, MakeMesh(spec), WorldTestOptions()));
  CheckGroups(*world, World::AllGroupNames());
  STRATA_ASSERT_OK_AND_ASSIGN(Communicator * ep, world->Group("ep"));
  EXPECT_EQ(ep->size(), 4);
  STRATA_ASSERT_OK_AND_ASSIGN(Communicator * tp_cp, world->Group("cp-tp"));
  EXPECT_EQ(tp_cp->size(), 4);
  EXPECT_EQ(tp_cp->name(), "tp-cp");
}

// On a mesh of pure data parallelism, tp, cp, pp, ep, etp (all of one
// rank) share one communicator, and dp, dp-cp, tp-dp-cp, edp, etp-ep... the
// whole world: each reports its own name, in name(), in Work::Describe and
// in the errors of its operations.
TEST_F(WorldTest, SharedCommunicatorsReportTheNameTheyWereAskedBy) {
  MeshSpec spec;
  spec.world_size = size();
  absl::StatusOr<LaunchEnv> env = LaunchEnv::Detect();
  ASSERT_TRUE(env.ok());
  STRATA_ASSERT_OK_AND_ASSIGN(auto world, World::Create(*env, MakeMesh(spec), WorldTestOptions()));
  for (const std::string& asked : {"tp", "cp", "pp", "dp", "dp-cp", "tp-pp", "tp-dp-cp", "ep",
                                   "etp", "edp", "etp-ep", "pp-tp", "cp-dp"}) {
    SCOPED_TRACE(asked);
    STRATA_ASSERT_OK_AND_ASSIGN(std::string canonical, World::CanonicalGroupName(asked));
    STRATA_ASSERT_OK_AND_ASSIGN(Communicator * c, world->Group(asked));
    EXPECT_EQ(c->name(), canonical);
    const std::string where = absl::StrCat("on group ", canonical, " (rank ", c->rank(), " of ",
                                           c->size(), ", world rank ");
    int32_t one = 1, sum = 0;
    STRATA_ASSERT_OK_AND_ASSIGN(
        auto w, c->AllReduce(Buffer::Of(&one, 1), Buffer::Of(&sum, 1), ReduceOp::kSum));
    EXPECT_TRUE(absl::StrContains(w->Describe(), where)) << w->Describe();
    STRATA_ASSERT_OK(Wait(*w));
    EXPECT_EQ(sum, c->size());
    absl::StatusOr<std::unique_ptr<Work>> bad = c->Send(Buffer::Of(&one, 1), c->size());
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(bad.status().message(), where)) << bad.status();
  }
}

// Ranks that ask for different new groups at the same point are told who
// asked for what; afterwards the world still works and the group the ranks
// then agree on is created.
TEST_F(WorldTest, RanksThatAskForDifferentGroupsAreTold) {
  if (size() < 4 || size() % 2 != 0) GTEST_SKIP() << "needs an even number of ranks >= 4";
  MeshSpec spec;
  spec.world_size = size();
  spec.pp = 2;  // dp = size / 2: "dp-pp" is the world, and no standard group
  absl::StatusOr<LaunchEnv> env = LaunchEnv::Detect();
  ASSERT_TRUE(env.ok());
  WorldOptions options = WorldTestOptions();
  options.group_creation_timeout = absl::Seconds(60);
  STRATA_ASSERT_OK_AND_ASSIGN(auto world, World::Create(*env, MakeMesh(spec), options));
  const int half = size() / 2;
  const std::string mine = rank() < half ? "dp-pp" : "dp-cp-pp";
  absl::StatusOr<Communicator*> made = world->Group(mine);
  ASSERT_FALSE(made.ok());
  EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument) << made.status();
  const std::string want =
      absl::StrCat("ranks disagree on the group to create: ranks 0-", half - 1,
                   " asked for 'dp-pp', ranks ", half, "-", size() - 1,
                   " for 'dp-cp-pp'; every rank must request a new group at the same point, as "
                   "torch.distributed.new_group (this rank, ",
                   rank(), ", asked for '", mine, "' at world generation 1)");
  EXPECT_EQ(made.status().message(), want);
  CheckGroups(*world, {"dp-pp", "dp-cp-pp"});
}

// A rank that never asks for a new group makes the others fail at the
// creation deadline, naming the group, instead of hanging.
TEST_F(WorldTest, ARankThatNeverAsksEndsTheCreationAtItsDeadline) {
  if (size() < 4 || size() % 2 != 0) GTEST_SKIP() << "needs an even number of ranks >= 4";
  MeshSpec spec;
  spec.world_size = size();
  spec.pp = 2;  // "dp-pp" is the world, and no standard group
  absl::StatusOr<LaunchEnv> env = LaunchEnv::Detect();
  ASSERT_TRUE(env.ok());
  WorldOptions options = WorldTestOptions();
  options.group_creation_timeout = absl::Seconds(2);
  STRATA_ASSERT_OK_AND_ASSIGN(auto world, World::Create(*env, MakeMesh(spec), options));
  if (rank() == 0) {
    // Never asks, and keeps its world (so the others see a missing rank,
    // not a closed connection) until they are past their deadline.
    absl::SleepFor(absl::Seconds(6));
    // Then joins the agreement the others abandoned, as a late rank would:
    // MPI cannot withdraw a started collective, and Open MPI's ob1 aborts
    // the process when messages of one abandoned on a freed communicator
    // reach a later communicator that reuses its id. (Gloo's abandoned
    // collectives end with their connections; there the join times out.)
    int64_t late[2] = {0, 0}, out[2] = {0, 0};
    OpOptions quick;
    quick.timeout = absl::Seconds(2);
    absl::StatusOr<std::unique_ptr<Work>> join = world->root().AllReduce(
        ConstBuffer(late, 2, DataType::kInt64), Buffer::Of(out, 2), ReduceOp::kMax, quick);
    if (join.ok()) (void)(*join)->Wait(Deadline());
    return;
  }
  const absl::Time start = absl::Now();
  absl::StatusOr<Communicator*> made = world->Group("dp-pp");
  const absl::Duration took = absl::Now() - start;
  ASSERT_FALSE(made.ok());
  EXPECT_EQ(made.status().code(), absl::StatusCode::kDeadlineExceeded) << made.status();
  EXPECT_TRUE(absl::StrContains(made.status().message(),
                                "creating group 'dp-pp' (world generation 1): not every rank "
                                "requested it within 2s (WorldOptions::group_creation_timeout)"))
      << made.status();
  EXPECT_LT(took, absl::Seconds(30));
}

// On a device root the ranks agree by a probe split: ranks asking for
// different groups are told how many asked with them; agreeing ranks get
// the group.
TEST_F(WorldTest, DeviceRootsAgreeByAProbeSplit) {
  if (size() < 4 || size() % 2 != 0) GTEST_SKIP() << "needs an even number of ranks >= 4";
  MeshSpec spec;
  spec.world_size = size();
  spec.pp = 2;
  absl::StatusOr<LaunchEnv> env = LaunchEnv::Detect();
  ASSERT_TRUE(env.ok());
  RootOptions root_options = HarnessRootOptions();
  root_options.comm.name = "world";
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Communicator> host,
                              CreateRootCommunicator(*env, root_options));
  auto device = std::make_unique<DeviceLike>(std::move(host));
  DeviceLike* probe_counter = device.get();
  WorldOptions options = WorldTestOptions();
  options.group_creation_timeout = absl::Seconds(60);
  STRATA_ASSERT_OK_AND_ASSIGN(auto world,
                              World::FromRoot(std::move(device), MakeMesh(spec), options));
  const int half = size() / 2;
  const std::string mine = rank() < half ? "dp-pp" : "dp-cp-pp";
  const int before = probe_counter->splits();
  absl::StatusOr<Communicator*> made = world->Group(mine);
  EXPECT_EQ(probe_counter->splits(), before + 1);  // the probe only
  ASSERT_FALSE(made.ok());
  EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument) << made.status();
  EXPECT_EQ(
      made.status().message(),
      absl::StrCat("ranks disagree on the group to create: this rank (", rank(), ") asked for '",
                   mine, "' at world generation 1 together with ", half, " of the ", size(),
                   " ranks; the others asked for other groups; every rank must request a "
                   "new group at the same point, as torch.distributed.new_group"));
  CheckGroups(*world, {"dp-pp"});
  EXPECT_EQ(probe_counter->splits(), before + 3);  // probe and group
}

TEST_F(WorldTest, RebuiltInOneProcessAndMisuseIsNamed) {
  MeshSpec spec;
  spec.world_size = size();
  absl::StatusOr<LaunchEnv> env = LaunchEnv::Detect();
  ASSERT_TRUE(env.ok());
  for (int round = 0; round < 3; ++round) {
    STRATA_ASSERT_OK_AND_ASSIGN(auto world,
                                World::Create(*env, MakeMesh(spec), WorldTestOptions()));
    CheckGroups(*world, world->GroupNames());
  }
  MeshSpec other;
  other.world_size = size() * 2;
  auto wrong = World::Create(*env, MakeMesh(other), WorldTestOptions());
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(wrong.status().message(), "the mesh is for")) << wrong.status();
  WorldOptions bad = WorldTestOptions();
  bad.group_creation_timeout = absl::Seconds(-1);
  EXPECT_EQ(World::Create(*env, MakeMesh(spec), bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  STRATA_ASSERT_OK_AND_ASSIGN(auto world, World::Create(*env, MakeMesh(spec), WorldTestOptions()));
  EXPECT_EQ(world->Group("tp-zz").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(world->Handle("tp-tp").status().code(), absl::StatusCode::kInvalidArgument);
  // A handle outliving its World fails clearly.
  STRATA_ASSERT_OK_AND_ASSIGN(GroupHandle tp, world->Handle("tp"));
  world.reset();
  absl::StatusOr<Communicator*> gone = tp.Resolve();
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(gone.status().message(), "group 'tp': its World was destroyed");
}

}  // namespace
}  // namespace strata::testing
