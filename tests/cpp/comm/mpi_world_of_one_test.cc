// The MPI backend in one process without a launcher (MPI's singleton
// world of 1): the backend factory and its errors, the World on a world of
// one, and the conformance suite (tests/cpp/comm/conformance) on MPI's
// singleton world. One ctest for the whole binary, since each process pays
// for MPI's singleton start-up.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "conformance.h"
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

// What only the MPI backend's root options have: their checks.
TEST(BackendTest, MpiRootOptionsAreChecked) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
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

TEST(WorldOfOneTest, WorldOfOneHasEveryGroup) {
  MeshSpec spec;
  absl::StatusOr<Mesh> mesh = Mesh::Create(spec);
  ASSERT_TRUE(mesh.ok());
  WorldOptions options;
  options.root.comm.timeout = absl::Seconds(30);
  for (int round = 0; round < 2; ++round) {
    auto world = World::Create(Single(), *mesh, options);
    ASSERT_TRUE(world.ok()) << world.status();
    EXPECT_EQ((*world)->generation(), 1u);
    // Every combination, each under its own (canonical) name.
    for (const std::string& name : World::AllGroupNames()) {
      auto g = (*world)->Group(name);
      ASSERT_TRUE(g.ok()) << name << ": " << g.status();
      EXPECT_EQ((*g)->size(), 1);
      EXPECT_EQ((*g)->name(), name);
    }
    EXPECT_EQ((*world)->GroupNames().size(), 29u);
  }
  auto world = World::Create(Single(), *mesh, options);
  ASSERT_TRUE(world.ok());
  EXPECT_THAT((*world)->Group("tp-tp").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "names axis tp twice"));
  EXPECT_THAT((*world)->Group("ep-tp").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "cannot be mixed"));
  EXPECT_THAT((*world)->Group("pp-cp-pp").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "names axis pp twice"));
  WorldOptions old = options;
  old.version = 1;
  EXPECT_THAT(World::Create(Single(), *mesh, old).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "WorldOptions version 1"));
  MeshSpec two;
  two.world_size = 2;
  EXPECT_THAT(World::Create(Single(), *Mesh::Create(two), options).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, "the mesh is for 2 ranks"));
}

// Names of groups that share one communicator (every group of a world of
// one does) in the messages of their operations.
TEST(WorldOfOneTest, SharedGroupsNameThemselvesInMessages) {
  MeshSpec spec;
  absl::StatusOr<Mesh> mesh = Mesh::Create(spec);
  ASSERT_TRUE(mesh.ok());
  WorldOptions options;
  options.root.comm.timeout = absl::Seconds(30);
  auto world = World::Create(Single(), *mesh, options);
  ASSERT_TRUE(world.ok()) << world.status();
  for (const std::string& name : {"tp", "cp", "pp", "dp-cp", "etp-ep"}) {
    auto g = (*world)->Group(name);
    ASSERT_TRUE(g.ok());
    float x = 0;
    OpOptions short_wait;
    short_wait.timeout = absl::Milliseconds(50);
    auto recv = (*g)->Recv(Buffer::Of(&x, 1), 0, short_wait);
    ASSERT_TRUE(recv.ok()) << recv.status();
    const std::string where = "on group " + name + " (rank 0 of 1, world rank 0)";
    EXPECT_THAT((*recv)->Describe(), HasSubstr(where));
    EXPECT_THAT((*recv)->Wait(Soon()), StatusIs(absl::StatusCode::kDeadlineExceeded, where));
    EXPECT_THAT((*g)->Send(Buffer::Of(&x, 1), 2).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, where));
    // The timeout broke the shared communicator; its next user says so
    // under its own name.
    EXPECT_THAT((*g)->AsyncError(), StatusIs(absl::StatusCode::kDeadlineExceeded, where));
    ASSERT_TRUE((*world)->Rebuild(Root(), *mesh).ok());
  }
}

// Rebuild in one process: work of the old generation fails with Aborted
// (and is safe to wait on after its communicator is gone), handles follow,
// and a handle outlives its World safely.
TEST(WorldOfOneTest, RebuildFollowsHandlesAndAbortsOldWork) {
  MeshSpec spec;
  absl::StatusOr<Mesh> mesh = Mesh::Create(spec);
  ASSERT_TRUE(mesh.ok());
  WorldOptions options;
  options.root.comm.timeout = absl::Seconds(30);
  auto world = World::Create(Single(), *mesh, options);
  ASSERT_TRUE(world.ok()) << world.status();
  auto tp = (*world)->Handle("tp");
  auto tp_dp = (*world)->Handle("dp-tp");
  ASSERT_TRUE(tp.ok() && tp_dp.ok());
  auto pinned = tp->Pin("tensor-parallel layer");
  ASSERT_TRUE(pinned.ok());
  auto old_tp = tp->Resolve();
  ASSERT_TRUE(old_tp.ok());
  float x = 0;
  auto pending = (*old_tp)->Recv(Buffer::Of(&x, 1), 0);
  ASSERT_TRUE(pending.ok());
  auto old_alias = tp_dp->Resolve();
  ASSERT_TRUE(old_alias.ok());
  auto pending_alias = (*old_alias)->Recv(Buffer::Of(&x, 1), 0);
  ASSERT_TRUE(pending_alias.ok());

  auto root = (*world)->root().Shrink({}, CommOptions{});
  ASSERT_TRUE(root.ok()) << root.status();
  ASSERT_TRUE((*world)->Rebuild(std::move(root).value(), *mesh).ok());
  EXPECT_EQ((*world)->generation(), 2u);
  EXPECT_THAT((*pending)->Wait(Soon()), StatusIs(absl::StatusCode::kAborted, "on group tp"));
  EXPECT_THAT((*pending_alias)->Wait(Soon()),
              StatusIs(absl::StatusCode::kAborted, "on group tp-dp"));
  for (const GroupHandle* h : {&*tp, &*tp_dp, &*pinned}) {
    auto now = h->Resolve();
    ASSERT_TRUE(now.ok()) << h->name() << ": " << now.status();
    EXPECT_EQ((*now)->name(), h->name());
    float one = 1, sum = 0;
    auto w = (*now)->AllReduce(Buffer::Of(&one, 1), Buffer::Of(&sum, 1), ReduceOp::kSum);
    ASSERT_TRUE(w.ok());
    EXPECT_TRUE((*w)->Wait(Soon()).ok());
    EXPECT_EQ(sum, 1.0f);
  }
  EXPECT_EQ((*world)->Rebuild(nullptr, *mesh).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*world)->generation(), 2u);
  world->reset();
  EXPECT_THAT(tp->Resolve().status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, "its World was destroyed"));
  EXPECT_THAT(GroupHandle().Resolve().status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, "empty"));
}

}  // namespace
}  // namespace strata

namespace strata::testing {
namespace {

// The conformance suite on MPI's singleton world: a root per test.
INSTANTIATE_TEST_SUITE_P(MpiWorldOfOne, Conformance,
                         ::testing::Values(EnvFactory{"mpi1",
                                                      [] {
                                                        return std::make_unique<ThreadEnv>(
                                                            1, [](int) { return Root(); },
                                                            HostMemory(), size_t{1} << 16);
                                                      }}),
                         EnvName);

}  // namespace
}  // namespace strata::testing
