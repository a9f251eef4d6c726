// Holders of groups across a World rebuild, on real ranks: dp4 x tp2, the
// ranks of one data-parallel replica leave, the survivors shrink the root
// and rebuild on dp3 x tp2. Through the handles they took before:
//   - the checkpointer (split_from the world's handle) saves again, over a
//     communicator it splits off the new generation, and a reader opened
//     before the rebuild loads over the new generation's group;
//   - a tensor-parallel layer on "tp" (whose layout survives) keeps
//     computing the right product; one on "dp" (whose layout changed)
//     refuses with the handle's error naming both generations;
//   - on the ranks that left, the checkpointer fails with the handle's error
//     (its World was destroyed).
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint_util.h"
#include "harness.h"
#include "strata/checkpoint/checkpointer.h"
#include "strata/checkpoint/loader.h"
#include "strata/parallel/tensor_parallel/linear.h"
#include "strata/parallel/world.h"
#include "world_test_util.h"

namespace strata::testing {
namespace {

constexpr int64_t kRows = 3, kIn = 4, kOut = 4;

float W(int64_t o, int64_t i) { return std::sin(0.3f * static_cast<float>(o * kIn + i) + 0.1f); }
float X(int64_t r, int64_t i) { return 0.25f * static_cast<float>(r * kIn + i) - 1.0f; }

// y = x W^T through a column-parallel layer (gather_output) on `layer`'s
// group, whose shard is rows [rank * out/size, ...) of W.
absl::Status ColumnForward(ColumnParallelLinear& layer, int rank, std::vector<float>* y) {
  const int64_t local = layer.local_out_features(), first = rank * local;
  std::vector<float> x(kRows * kIn), w(local * kIn);
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t i = 0; i < kIn; ++i) x[r * kIn + i] = X(r, i);
  for (int64_t o = 0; o < local; ++o)
    for (int64_t i = 0; i < kIn; ++i) w[o * kIn + i] = W(first + o, i);
  y->assign(kRows * kOut, 0.0f);
  return layer.Forward({ConstMatrixRef::Of(x.data(), kRows, kIn),
                        ConstMatrixRef::Of(w.data(), local, kIn), nullptr,
                        MatrixRef::Of(y->data(), kRows, kOut)});
}

// The same product on this rank alone.
double MaxDiffFromReference(const std::vector<float>& y) {
  double diff = 0;
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t o = 0; o < kOut; ++o) {
      double want = 0;
      for (int64_t i = 0; i < kIn; ++i) want += double(W(o, i)) * X(r, i);
      diff = std::fmax(diff, std::fabs(want - y[r * kOut + o]));
    }
  }
  return diff;
}

// Row `row` of a {rows, 4} float tensor saved under `key`: a function of
// both, so a load that returned another row would differ.
std::vector<float> Row(const std::string& key, int64_t row) {
  std::vector<float> v(4);
  for (int64_t c = 0; c < 4; ++c) v[c] = static_cast<float>(key.size() * 100 + row * 10 + c);
  return v;
}

ShardedTensor RowShard(const std::string& key, int64_t rows, int64_t row) {
  ShardedTensor s;
  s.key = key;
  s.dtype = DataType::kFloat32;
  s.global_shape = {rows, 4};
  s.local_shape = {1, 4};
  s.global_offset = {row, 0};
  return s;
}

absl::Status SaveRow(Checkpointer& ckpt, int64_t step, const std::string& key, int64_t rows,
                     int64_t row) {
  const std::vector<float> data = Row(key, row);
  SaveRequest req;
  req.step = step;
  req.tensors.push_back({RowShard(key, rows, row), data.data()});
  STRATA_RETURN_IF_ERROR(ckpt.Save(req));
  return ckpt.Wait(absl::Now() + absl::Seconds(120));
}

class WorldRebuildHoldersTest : public MultiRankTest {};

TEST_F(WorldRebuildHoldersTest, CheckpointerAndLayersFollowOrRefuse) {
  if (size() != 8) GTEST_SKIP() << "needs 8 ranks";
  SharedDir dir(world());
  ASSERT_FALSE(dir.path().empty());
  MeshSpec spec;
  spec.world_size = 8;
  spec.tp = 2;  // dp 4: replicas {0,1} {2,3} {4,5} {6,7}
  absl::StatusOr<LaunchEnv> env = LaunchEnv::Detect();
  ASSERT_TRUE(env.ok());
  STRATA_ASSERT_OK_AND_ASSIGN(auto world, World::Create(*env, MakeMesh(spec), WorldTestOptions()));
  STRATA_ASSERT_OK_AND_ASSIGN(GroupHandle whole, world->Handle("world"));
  STRATA_ASSERT_OK_AND_ASSIGN(GroupHandle tp, world->Handle("tp"));
  STRATA_ASSERT_OK_AND_ASSIGN(GroupHandle dp, world->Handle("dp"));

  // Generation 1: a checkpointer and a reader on the world's handle, a
  // layer on tp and one on dp.
  CheckpointOptions co;
  co.directory = dir.path();
  co.split_from = whole;
  co.commit_timeout = absl::Seconds(120);
  {
    // A World's group is training's: not the checkpointer's own.
    CheckpointOptions bad = co;
    bad.split_from = GroupHandle();
    bad.group = whole;
    absl::Status s = Checkpointer::Create(bad).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(
        absl::StrContains(s.message(), "CheckpointOptions::group is group 'world' of a World"))
        << s;
    bad.split_from = whole;
    s = Checkpointer::Create(bad).status();
    EXPECT_TRUE(absl::StrContains(s.message(), "not both")) << s;
  }
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Checkpointer> ckpt, Checkpointer::Create(co));
  STRATA_ASSERT_OK(SaveRow(*ckpt, 1, "before", 8, rank()));
  LoadOptions lo;
  lo.directory = dir.path();
  lo.group = whole;
  lo.timeout = absl::Seconds(120);
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointReader> reader,
                              CheckpointReader::Open(lo));  // step 1, opened over 8 ranks
  LinearOptions o;
  o.in_features = kIn;
  o.out_features = kOut;
  o.bias = false;
  o.gather_output = true;
  o.timeout = absl::Seconds(120);
  STRATA_ASSERT_OK_AND_ASSIGN(auto over_tp, ColumnParallelLinear::Create(o, tp));
  STRATA_ASSERT_OK_AND_ASSIGN(auto over_dp, ColumnParallelLinear::Create(o, dp));
  std::vector<float> y;
  STRATA_ASSERT_OK(ColumnForward(*over_tp, rank() % 2, &y));
  EXPECT_LT(MaxDiffFromReference(y), 1e-5);
  STRATA_ASSERT_OK(ColumnForward(*over_dp, rank() / 2, &y));
  EXPECT_LT(MaxDiffFromReference(y), 1e-5);
  const int old_rank = rank();

  // World ranks 2 and 3 (dp replica 1) leave. Their checkpointer cannot
  // follow a World that is gone: the handle's error.
  if (rank() == 2 || rank() == 3) {
    world.reset();
    absl::Status s = SaveRow(*ckpt, 2, "after", 6, 0);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "group 'world': its World was destroyed")) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "(last at world generation 1)")) << s;
    return;
  }
  CommOptions root_options;
  root_options.name = "world";
  root_options.timeout = absl::Seconds(60);
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Communicator> shrunk,
                              world->root().Shrink({2, 3}, root_options));
  MeshSpec smaller = spec;
  smaller.world_size = 6;
  STRATA_ASSERT_OK(world->Rebuild(std::move(shrunk), MakeMesh(smaller)));
  ASSERT_EQ(world->generation(), 2u);
  const int new_rank = world->rank();

  // The checkpointer follows: step 2 is saved by the 6 survivors over a
  // communicator split off generation 2.
  STRATA_EXPECT_OK(SaveRow(*ckpt, 2, "after", 6, new_rank));
  EXPECT_EQ(ckpt->status().last_committed_step, 2);
  // The reader opened in generation 1 loads over generation 2's group.
  std::vector<float> got(4, -1.0f);
  absl::StatusOr<LoadReport> loaded =
      reader->Load({TensorTarget{RowShard("before", 8, old_rank), got.data()}});
  STRATA_EXPECT_OK(loaded.status());
  EXPECT_EQ(got, Row("before", old_rank));
  // A reader opened now sees step 2, saved by 6 ranks.
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<CheckpointReader> now, CheckpointReader::Open(lo));
  EXPECT_EQ(now->step(), 2);
  EXPECT_EQ(now->manifest().world_size, 6);
  got.assign(4, -1.0f);
  STRATA_EXPECT_OK(now->Load({TensorTarget{RowShard("after", 6, new_rank), got.data()}}).status());
  EXPECT_EQ(got, Row("after", new_rank));

  // The layer on tp (still rank r % 2 of 2) follows and computes the same.
  y.assign(kRows * kOut, 0.0f);
  STRATA_EXPECT_OK(ColumnForward(*over_tp, new_rank % 2, &y));
  EXPECT_LT(MaxDiffFromReference(y), 1e-5);
  // The layer on dp was sharded for 4 ranks; dp has 3 now.
  absl::Status stale = ColumnForward(*over_dp, old_rank / 2, &y);
  EXPECT_EQ(stale.code(), absl::StatusCode::kFailedPrecondition) << stale;
  EXPECT_TRUE(absl::StrContains(
      stale.message(), absl::StrCat("group 'dp' was rank ", old_rank / 2,
                                    " of 4 at world generation 1; at generation 2 this rank is "
                                    "rank ",
                                    new_rank / 2,
                                    " of 3: this column-parallel linear layer was built for the "
                                    "old layout; build a new one")))
      << stale;
  // One built now is checked against the new layout (4 features do not
  // split over 3 ranks).
  absl::StatusOr<std::unique_ptr<ColumnParallelLinear>> fresh = ColumnParallelLinear::Create(o, dp);
  EXPECT_EQ(fresh.status().code(), absl::StatusCode::kInvalidArgument) << fresh.status();
  EXPECT_TRUE(
      absl::StrContains(fresh.status().message(), "not divisible by the size 3 of group dp"))
      << fresh.status();
}

}  // namespace
}  // namespace strata::testing
