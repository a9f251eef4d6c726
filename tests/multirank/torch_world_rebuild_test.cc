// The LibTorch holders across a World rebuild, on real ranks: dp4 x tp2, the
// ranks of one data-parallel replica leave, the survivors rebuild on dp3 x
// tp2. Through the handles taken before the rebuild:
//   - strata::nn::DataParallel on "dp" reduces over the new group: the
//     gradient after the rebuild is the mean over the 3 surviving replicas,
//     computed here from their batches;
//   - a strata::nn::ColumnParallelLinear on "tp" (whose layout survives)
//     keeps computing what it computed before; one on "dp" (whose layout
//     changed) throws the handle's error naming both generations.
// Not a strata_multirank_main test (it would link a second copy of
// libstrata through strata_testing): harness.cc with strata_torch.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "harness.h"
#include "strata/parallel/world.h"
#include "strata/torch/data_parallel.h"
#include "strata/torch/tensor_parallel.h"

namespace strata::testing {
namespace {

using ::torch::Tensor;

Mesh MeshOf(int world_size) {
  MeshSpec spec;
  spec.world_size = world_size;
  spec.tp = 2;
  absl::StatusOr<Mesh> mesh = Mesh::Create(spec);
  EXPECT_TRUE(mesh.ok()) << mesh.status();
  return *mesh;
}

// The batch of data-parallel replica `replica` at `step`.
std::pair<Tensor, Tensor> Batch(int replica, int step) {
  ::torch::manual_seed(100 * step + replica);
  return {::torch::randn({5, 6}, ::torch::kFloat64), ::torch::randn({5, 3}, ::torch::kFloat64)};
}

::torch::nn::Linear Model() {
  ::torch::manual_seed(7);  // the same on every rank
  ::torch::nn::Linear m(6, 3);
  m->to(::torch::kFloat64);
  return m;
}

// The gradient of the weight of Model() on replica `replica`'s batch.
Tensor LocalGrad(int replica, int step) {
  ::torch::nn::Linear m = Model();
  auto [x, y] = Batch(replica, step);
  ::torch::mse_loss(m->forward(x), y).backward();
  return m->weight.grad().clone();
}

// The same weight's gradient through `ddp`, on this rank's replica's batch.
Tensor ReducedGrad(::torch::nn::Linear& m, nn::DataParallel& ddp, int replica, int step) {
  ddp.ZeroGrad();
  auto [x, y] = Batch(replica, step);
  ::torch::mse_loss(m->forward(x), y).backward();
  return m->weight.grad().clone();
}

class TorchWorldRebuildTest : public MultiRankTest {};

TEST_F(TorchWorldRebuildTest, DataParallelAndLayersFollowOrRefuse) {
  if (size() != 8) GTEST_SKIP() << "needs 8 ranks";
  ::torch::set_num_threads(1);
  absl::StatusOr<LaunchEnv> env = LaunchEnv::Detect();
  ASSERT_TRUE(env.ok());
  WorldOptions wo;
  wo.root = HarnessRootOptions();
  absl::StatusOr<std::unique_ptr<World>> made = World::Create(*env, MeshOf(8), wo);
  ASSERT_TRUE(made.ok()) << made.status();
  std::unique_ptr<World> world = std::move(made).value();
  absl::StatusOr<GroupHandle> tp = world->Handle("tp");
  absl::StatusOr<GroupHandle> dp = world->Handle("dp");
  ASSERT_TRUE(tp.ok() && dp.ok());

  ::torch::nn::Linear model = Model();
  nn::DataParallelOptions o;
  o.timeout = absl::Seconds(120);
  absl::StatusOr<std::unique_ptr<nn::DataParallel>> ddp =
      nn::DataParallel::Create(model->named_parameters(), *dp, o);
  ASSERT_TRUE(ddp.ok()) << ddp.status();
  LinearOptions lo;
  lo.in_features = 6;
  lo.out_features = 4;
  lo.gather_output = true;
  lo.timeout = absl::Seconds(120);
  nn::ColumnParallelLinear over_tp(lo, *tp, nn::InitOptions{3});
  nn::ColumnParallelLinear over_dp(lo, *dp, nn::InitOptions{3});
  ::torch::manual_seed(0);
  const Tensor x = ::torch::randn({2, 6});
  const Tensor whole = over_tp->forward(x).detach();

  // Generation 1: the mean over the 4 replicas.
  const int replica = rank() / 2;
  Tensor want = (LocalGrad(0, 1) + LocalGrad(1, 1) + LocalGrad(2, 1) + LocalGrad(3, 1)) / 4;
  EXPECT_TRUE(::torch::allclose(ReducedGrad(model, **ddp, replica, 1), want));
  const int old_dp_rank = replica;

  if (rank() == 2 || rank() == 3) {  // replica 1 leaves
    ddp->reset();
    world.reset();
    return;
  }
  CommOptions ro;
  ro.name = "world";
  ro.timeout = absl::Seconds(60);
  absl::StatusOr<std::unique_ptr<Communicator>> shrunk = world->root().Shrink({2, 3}, ro);
  ASSERT_TRUE(shrunk.ok()) << shrunk.status();
  ASSERT_TRUE(world->Rebuild(std::move(shrunk).value(), MeshOf(6)).ok());
  const int new_dp_rank = world->rank() / 2;

  // DataParallel follows: the mean over the survivors' replicas 0, 2, 3.
  want = (LocalGrad(0, 2) + LocalGrad(2, 2) + LocalGrad(3, 2)) / 3;
  EXPECT_TRUE(::torch::allclose(ReducedGrad(model, **ddp, replica, 2), want));
  // The tp layer follows and computes what it did.
  EXPECT_TRUE(::torch::allclose(over_tp->forward(x).detach(), whole));
  // The dp layer was sharded for 4 ranks.
  try {
    (void)over_dp->forward(x);
    ADD_FAILURE() << "a layer sharded for 4 dp ranks ran on 3";
  } catch (const c10::Error& e) {
    const std::string want_msg = absl::StrCat(
        "group 'dp' was rank ", old_dp_rank, " of 4 at world generation 1; at generation 2 this ",
        "rank is rank ", new_dp_rank, " of 3: this column-parallel linear layer was built for ",
        "the old layout; build a new one");
    EXPECT_TRUE(absl::StrContains(e.what(), want_msg)) << e.what();
  }
}

}  // namespace
}  // namespace strata::testing
