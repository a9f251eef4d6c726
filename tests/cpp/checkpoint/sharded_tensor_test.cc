// ShardedTensor validation and the writer assignment of replicated shards.
#include "strata/checkpoint/sharded_tensor.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>

namespace strata {
namespace {

using ::testing::HasSubstr;

ShardedTensor Replicated(const std::string& key, int64_t elements, int index, int count) {
  ShardedTensor t = ShardedTensor::Whole(key, DataType::kFloat32, {elements});
  t.replica = {index, count};
  return t;
}

TEST(ShardedTensorTest, ValidShardsPass) {
  ShardedTensor t;
  t.key = "layers.0.w";
  t.dtype = DataType::kBFloat16;
  t.global_shape = {8, 4};
  t.local_shape = {4, 4};
  t.global_offset = {4, 0};
  t.replica = {1, 2};
  EXPECT_TRUE(ValidateShard(t).ok());
  EXPECT_EQ(t.local_elements(), 16);
  EXPECT_EQ(t.local_bytes(), 32u);
  EXPECT_TRUE(ValidateShard(ShardedTensor::Whole("scalar", DataType::kInt64, {})).ok());
  EXPECT_TRUE(ValidateShard(ShardedTensor::Whole("empty", DataType::kInt64, {0, 3})).ok());
  EXPECT_TRUE(ValidateShard(ShardedTensor::Whole("ünïcödé ключ", DataType::kInt8, {1})).ok());
}

TEST(ShardedTensorTest, EachInvalidFieldIsNamed) {
  auto base = [] { return ShardedTensor::Whole("w", DataType::kFloat32, {4, 4}); };
  struct Case {
    std::function<void(ShardedTensor&)> edit;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](ShardedTensor& t) { t.key = ""; }, "empty key"},
      {[](ShardedTensor& t) { t.key = std::string(5000, 'k'); }, "more than 4096"},
      {[](ShardedTensor& t) { t.key = "bad\xff"; }, "not valid UTF-8"},
      {[](ShardedTensor& t) { t.key = "over\xc0\xaflong"; }, "not valid UTF-8"},
      {[](ShardedTensor& t) { t.key = "__metadata__"; }, "reserved"},
      {[](ShardedTensor& t) { t.dtype = static_cast<DataType>(77); }, "outside the enum"},
      {[](ShardedTensor& t) { t.local_shape = {4}; }, "same number of dimensions"},
      {[](ShardedTensor& t) {
         t.global_offset = {0, 0, 0};
       },
       "same number of dimensions"},
      {[](ShardedTensor& t) {
         t.local_shape = {-1, 4};
       },
       "negative"},
      {[](ShardedTensor& t) {
         t.global_offset = {2, 0};
       },
       "extends past the global shape"},
      {[](ShardedTensor& t) {
         t.global_shape = {int64_t{1} << 62, 8};
         t.local_shape = {1, 1};
       },
       "overflows"},
      {[](ShardedTensor& t) {
         t.replica = {2, 2};
       },
       "replica index 2 of count 2"},
      {[](ShardedTensor& t) {
         t.replica = {0, 0};
       },
       "replica index 0 of count 0"},
      {[](ShardedTensor& t) {
         t.global_shape.assign(65, 1);
         t.local_shape.assign(65, 1);
         t.global_offset.assign(65, 0);
       },
       "65 dimensions"},
  };
  for (const Case& c : cases) {
    ShardedTensor t = base();
    c.edit(t);
    absl::Status s = ValidateShard(t);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(s.message(), HasSubstr(c.message));
  }
}

TEST(AssignWritersTest, UnreplicatedShardsAreWrittenByTheirOnlyHolder) {
  std::vector<ShardedTensor> s = {Replicated("a", 10, 0, 1), Replicated("b", 10, 0, 1)};
  EXPECT_THAT(AssignWriters(s), ::testing::ElementsAre(0, 0));
}

// Every replica computes the assignment from its own copy of the list (the
// order may differ per rank); each shard must get one and the same writer.
TEST(AssignWritersTest, ReplicasAgreeWhateverTheOrder) {
  std::mt19937 gen(42);
  for (int dp : {2, 3, 4, 8}) {
    std::vector<std::pair<std::string, int64_t>> tensors;
    for (int i = 0; i < 37; ++i) tensors.emplace_back("t" + std::to_string(i), 1 + gen() % 5000);
    tensors.emplace_back("tie.a", 100);
    tensors.emplace_back("tie.b", 100);
    std::map<std::string, int> writer_of;
    for (int r = 0; r < dp; ++r) {
      std::shuffle(tensors.begin(), tensors.end(), gen);
      std::vector<ShardedTensor> mine;
      for (const auto& [k, n] : tensors) mine.push_back(Replicated(k, n, r, dp));
      const std::vector<int> w = AssignWriters(mine);
      for (size_t i = 0; i < mine.size(); ++i) {
        ASSERT_GE(w[i], 0);
        ASSERT_LT(w[i], dp);
        auto [it, inserted] = writer_of.emplace(mine[i].key, w[i]);
        EXPECT_EQ(it->second, w[i]) << mine[i].key << " dp " << dp;
      }
    }
  }
}

// The bytes are spread: no replica writes more than the least-loaded one
// plus the largest shard (the bound of largest-first greedy assignment).
TEST(AssignWritersTest, SpreadsBytesAcrossReplicas) {
  std::mt19937 gen(7);
  for (int dp : {2, 4, 8}) {
    std::vector<ShardedTensor> s;
    int64_t largest = 0;
    for (int i = 0; i < 100; ++i) {
      const int64_t n = 1 + gen() % 100000;
      largest = std::max(largest, n);
      s.push_back(Replicated("t" + std::to_string(i), n, 0, dp));
    }
    const std::vector<int> w = AssignWriters(s);
    std::vector<uint64_t> load(dp, 0);
    for (size_t i = 0; i < s.size(); ++i) load[static_cast<size_t>(w[i])] += s[i].local_bytes();
    const auto [mn, mx] = std::minmax_element(load.begin(), load.end());
    EXPECT_GT(*mn, 0u) << "replica without work, dp " << dp;
    EXPECT_LE(*mx - *mn, static_cast<uint64_t>(largest) * 4) << "dp " << dp;
  }
  // Many equal (even empty) shards go round-robin.
  std::vector<ShardedTensor> empty;
  for (int i = 0; i < 8; ++i) empty.push_back(Replicated("e" + std::to_string(i), 0, 0, 4));
  std::vector<int> w = AssignWriters(empty);
  std::sort(w.begin(), w.end());
  EXPECT_THAT(w, ::testing::ElementsAre(0, 0, 1, 1, 2, 2, 3, 3));
}

}  // namespace
}  // namespace strata
