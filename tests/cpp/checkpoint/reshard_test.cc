// The resharding planner, exhaustively: every grid layout (1..3 parts per
// dim, even and uneven) saved, every grid layout loaded, every box of it
// assembled and compared with the values computed from the global index.
#include "strata/checkpoint/reshard.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <numeric>

namespace strata {
namespace {

using ::testing::HasSubstr;

// Balanced split of n into `parts`: the first n % parts pieces get one more.
std::pair<int64_t, int64_t> Piece(int64_t n, int parts, int i) {
  const int64_t base = n / parts, extra = n % parts;
  const int64_t begin = i * base + std::min<int64_t>(i, extra);
  return {begin, base + (i < extra ? 1 : 0)};
}

// Every box of the grid layout that cuts dim d into parts[d] pieces.
std::vector<TensorBox> Grid(const std::vector<int64_t>& shape, const std::vector<int>& parts) {
  std::vector<TensorBox> boxes;
  std::vector<int> idx(shape.size(), 0);
  while (true) {
    TensorBox b;
    for (size_t d = 0; d < shape.size(); ++d) {
      auto [o, l] = Piece(shape[d], parts[d], idx[d]);
      b.offset.push_back(o);
      b.shape.push_back(l);
    }
    boxes.push_back(b);
    size_t d = shape.size();
    while (d > 0 && ++idx[d - 1] == parts[d - 1]) idx[--d] = 0;
    if (d == 0) break;
  }
  return boxes;
}

// Values of a box of the global tensor whose element i (row-major) is i.
std::vector<int32_t> Values(const std::vector<int64_t>& global, const TensorBox& box) {
  int64_t n = 1;
  for (int64_t d : box.shape) n *= d;
  std::vector<int32_t> out(static_cast<size_t>(n));
  std::vector<int64_t> idx(box.shape.size(), 0);
  for (int64_t k = 0; k < n; ++k) {
    int64_t g = 0;
    for (size_t d = 0; d < global.size(); ++d) g = g * global[d] + box.offset[d] + idx[d];
    out[static_cast<size_t>(k)] = static_cast<int32_t>(g);
    for (size_t d = box.shape.size(); d-- > 0;) {
      if (++idx[d] < box.shape[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

// Plans `target` from the saved boxes and checks the assembled values.
void CheckAssembly(const std::vector<int64_t>& global, const std::vector<TensorBox>& saved,
                   const TensorBox& target) {
  std::vector<std::vector<int32_t>> data;
  std::vector<const void*> ptrs;
  for (const TensorBox& b : saved) data.push_back(Values(global, b));
  for (const auto& d : data) ptrs.push_back(d.data());
  absl::StatusOr<std::vector<CopySegment>> plan =
      PlanReshard(DataType::kInt32, global, saved, target);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const std::vector<int32_t> want = Values(global, target);
  std::vector<int32_t> got(want.size(), -1);
  ApplyCopySegments(*plan, ptrs, got.data());
  ASSERT_EQ(got, want);
  // Segments stay inside their buffers and are sorted by source.
  for (size_t i = 0; i < plan->size(); ++i) {
    const CopySegment& s = (*plan)[i];
    EXPECT_LE(s.source_offset + s.source_span(), data[s.source].size() * 4);
    EXPECT_LE(s.target_offset + (s.count - 1) * s.target_stride + s.length, got.size() * 4);
    if (i > 0) EXPECT_LE((*plan)[i - 1].source, s.source);
  }
}

void ForEachParts(size_t nd, const std::function<void(const std::vector<int>&)>& fn) {
  std::vector<int> parts(nd, 1);
  while (true) {
    fn(parts);
    size_t d = nd;
    while (d > 0 && ++parts[d - 1] == 4) parts[--d] = 1;
    if (d == 0) break;
  }
}

TEST(ReshardTest, EveryGridLayoutLoadsUnderEveryOther) {
  const std::vector<std::vector<int64_t>> shapes = {{12},   {7},       {8, 6},
                                                    {7, 5}, {6, 4, 9}, {3, 5, 2}};
  int cases = 0;
  for (const auto& shape : shapes) {
    SCOPED_TRACE(::testing::PrintToString(shape));
    ForEachParts(shape.size(), [&](const std::vector<int>& saved_parts) {
      const std::vector<TensorBox> saved = Grid(shape, saved_parts);
      ForEachParts(shape.size(), [&](const std::vector<int>& load_parts) {
        for (const TensorBox& target : Grid(shape, load_parts)) {
          CheckAssembly(shape, saved, target);
          ++cases;
        }
      });
    });
  }
  EXPECT_GT(cases, 10000);
}

// The layouts named in the issue, on a 4-rank job: a column-parallel weight
// [out=16, in=8] split along dim 0 and a row-parallel one split along dim 1.
TEST(ReshardTest, TensorParallelTwoToFourAndOne) {
  for (int dim : {0, 1}) {
    const std::vector<int64_t> shape = {16, 8};
    std::vector<int> tp2 = {1, 1}, tp4 = {1, 1};
    tp2[dim] = 2;
    tp4[dim] = 4;
    const std::vector<TensorBox> saved = Grid(shape, tp2);  // tp=2, dp=2: one copy per tp rank
    for (const TensorBox& t : Grid(shape, tp4)) CheckAssembly(shape, saved, t);  // tp=4, dp=1
    CheckAssembly(shape, saved, TensorBox{{0, 0}, shape});                       // tp=1, dp=4
  }
}

// A stacked per-layer tensor [layers=8, 4, 6]: pp=2 -> pp=4, pp=1 and pp=3.
TEST(ReshardTest, PipelineSplitOfStackedLayers) {
  const std::vector<int64_t> shape = {8, 4, 6};
  const std::vector<TensorBox> saved = Grid(shape, {2, 1, 1});
  for (int pp : {1, 3, 4, 8}) {
    for (const TensorBox& t : Grid(shape, {pp, 1, 1})) {
      CheckAssembly(shape, saved, t);
      // Whole layers are contiguous in both layouts: one run per saved shard.
      absl::StatusOr<std::vector<CopySegment>> plan =
          PlanReshard(DataType::kInt32, shape, saved, t);
      for (const CopySegment& s : *plan) EXPECT_EQ(s.count, 1u);
    }
  }
}

TEST(ReshardTest, UnchangedLayoutIsOneRunPerShard) {
  const std::vector<int64_t> shape = {6, 4, 10};
  const std::vector<TensorBox> saved = Grid(shape, {2, 2, 1});
  for (const TensorBox& t : saved) {
    absl::StatusOr<std::vector<CopySegment>> plan =
        PlanReshard(DataType::kBFloat16, shape, saved, t);
    ASSERT_TRUE(plan.ok());
    ASSERT_EQ(plan->size(), 1u);
    EXPECT_EQ((*plan)[0].count, 1u);
    EXPECT_EQ((*plan)[0].length, 3u * 2 * 10 * 2);
  }
}

TEST(ReshardTest, ColumnSliceIsOneStridedSegment) {
  // [64, 1024] saved whole, rank 1 of tp=4 along dim 1 wants columns 256..511.
  const std::vector<int64_t> shape = {64, 1024};
  absl::StatusOr<std::vector<CopySegment>> plan = PlanReshard(
      DataType::kFloat32, shape, {TensorBox{{0, 0}, shape}}, TensorBox{{0, 256}, {64, 256}});
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->size(), 1u);
  const CopySegment& s = (*plan)[0];
  EXPECT_EQ(s.count, 64u);
  EXPECT_EQ(s.length, 256u * 4);
  EXPECT_EQ(s.source_offset, 256u * 4);
  EXPECT_EQ(s.source_stride, 1024u * 4);
  EXPECT_EQ(s.target_stride, 256u * 4);
}

TEST(ReshardTest, ScalarsAndEmptyTensors) {
  CheckAssembly({}, {TensorBox{{}, {}}}, TensorBox{{}, {}});
  absl::StatusOr<std::vector<CopySegment>> plan =
      PlanReshard(DataType::kInt32, {0, 5}, {TensorBox{{0, 0}, {0, 5}}}, TensorBox{{0, 0}, {0, 5}});
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->empty());
}

TEST(ReshardTest, Errors) {
  const std::vector<int64_t> shape = {8, 8};
  const std::vector<TensorBox> half = {TensorBox{{0, 0}, {4, 8}}};
  absl::Status s = PlanReshard(DataType::kInt32, shape, half, TensorBox{{0, 0}, {8, 8}}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("cover 32 of the 64 elements"));
  s = PlanReshard(DataType::kInt32, shape, half, TensorBox{{6, 0}, {4, 8}}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("does not fit"));
  s = PlanReshard(DataType::kInt32, shape, half, TensorBox{{0}, {8}}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  s = PlanReshard(DataType::kInt32, shape, {TensorBox{{0, 0}, {9, 8}}}, TensorBox{{0, 0}, {1, 1}})
          .status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata
