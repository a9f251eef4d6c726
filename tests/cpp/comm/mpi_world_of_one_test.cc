// The MPI backend in one process without a launcher (MPI's singleton
// world of 1): the backend factory, every operation on a group of one,
// and the user-causable errors of a real communicator. One ctest for the
// whole binary, since each process pays for MPI's singleton start-up.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "strata/comm/backend.h"
#include "strata/comm/communicator.h"
#include "strata/parallel/world.h"

namespace strata {
namespace {

using ::testing::HasSubstr;

absl::Time Soon() { return absl::Now() + absl::Seconds(30); }

LaunchEnv Single() { return LaunchEnv{}; }

std::unique_ptr<Communicator> Root() {
  RootOptions options;
  options.comm.timeout = absl::Seconds(30);
  absl::StatusOr<std::unique_ptr<Communicator>> c = CreateRootCommunicator(Single(), options);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(c).value() : nullptr;
}

MATCHER_P2(StatusIs, code, text, "") {
  return arg.code() == code && absl::StrContains(arg.message(), text);
}

TEST(BackendTest, ResolvesAndRejectsBackends) {
  const std::vector<std::string> built = AvailableBackends();
  auto has = [&](const char* b) { return std::find(built.begin(), built.end(), b) != built.end(); };
  ASSERT_FALSE(built.empty());
  EXPECT_EQ(built.front(), "mpi");
  // Without a GPU (this machine), auto picks the host backend of the launcher.
  RootOptions host;
  host.memory = RootMemory::kHost;
  EXPECT_EQ(ResolveBackend(Single(), host).value_or(""), "mpi");
  LaunchEnv torchrun;
  torchrun.launcher = Launcher::kTorchrun;
  if (has("gloo")) {
    EXPECT_EQ(ResolveBackend(torchrun, host).value_or(""), "gloo");
  } else {
    EXPECT_THAT(ResolveBackend(torchrun, host).status(),
                StatusIs(absl::StatusCode::kUnimplemented, "store-bootstrapped"));
  }
  if (has("nccl")) {
    EXPECT_EQ(ResolveBackend(Single(), "nccl").value_or(""), "nccl");
  } else {
    EXPECT_THAT(ResolveBackend(Single(), "nccl").status(),
                StatusIs(absl::StatusCode::kUnimplemented, "backend 'nccl' is not in this build"));
  }
  EXPECT_THAT(ResolveBackend(Single(), "tcp").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "unknown backend 'tcp'"));
  RootOptions old;
  old.version = 0;
  EXPECT_THAT(CreateRootCommunicator(Single(), old).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "RootOptions version 0"));
  RootOptions zero;
  zero.comm.timeout = absl::ZeroDuration();
  EXPECT_THAT(CreateRootCommunicator(Single(), zero).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "must be positive"));
}

TEST(BackendTest, LaunchEnvironmentMustMatchMpi) {
  LaunchEnv four;
  four.launcher = Launcher::kSlurm;
  four.world_size = 4;
  four.rank = 2;
  EXPECT_THAT(CreateRootCommunicator(four, RootOptions{}).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       "MPI sees this process as rank 0 of 1 but the launch environment says "
                       "rank 2 of 4"));
}

TEST(WorldOfOneTest, EveryOperationWorks) {
  auto c = Root();
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->rank(), 0);
  EXPECT_EQ(c->size(), 1);
  EXPECT_EQ(c->backend(), "mpi");
  EXPECT_EQ(c->memory(), MemoryKind::kHost);
  std::vector<float> a = {1, 2, 3, 4}, b(4);
  auto check = [&](absl::StatusOr<std::unique_ptr<Work>> w) {
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_TRUE((*w)->Wait(Soon()).ok());
  };
  check(c->AllReduce(Buffer::Of(a.data(), 4), Buffer::Of(b.data(), 4), ReduceOp::kAvg));
  EXPECT_EQ(b, a);
  check(c->Broadcast(Buffer::Of(a.data(), 4), 0));
  check(c->Reduce(Buffer::Of(a.data(), 4), Buffer::Of(b.data(), 4), ReduceOp::kProd, 0));
  check(c->AllGather(Buffer::Of(a.data(), 4), Buffer::Of(b.data(), 4)));
  check(c->ReduceScatter(Buffer::Of(a.data(), 4), Buffer::Of(b.data(), 4), ReduceOp::kMax));
  check(c->AllToAll(Buffer::Of(a.data(), 4), Buffer::Of(b.data(), 4)));
  AllToAllCounts counts{{4}, {4}};
  check(c->AllToAllV(Buffer::Of(a.data(), 4), Buffer::Of(b.data(), 4), counts));
  check(c->Barrier());
  EXPECT_EQ(b, a);
  // Send to and receive from oneself.
  auto recv = c->Recv(Buffer::Of(b.data(), 4), 0);
  ASSERT_TRUE(recv.ok());
  check(c->Send(Buffer::Of(a.data(), 4), 0));
  EXPECT_TRUE((*recv)->Wait(Soon()).ok());
  EXPECT_TRUE(c->AsyncError().ok());
}

TEST(WorldOfOneTest, MisuseIsNamed) {
  auto c = Root();
  ASSERT_NE(c, nullptr);
  std::vector<int32_t> x(8);
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_THAT(c->AllReduce(ConstBuffer(nullptr, 3, DataType::kInt32), Buffer::Of(x.data(), 3),
                           ReduceOp::kSum)
                  .status(),
              StatusIs(kInvalid, "send buffer is null with count 3 x int32"));
  EXPECT_THAT(
      c->AllReduce(Buffer::Of(x.data(), 3), Buffer::Of(x.data(), 3), ReduceOp::kAvg).status(),
      StatusIs(kInvalid, "avg is not defined for integer dtype int32"));
  EXPECT_THAT(c->Broadcast(Buffer{x.data(), 1, static_cast<DataType>(77)}, 0).status(),
              StatusIs(kInvalid, "unknown dtype value 77"));
  EXPECT_THAT(
      c->Broadcast(Buffer{x.data(), std::numeric_limits<size_t>::max() / 2, DataType::kInt32}, 0)
          .status(),
      StatusIs(kInvalid, "overflows the byte size"));
  EXPECT_THAT(c->Send(Buffer::Of(x.data(), 1), 1).status(),
              StatusIs(kInvalid, "peer 1 is out of range for a group of size 1"));
  EXPECT_THAT(c->Recv(Buffer::Of(x.data(), 1), -1).status(),
              StatusIs(kInvalid, "peer -1 is out of range"));
  EXPECT_THAT(
      c->Reduce(Buffer::Of(x.data(), 1), Buffer::Of(x.data(), 1), ReduceOp::kSum, 3).status(),
      StatusIs(kInvalid, "root 3 is out of range"));
  EXPECT_THAT(c->AllGather(Buffer::Of(x.data(), 2), Buffer::Of(x.data() + 4, 3)).status(),
              StatusIs(kInvalid, "recv has 3 x int32 but must hold 1 x 2 = 2 elements"));
  bool flags[2] = {true, false};
  EXPECT_THAT(c->AllReduce(ConstBuffer(flags, 2, DataType::kBool),
                           Buffer{flags, 2, DataType::kBool}, ReduceOp::kMax)
                  .status(),
              StatusIs(kInvalid, "dtype bool cannot be reduced"));
  OpOptions negative;
  negative.timeout = absl::Seconds(-1);
  EXPECT_THAT(c->Barrier(negative).status(), StatusIs(kInvalid, "timeout -1s is negative"));
  CommOptions unnamed;
  unnamed.name = "";
  EXPECT_THAT(c->Split(0, 0, unnamed).status(), StatusIs(kInvalid, "name is empty"));
  CommOptions future;
  future.version = 2;
  EXPECT_THAT(c->Shrink({}, future).status(), StatusIs(kInvalid, "CommOptions version 2"));
  RootOptions spin;
  spin.mpi.busy_poll = absl::Seconds(-1);
  EXPECT_THAT(CreateRootCommunicator(Single(), spin).status(),
              StatusIs(kInvalid, "must not be negative"));
  // A value of STRATA_OVERSUBSCRIBED that is not a boolean is refused by
  // name (strata reads its settings whole, even where the options say it).
  setenv("STRATA_OVERSUBSCRIBED", "yes", 1);
  EXPECT_THAT(CreateRootCommunicator(Single(), RootOptions{}).status(),
              StatusIs(kInvalid, "STRATA_OVERSUBSCRIBED='yes' is not a boolean (0/1/true/false)"));
  RootOptions told;
  told.mpi.oversubscribed = true;
  EXPECT_THAT(CreateRootCommunicator(Single(), told).status(),
              StatusIs(kInvalid, "STRATA_OVERSUBSCRIBED='yes'"));
  unsetenv("STRATA_OVERSUBSCRIBED");
  EXPECT_TRUE(CreateRootCommunicator(Single(), told).ok());
}

TEST(WorldOfOneTest, DeadlinesAbortRevokeAndShrink) {
  auto c = Root();
  ASSERT_NE(c, nullptr);
  int32_t v = 0, one = 1;
  // A receive nobody sends to: the wait's deadline passes, the operation
  // stays in flight, and completes once the message comes.
  auto recv = c->Recv(Buffer::Of(&v, 1), 0);
  ASSERT_TRUE(recv.ok());
  EXPECT_THAT((*recv)->Wait(absl::Now() + absl::Milliseconds(20)),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       "recv(peer 0, 1 x int32) on group world (rank 0 of 1, world rank 0): not "
                       "complete when the wait's deadline passed"));
  auto send = c->Send(ConstBuffer(&one, 1, DataType::kInt32), 0);
  ASSERT_TRUE(send.ok());
  EXPECT_TRUE((*recv)->Wait(Soon()).ok());
  EXPECT_EQ(v, 1);

  // Split: a negative color takes no part.
  CommOptions options;
  options.name = "part";
  auto none = c->Split(-1, 0, options);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(*none, nullptr);
  auto part = c->Split(3, 0, options);
  ASSERT_TRUE(part.ok()) << part.status();
  ASSERT_NE(*part, nullptr);
  EXPECT_EQ((*part)->name(), "part");

  // Shrink: excluding oneself gives nothing; excluding nobody a copy.
  auto gone = (*part)->Shrink({0}, options);
  EXPECT_FALSE(gone.ok());  // every rank excluded
  auto same = (*part)->Shrink({}, options);
  ASSERT_TRUE(same.ok()) << same.status();
  ASSERT_NE(*same, nullptr);
  EXPECT_EQ((*same)->size(), 1);

  // Revoke: later operations fail with Aborted; shrink still works.
  ASSERT_TRUE((*part)->Revoke().ok());
  EXPECT_THAT((*part)->Barrier().status(), StatusIs(absl::StatusCode::kAborted, "revoked"));
  EXPECT_EQ((*part)->AsyncError().code(), absl::StatusCode::kAborted);
  auto after = (*part)->Shrink({}, options);
  ASSERT_TRUE(after.ok()) << after.status();
  auto w = (*after)->AllReduce(Buffer::Of(&one, 1), Buffer::Of(&v, 1), ReduceOp::kSum);
  ASSERT_TRUE(w.ok());
  EXPECT_TRUE((*w)->Wait(Soon()).ok());

  // Abort: pending work fails with Aborted at once; later calls are refused.
  auto pending = (*same)->Recv(Buffer::Of(&v, 1), 0);
  ASSERT_TRUE(pending.ok());
  ASSERT_TRUE((*same)->Abort().ok());
  EXPECT_THAT((*pending)->Wait(Soon()), StatusIs(absl::StatusCode::kAborted, "aborted"));
  EXPECT_THAT((*same)->Barrier().status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, "was aborted"));
}

TEST(WorldOfOneTest, WorldOfOneHasEveryGroup) {
  MeshSpec spec;
  absl::StatusOr<Mesh> mesh = Mesh::Create(spec);
  ASSERT_TRUE(mesh.ok());
  WorldOptions options;
  options.root.comm.timeout = absl::Seconds(30);
  for (int round = 0; round < 2; ++round) {
    auto world = World::Create(Single(), *mesh, options);
    ASSERT_TRUE(world.ok()) << world.status();
    for (const std::string& name : (*world)->GroupNames()) {
      auto g = (*world)->Group(name);
      ASSERT_TRUE(g.ok()) << name;
      EXPECT_EQ((*g)->size(), 1);
    }
  }
  auto world = World::Create(Single(), *mesh, options);
  ASSERT_TRUE(world.ok());
  EXPECT_THAT((*world)->Group("tp-tp").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "names axis tp twice"));
  EXPECT_THAT((*world)->Group("ep-tp").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "cannot be mixed"));
  WorldOptions old = options;
  old.version = 0;
  EXPECT_THAT(World::Create(Single(), *mesh, old).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "WorldOptions version 0"));
  MeshSpec two;
  two.world_size = 2;
  EXPECT_THAT(World::Create(Single(), *Mesh::Create(two), options).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "the mesh is for 2 ranks"));
}

}  // namespace
}  // namespace strata
