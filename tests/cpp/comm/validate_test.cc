// The backend-neutral argument checks: every kind of local misuse is an
// InvalidArgument whose message names the operation, the group and the
// values.
#include "comm/validate.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <vector>

namespace strata::comm_internal {
namespace {

using ::testing::HasSubstr;

bool All(DataType) { return true; }
bool NotBool(DataType t) { return t != DataType::kBool; }
const Capabilities kCaps{&All, &NotBool};

const GroupInfo kGroup{"tp", 1, 4, 5};

MATCHER_P(InvalidWith, text, "") {
  return arg.code() == absl::StatusCode::kInvalidArgument &&
         ::testing::Matches(HasSubstr(text))(std::string(arg.message()));
}

TEST(ValidateTest, DescribesGroupsAndOperations) {
  EXPECT_EQ(DescribeGroup(kGroup), "group tp (rank 1 of 4, world rank 5)");
  float x[3];
  EXPECT_EQ(DescribeOp("allreduce", "sum", ConstBuffer(x, 3, DataType::kFloat32)),
            "allreduce(sum, 3 x fp32)");
  EXPECT_EQ(DescribeOp("barrier", ""), "barrier()");
  EXPECT_EQ(DescribeOp("send", "", ConstBuffer(x, 3, static_cast<DataType>(42))),
            "send(3 x dtype#42)");
}

TEST(ValidateTest, NullBufferWithCount) {
  std::vector<float> out(5);
  absl::Status s = ValidateAllReduce(kGroup, ConstBuffer(nullptr, 5, DataType::kFloat32),
                                     Buffer::Of(out.data(), 5), ReduceOp::kSum, kCaps);
  EXPECT_THAT(s, InvalidWith("send buffer is null with count 5 x fp32"));
  EXPECT_THAT(s, InvalidWith("group tp (rank 1 of 4, world rank 5)"));
  // Null with count 0 is fine.
  EXPECT_TRUE(ValidateAllReduce(kGroup, ConstBuffer(nullptr, 0, DataType::kFloat32),
                                Buffer{nullptr, 0, DataType::kFloat32}, ReduceOp::kSum, kCaps)
                  .ok());
}

TEST(ValidateTest, CountOverflow) {
  float x;
  const size_t huge = std::numeric_limits<size_t>::max() / 2;
  absl::Status s = ValidateBroadcast(kGroup, Buffer{&x, huge, DataType::kFloat32}, 0, kCaps);
  EXPECT_THAT(s, InvalidWith("overflows the byte size"));
  EXPECT_THAT(s, InvalidWith(std::to_string(huge)));
  // allgather: size * count overflows.
  const size_t big = std::numeric_limits<size_t>::max() / 3;
  absl::Status g = ValidateAllGather(kGroup, ConstBuffer(&x, big, DataType::kInt8),
                                     Buffer{&x, big, DataType::kInt8}, kCaps);
  EXPECT_THAT(g, InvalidWith("overflows"));
}

TEST(ValidateTest, UnknownDtypeAndOp) {
  int32_t x = 0;
  const DataType bogus = static_cast<DataType>(42);
  EXPECT_THAT(ValidateBroadcast(kGroup, Buffer{&x, 1, bogus}, 0, kCaps),
              InvalidWith("unknown dtype value 42"));
  EXPECT_THAT(ValidateAllReduce(kGroup, ConstBuffer(&x, 1, DataType::kInt32), Buffer::Of(&x, 1),
                                static_cast<ReduceOp>(9), kCaps),
              InvalidWith("unknown reduce op value 9"));
}

TEST(ValidateTest, AvgOnIntegersNamesTheDtype) {
  for (DataType t : {DataType::kInt8, DataType::kUInt8, DataType::kInt32, DataType::kInt64}) {
    int64_t x = 0;
    absl::Status s =
        ValidateAllReduce(kGroup, ConstBuffer(&x, 1, t), Buffer{&x, 1, t}, ReduceOp::kAvg, kCaps);
    EXPECT_THAT(
        s, InvalidWith(std::string("avg is not defined for integer dtype ") + DataTypeName(t)));
  }
  float f = 0;
  EXPECT_TRUE(ValidateAllReduce(kGroup, ConstBuffer(&f, 1, DataType::kFloat32), Buffer::Of(&f, 1),
                                ReduceOp::kAvg, kCaps)
                  .ok());
}

TEST(ValidateTest, DtypeTheBackendCannotReduce) {
  bool b[2] = {};
  EXPECT_THAT(ValidateAllReduce(kGroup, ConstBuffer(b, 2, DataType::kBool),
                                Buffer{b, 2, DataType::kBool}, ReduceOp::kMax, kCaps),
              InvalidWith("dtype bool cannot be reduced"));
  EXPECT_TRUE(ValidateBroadcast(kGroup, Buffer{b, 2, DataType::kBool}, 0, kCaps).ok());
}

TEST(ValidateTest, MismatchedCountsAndDtypes) {
  std::vector<float> a(10), b(12);
  EXPECT_THAT(ValidateAllReduce(kGroup, ConstBuffer(a.data(), 10, DataType::kFloat32),
                                Buffer::Of(b.data(), 12), ReduceOp::kSum, kCaps),
              InvalidWith("send has 10 x fp32 but recv has 12 x fp32"));
  EXPECT_THAT(ValidateAllReduce(kGroup, ConstBuffer(a.data(), 10, DataType::kInt32),
                                Buffer::Of(b.data(), 10), ReduceOp::kSum, kCaps),
              InvalidWith("send dtype int32 != recv dtype fp32"));
  EXPECT_THAT(ValidateAllGather(kGroup, ConstBuffer(a.data(), 3, DataType::kFloat32),
                                Buffer::Of(b.data(), 11), kCaps),
              InvalidWith("recv has 11 x fp32 but must hold 4 x 3 = 12 elements"));
  EXPECT_THAT(ValidateReduceScatter(kGroup, ConstBuffer(b.data(), 11, DataType::kFloat32),
                                    Buffer::Of(a.data(), 3), ReduceOp::kSum, kCaps),
              InvalidWith("send has 11 x fp32 but must hold 4 x 3 = 12 elements"));
  EXPECT_THAT(ValidateAllToAll(kGroup, ConstBuffer(a.data(), 10, DataType::kFloat32),
                               Buffer::Of(b.data(), 10), kCaps),
              InvalidWith("count 10 is not divisible by the group size 4"));
}

TEST(ValidateTest, AllToAllVCounts) {
  std::vector<float> a(10), b(10);
  AllToAllCounts c;
  c.send_counts = {1, 2, 3};
  c.recv_counts = {1, 2, 3, 4};
  EXPECT_THAT(ValidateAllToAllV(kGroup, ConstBuffer(a.data(), 10, DataType::kFloat32),
                                Buffer::Of(b.data(), 10), c, kCaps),
              InvalidWith("send_counts has 3 entries and recv_counts 4"));
  c.send_counts = {1, 2, 3, 5};
  EXPECT_THAT(ValidateAllToAllV(kGroup, ConstBuffer(a.data(), 10, DataType::kFloat32),
                                Buffer::Of(b.data(), 10), c, kCaps),
              InvalidWith("send_counts [1, 2, 3, 5] sum to 11 but send has 10 elements"));
  c.send_counts = {4, 3, 2, 1};
  EXPECT_THAT(ValidateAllToAllV(kGroup, ConstBuffer(a.data(), 10, DataType::kFloat32),
                                Buffer::Of(a.data(), 10), c, kCaps),
              InvalidWith("in place (send.data == recv.data) needs send_counts == recv_counts"));
  EXPECT_TRUE(ValidateAllToAllV(kGroup, ConstBuffer(a.data(), 10, DataType::kFloat32),
                                Buffer::Of(b.data(), 10), c, kCaps)
                  .ok());
  c.send_counts = {std::numeric_limits<size_t>::max(), 2, 0, 0};
  EXPECT_THAT(ValidateAllToAllV(kGroup, ConstBuffer(a.data(), 10, DataType::kFloat32),
                                Buffer::Of(b.data(), 10), c, kCaps),
              InvalidWith("overflow"));
}

TEST(ValidateTest, RootAndPeerOutOfRange) {
  float x = 0;
  EXPECT_THAT(ValidateBroadcast(kGroup, Buffer::Of(&x, 1), 4, kCaps),
              InvalidWith("root 4 is out of range for a group of size 4 (valid: 0..3)"));
  EXPECT_THAT(ValidateReduce(kGroup, ConstBuffer(&x, 1, DataType::kFloat32), Buffer::Of(&x, 1),
                             ReduceOp::kSum, -1, kCaps),
              InvalidWith("root -1 is out of range"));
  EXPECT_THAT(ValidatePeer(kGroup, "send", ConstBuffer(&x, 1, DataType::kFloat32), 7, kCaps),
              InvalidWith("send(peer 7, 1 x fp32) on group tp"));
  EXPECT_THAT(ValidatePeer(kGroup, "recv", ConstBuffer(&x, 1, DataType::kFloat32), -2, kCaps),
              InvalidWith("peer -2 is out of range"));
}

TEST(ValidateTest, ReduceIgnoresRecvOffRoot) {
  float x = 0;
  // rank 1 is not the root: recv may be null.
  EXPECT_TRUE(ValidateReduce(kGroup, ConstBuffer(&x, 1, DataType::kFloat32),
                             Buffer{nullptr, 0, DataType::kFloat32}, ReduceOp::kSum, 0, kCaps)
                  .ok());
  EXPECT_THAT(ValidateReduce(kGroup, ConstBuffer(&x, 1, DataType::kFloat32),
                             Buffer{nullptr, 0, DataType::kFloat32}, ReduceOp::kSum, 1, kCaps),
              InvalidWith("send has 1 x fp32 but recv has 0 x fp32"));
}

TEST(ValidateTest, PartialOverlapIsRejected) {
  std::vector<float> x(16);
  EXPECT_THAT(ValidateAllReduce(kGroup, ConstBuffer(x.data(), 8, DataType::kFloat32),
                                Buffer::Of(x.data() + 4, 8), ReduceOp::kSum, kCaps),
              InvalidWith("overlap without being in place"));
  // In place forms are accepted: allgather sends this rank's block.
  EXPECT_TRUE(ValidateAllGather(kGroup, ConstBuffer(x.data() + 4, 4, DataType::kFloat32),
                                Buffer::Of(x.data(), 16), kCaps)
                  .ok());
  EXPECT_THAT(ValidateAllGather(kGroup, ConstBuffer(x.data(), 4, DataType::kFloat32),
                                Buffer::Of(x.data(), 16), kCaps),
              InvalidWith("recv.data + rank * send.count"));
  EXPECT_TRUE(ValidateReduceScatter(kGroup, ConstBuffer(x.data(), 16, DataType::kFloat32),
                                    Buffer::Of(x.data(), 4), ReduceOp::kSum, kCaps)
                  .ok());
}

TEST(ValidateTest, ExcludedRanks) {
  EXPECT_THAT(ValidateExcluded(kGroup, {4}), InvalidWith("excluded rank 4 is out of range"));
  EXPECT_THAT(ValidateExcluded(kGroup, {1, 1}), InvalidWith("excluded rank 1 is listed twice"));
  EXPECT_THAT(ValidateExcluded(kGroup, {0, 1, 2, 3}), InvalidWith("every rank (4) is excluded"));
  EXPECT_TRUE(ValidateExcluded(kGroup, {}).ok());
  EXPECT_TRUE(ValidateExcluded(kGroup, {3, 0}).ok());
}

}  // namespace
}  // namespace strata::comm_internal
