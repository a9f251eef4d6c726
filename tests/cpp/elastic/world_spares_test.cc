// A World with hot spares (world.h "Spares"): the first ranks of the job
// form the mesh, the spares are in no group, and a Rebuild over a job
// communicator that puts a spare among the mesh's ranks makes it a member.
// Ranks are threads over Gloo and a memory store.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "comm/gloo/gloo_communicator.h"
#include "strata/comm/store.h"
#include "strata/elastic/elastic_loop.h"
#include "strata/parallel/world.h"

namespace strata {
namespace {

using ::testing::ElementsAre;
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

constexpr int kRanks = 4;

// Rank `r` of a World of dp3 and one spare (rank 3).
absl::StatusOr<std::unique_ptr<World>> Dp3AndASpare(const std::shared_ptr<Store>& store, int r) {
  WorldOptions wo;
  wo.spares = 1;
  return World::FromRoot(GlooRoot(store, r, kRanks), Dp(3), wo);
}

TEST(WorldSparesTest, SparesAreInNoGroupUntilARebuildPlacesThem) {
  auto store = MakeMemoryStore();
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      absl::StatusOr<std::unique_ptr<World>> world = Dp3AndASpare(store, r);
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

// An eviction (the straggler policy's planned change) with a spare standing
// by: dp3 on ranks 0-2, spare 3. Every member asks to evict rank 1 at the
// same point; rank 1 leaves, spare 3 takes its mesh position (StandBy
// returns placed, with the step the members were at), and the three train
// on as dp3.
TEST(WorldSparesTest, AnEvictedRanksPlaceGoesToASpare) {
  auto store = MakeMemoryStore();
  std::vector<elastic::ElasticLoop::Recovery> got(kRanks);
  std::vector<double> sums(kRanks, 0);
  std::atomic<int> members_in_step{0};
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      absl::StatusOr<std::unique_ptr<World>> world = Dp3AndASpare(store, r);
      ASSERT_TRUE(world.ok()) << world.status();
      elastic::ElasticOptions o;
      o.job = "evict-to-spare";
      o.heartbeat_interval = absl::Milliseconds(50);
      o.heartbeat_timeout = absl::Milliseconds(600);
      o.probe_processes = false;
      o.leave = elastic::LeavePolicy::kReturn;
      auto loop = elastic::ElasticLoop::Create(**world, store, o);
      ASSERT_TRUE(loop.ok()) << loop.status();
      absl::StatusOr<elastic::ElasticLoop::Recovery> rec;
      if ((*world)->is_spare()) {
        rec = (*loop)->StandBy();
      } else {
        ASSERT_TRUE((*loop)->BeginStep(7).ok());
        // All members are in the step before any asks (a request raises
        // the alarm, and a member that began its step after it would
        // fail there instead).
        members_in_step.fetch_add(1);
        const absl::Time give_up = absl::Now() + absl::Seconds(30);
        while (members_in_step.load() < kRanks - 1 && absl::Now() < give_up) {
          absl::SleepFor(absl::Milliseconds(1));
        }
        ASSERT_TRUE((*loop)->RequestChange({1}, "test: a straggler", false).ok());
        rec = (*loop)->Recover();
      }
      ASSERT_TRUE(rec.ok()) << "rank " << r << ": " << rec.status();
      got[r] = *rec;
      if (rec->outcome != elastic::ElasticLoop::Outcome::kContinue) return;
      absl::StatusOr<Communicator*> dp = (*world)->Group("dp");
      ASSERT_TRUE(dp.ok()) << dp.status();
      sums[r] = SumOver(**dp, 1);
      EXPECT_TRUE((*loop)->Finish().ok());
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(got[1].outcome, elastic::ElasticLoop::Outcome::kLeave);
  for (int r : {0, 2, 3}) {
    const elastic::RecoveryEvent& e = got[r].event;
    EXPECT_EQ(got[r].outcome, elastic::ElasticLoop::Outcome::kContinue) << "rank " << r;
    EXPECT_THAT(e.failed, ElementsAre(1));
    EXPECT_THAT(e.replaced, ElementsAre(std::make_pair(1, 3)));
    EXPECT_THAT(e.members, ElementsAre(0, 3, 2));
    EXPECT_EQ(e.placed, r == 3) << "rank " << r;
    EXPECT_EQ(e.step, 7) << "rank " << r << ": the placed spare learns the members' step";
    EXPECT_EQ(e.mesh_after.world_size, 3);
    EXPECT_EQ(sums[r], 3) << "rank " << r;
  }
}

}  // namespace
}  // namespace strata
