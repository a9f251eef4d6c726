// CheckReplicasMatch across "ranks" of an in-process communicator
// (fake_communicator.h), one thread per rank: equal replicas pass; replicas
// that differ in content, shape, dtype or keys fail on every rank, naming
// the tensors and the world ranks of each version; and ContentDigests.
#include "strata/checkpoint/replica_check.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <numeric>
#include <thread>

#include "fake_communicator.h"

namespace strata {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using testing_util::FakeHub;

ReplicaDigest Tensor(std::string key, std::vector<int64_t> shape, const std::vector<float>& v,
                     DataType dtype = DataType::kFloat32) {
  ReplicaDigest d;
  d.key = std::move(key);
  d.dtype = dtype;
  d.shape = std::move(shape);
  d.content = ContentDigests({{v.data(), v.size() * sizeof(float)}}, 1)[0];
  return d;
}

// Runs `tensors_of(world rank)` through CheckReplicasMatch on `n` ranks
// that form `groups` (lists of world ranks) under one "world"; returns
// each world rank's status.
std::vector<absl::Status> Check(int n, const std::vector<std::vector<int>>& groups,
                                const std::function<std::vector<ReplicaDigest>(int)>& tensors_of) {
  auto world = std::make_shared<FakeHub>(n);
  std::vector<std::unique_ptr<Communicator>> world_comm(static_cast<size_t>(n));
  std::vector<std::unique_ptr<Communicator>> group_comm(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) world_comm[static_cast<size_t>(r)] = world->Endpoint(r);
  for (const std::vector<int>& g : groups) {
    auto hub = std::make_shared<FakeHub>("tp-dp-cp", g);
    for (size_t i = 0; i < g.size(); ++i)
      group_comm[static_cast<size_t>(g[i])] = hub->Endpoint(static_cast<int>(i));
  }
  std::vector<absl::Status> out(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      ReplicaGroup g;
      g.group = GroupHandle::Fixed(group_comm[static_cast<size_t>(r)].get());
      g.tensors = tensors_of(r);
      ReplicaCheckOptions o;
      o.all = GroupHandle::Fixed(world_comm[static_cast<size_t>(r)].get());
      o.deadline = absl::Now() + absl::Seconds(30);
      o.step = 7;
      out[static_cast<size_t>(r)] = CheckReplicasMatch({g}, o);
    });
  }
  for (std::thread& t : threads) t.join();
  return out;
}

const std::vector<float> kA = {1, 2, 3, 4, 5, 6};
const std::vector<float> kB = {1, 2, 3, 4, 5, 7};

TEST(ReplicaCheckTest, EqualReplicasPass) {
  for (const absl::Status& s : Check(4, {{0, 1}, {2, 3}}, [](int r) {
         // The two groups hold different tensors; inside each, the same.
         return std::vector<ReplicaDigest>{Tensor("w", {2, 3}, r < 2 ? kA : kB),
                                           Tensor("b", {6}, kA)};
       })) {
    EXPECT_TRUE(s.ok()) << s;
  }
}

TEST(ReplicaCheckTest, ContentThatDiffersNamesTheTensorAndTheRanksOfEachVersion) {
  const std::vector<absl::Status> got = Check(4, {{0, 1, 2, 3}}, [](int r) {
    return std::vector<ReplicaDigest>{Tensor("model.norm.weight", {6}, kA),
                                      Tensor("model.buf", {2, 3}, r % 2 ? kB : kA)};
  });
  for (const absl::Status& s : got) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(),
                AllOf(HasSubstr("checkpoint step 7: the 4 ranks of group 'tp-dp-cp'"),
                      HasSubstr("tensor 'model.buf': world ranks 0, 2 hold fp32 [2, 3] with "
                                "content "),
                      HasSubstr("world ranks 1, 3 hold fp32 [2, 3] with content "),
                      Not(HasSubstr("model.norm.weight"))));
  }
  // Rank 0 failed first: the others report it, with the same explanation.
  EXPECT_THAT(got[1].message(), HasSubstr("rank 0 checking replicas: checkpoint step 7"));
}

TEST(ReplicaCheckTest, ShapesAndDtypesThatDifferAreNamed) {
  const std::vector<absl::Status> got = Check(2, {{0, 1}}, [](int r) {
    return std::vector<ReplicaDigest>{
        Tensor("a", r ? std::vector<int64_t>{3, 2} : std::vector<int64_t>{2, 3}, kA),
        Tensor("b", {6}, kA, r ? DataType::kInt32 : DataType::kFloat32)};
  });
  EXPECT_THAT(got[0].message(), AllOf(HasSubstr("tensor 'a': world rank 0 holds fp32 [2, 3]"),
                                      HasSubstr("world rank 1 holds fp32 [3, 2]"),
                                      HasSubstr("tensor 'b': world rank 0 holds fp32 [6]"),
                                      HasSubstr("world rank 1 holds int32 [6]")));
}

TEST(ReplicaCheckTest, KeysHeldByOnlySomeRanksAreNamed) {
  const std::vector<absl::Status> got = Check(3, {{0, 1, 2}}, [](int r) {
    std::vector<ReplicaDigest> t = {Tensor("shared", {6}, kA)};
    if (r == 2) t.push_back(Tensor("only_on_2", {6}, kA));
    return t;
  });
  for (const absl::Status& s : got) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(),
                AllOf(HasSubstr("should hold the same replicated tensors but do not"),
                      HasSubstr("world ranks 0, 1 hold 1 tensor; world rank 2 holds 2 tensors"),
                      HasSubstr("world rank 2 has 'only_on_2' that world ranks 0, "
                                "1 have not")));
  }
}

TEST(ReplicaCheckTest, AFailureInOneGroupFailsEveryRank) {
  // Groups {0, 2} and {1, 3}; only the second differs.
  const std::vector<absl::Status> got = Check(4, {{0, 2}, {1, 3}}, [](int r) {
    return std::vector<ReplicaDigest>{Tensor("w", {6}, r == 3 ? kB : kA)};
  });
  EXPECT_THAT(got[1].message(), AllOf(HasSubstr("tensor 'w': world rank 1 holds fp32 [6]"),
                                      HasSubstr("world rank 3 holds fp32 [6]")));
  for (int r : {0, 2, 3}) {
    EXPECT_EQ(got[static_cast<size_t>(r)].code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(got[static_cast<size_t>(r)].message(),
                AllOf(HasSubstr("rank 1 checking replicas: "), HasSubstr("tensor 'w'")));
  }
}

TEST(ReplicaCheckTest, ManyTensorsThatDifferAreListedAfterTheFirstFour) {
  const std::vector<absl::Status> got = Check(2, {{0, 1}}, [](int r) {
    std::vector<ReplicaDigest> t;
    for (int i = 0; i < 6; ++i) t.push_back(Tensor("t" + std::to_string(i), {6}, r ? kB : kA));
    return t;
  });
  EXPECT_THAT(got[0].message(), AllOf(HasSubstr("tensor 't3'"), Not(HasSubstr("tensor 't4'")),
                                      HasSubstr("and 2 more tensor(s) differ: 't4', 't5'")));
}

TEST(ReplicaCheckTest, OneRankAloneOrNoCommunicatorHasNothingToCompare) {
  ReplicaGroup g;
  g.tensors = {Tensor("w", {6}, kA)};
  EXPECT_TRUE(CheckReplicasMatch({g}, {}).ok());
  ReplicaCheckOptions o;
  o.version = 99;
  EXPECT_THAT(CheckReplicasMatch({g}, o).message(), HasSubstr("version 99"));
}

TEST(ContentDigestsTest, EqualBytesEqualDigestsWhateverTheThreads) {
  // Over three 8 MiB chunks, so threads split them.
  std::vector<uint8_t> big((size_t{20} << 20) + 3);
  std::iota(big.begin(), big.end(), uint8_t{0});
  std::vector<uint8_t> copy = big;
  const std::vector<HostBytes> bufs = {
      {big.data(), big.size()}, {copy.data(), copy.size()}, {big.data(), 0}, {big.data(), 5}};
  const std::vector<uint64_t> one = ContentDigests(bufs, 1);
  const std::vector<uint64_t> four = ContentDigests(bufs, 4);
  ASSERT_EQ(one.size(), 4u);
  EXPECT_EQ(one, four);
  EXPECT_EQ(one[0], one[1]);
  EXPECT_NE(one[2], one[3]);
  for (size_t at : {size_t{0}, (size_t{8} << 20) - 1, size_t{8} << 20, big.size() - 1}) {
    copy = big;
    copy[at] ^= 1;
    EXPECT_NE(ContentDigests({{copy.data(), copy.size()}}, 4)[0], one[0]) << "byte " << at;
  }
  // A prefix is not the whole.
  EXPECT_NE(ContentDigests({{big.data(), big.size() - 1}}, 2)[0], one[0]);
  EXPECT_TRUE(ContentDigests({}, 4).empty());
}

}  // namespace
}  // namespace strata
