// A World with hot spares (world.h "Spares"): the first ranks of the job
// form the mesh, the spares are in no group, and a Rebuild over a job
// communicator that puts a spare among the mesh's ranks makes it a member.
// Ranks are threads over Gloo and a memory store.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/gloo/gloo_communicator.h"
#include "strata/comm/store.h"
#include "strata/parallel/world.h"

namespace strata {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<Communicator> GlooRoot(const std::shared_ptr<Store>& store, int r, int n) {
  RootOptions ro;
  ro.comm.timeout = absl::Seconds(60);
  absl::StatusOr<std::unique_ptr<gloo::GlooCommunicator>> root =
      gloo::GlooCommunicator::CreateRoot(ro, store, r, n);
  EXPECT_TRUE(root.ok()) << root.status();
  return root.ok() ? std::unique_ptr<Communicator>(*std::move(root)) : nullptr;
}

Mesh Dp(int n) {
  MeshSpec spec;
  spec.world_size = n;
  return *Mesh::Create(spec);
}

double SumOver(Communicator& c, double x) {
  auto w = c.AllReduce(ConstBuffer(&x, 1, DataType::kFloat64), Buffer::Of(&x, 1), ReduceOp::kSum);
  EXPECT_TRUE(w.ok()) << w.status();
  if (!w.ok()) return -1;
  absl::Status s = (*w)->Wait();
  EXPECT_TRUE(s.ok()) << s;
  return x;
}

TEST(WorldSparesTest, SparesAreInNoGroupUntilARebuildPlacesThem) {
  constexpr int kRanks = 4;  // dp3 and one spare
  auto store = MakeMemoryStore();
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      WorldOptions wo;
      wo.spares = 1;
      absl::StatusOr<std::unique_ptr<World>> world =
          World::FromRoot(GlooRoot(store, r, kRanks), Dp(3), wo);
      ASSERT_TRUE(world.ok()) << world.status();
      World& w = **world;
      EXPECT_EQ(w.spares(), 1);
      EXPECT_EQ(w.is_spare(), r == 3);
      EXPECT_EQ(w.job().size(), kRanks);
      if (r == 3) {
        absl::StatusOr<Communicator*> dp = w.Group("dp");
        EXPECT_EQ(dp.status().code(), absl::StatusCode::kFailedPrecondition);
        EXPECT_THAT(dp.status().message(), HasSubstr("hot spare"));
        EXPECT_FALSE(w.Handle("tp").ok());
        EXPECT_TRUE(w.GroupNames().empty());
      } else {
        EXPECT_EQ(w.size(), 3);
        absl::StatusOr<Communicator*> dp = w.Group("dp");
        ASSERT_TRUE(dp.ok()) << dp.status();
        EXPECT_EQ(SumOver(**dp, 1), 3);
      }
      EXPECT_EQ(SumOver(w.job(), 1), kRanks);  // the job communicator holds everyone
      // The spare takes rank 1's place; rank 1 stands by.
      const int key = r == 3 ? 1 : r == 1 ? 3 : r;
      CommOptions co;
      co.name = "world";
      co.timeout = absl::Seconds(60);
      absl::StatusOr<std::unique_ptr<Communicator>> moved = w.job().Split(0, key, co);
      ASSERT_TRUE(moved.ok()) << moved.status();
      ASSERT_TRUE(w.Rebuild(*std::move(moved), Dp(3)).ok());
      EXPECT_EQ(w.generation(), 2u);
      EXPECT_EQ(w.is_spare(), r == 1);
      if (r != 1) {
        absl::StatusOr<Communicator*> dp = w.Group("dp");
        ASSERT_TRUE(dp.ok()) << dp.status();
        EXPECT_EQ((*dp)->rank(), key);
        EXPECT_EQ(SumOver(**dp, key), 0 + 1 + 2);
      } else {
        EXPECT_FALSE(w.Group("dp").ok());
      }
      // A mesh larger than the new job communicator is refused.
      if (r == 0) {
        absl::Status big = w.Rebuild(GlooRoot(MakeMemoryStore(), 0, 1), Dp(2));
        EXPECT_EQ(big.code(), absl::StatusCode::kInvalidArgument);
        EXPECT_THAT(big.message(), HasSubstr("the mesh is for 2 ranks"));
      }
    });
  }
  for (std::thread& t : threads) t.join();
}

TEST(WorldSparesTest, AJobThatIsNotTheMeshPlusTheSparesIsRefusedByName) {
  WorldOptions wo;
  wo.spares = 2;
  absl::StatusOr<std::unique_ptr<World>> world =
      World::FromRoot(GlooRoot(MakeMemoryStore(), 0, 1), Dp(1), wo);
  EXPECT_EQ(world.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(world.status().message(),
              HasSubstr("the mesh is for 1 ranks and 2 spares but the root communicator has 1"));
  wo.spares = -1;
  world = World::FromRoot(GlooRoot(MakeMemoryStore(), 0, 1), Dp(1), wo);
  EXPECT_THAT(world.status().message(), HasSubstr("WorldOptions::spares is -1"));
}

}  // namespace
}  // namespace strata
