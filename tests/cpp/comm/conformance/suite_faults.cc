// The conformance suite (conformance.h), continued: faults (abort, revoke)
// and structure (split, shrink, mismatched counts). See suite.cc.
#include <gmock/gmock.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <set>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "conformance.h"
#include "suite_util.h"

namespace strata::testing {
namespace {

using conformance_internal::AllHere;
using conformance_internal::Exchange;
using conformance_internal::Fresh;
using conformance_internal::Moved;
using conformance_internal::Valid;
using conformance_internal::Where;
using ::testing::HasSubstr;

// ---- faults -------------------------------------------------------------------

// An all-reduce of ones over `comm` gives its size (a shrunk communicator
// works).
void ExpectItCountsItsRanks(Communicator& comm, Memory& memory) {
  Tensor one(memory, DataType::kInt32, 1), sum(memory, DataType::kInt32, 1);
  one.Set(0, 1);
  one.Upload();
  STRATA_ASSERT_OK_AND_ASSIGN(auto w, comm.AllReduce(one.buffer(), sum.buffer(), ReduceOp::kSum));
  STRATA_ASSERT_OK(w->Wait(absl::Now() + absl::Seconds(120)));
  sum.Download();
  EXPECT_EQ(sum.Get(0), comm.size());
}

// Abort from another thread ends a wait that would otherwise block until
// its deadline; later calls say the communicator was aborted.
TEST_P(Conformance, AbortEndsPendingOperationsInBoundedTime) {
  OnEveryRank([&](Communicator& world) {
    auto comm = Fresh(world, "aborted");
    ASSERT_NE(comm, nullptr);
    if (comm->rank() == 0) {
      Tensor never(memory(), DataType::kInt32, 1);
      STRATA_ASSERT_OK_AND_ASSIGN(auto recv, comm->Recv(never.buffer(), comm->size() - 1));
      std::atomic<bool> waiting{false};
      std::thread aborter([&] {
        while (!waiting.load()) std::this_thread::yield();
        absl::SleepFor(absl::Milliseconds(20));
        EXPECT_TRUE(comm->Abort().ok());
      });
      waiting.store(true);
      const absl::Time start = absl::Now();
      // The deadline is far away: only the abort can end this wait.
      absl::Status s = recv->Wait(absl::Now() + absl::Seconds(100));
      aborter.join();
      EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
      EXPECT_THAT(std::string(s.message()), HasSubstr("aborted by this rank")) << s;
      EXPECT_LT(absl::Now() - start, absl::Seconds(30));
      STRATA_EXPECT_OK(comm->Abort());  // idempotent
      auto later = comm->AllReduce(never.buffer(), never.buffer(), ReduceOp::kSum);
      EXPECT_EQ(later.status().code(), absl::StatusCode::kFailedPrecondition) << later.status();
      EXPECT_THAT(std::string(later.status().message()), HasSubstr("was aborted"));
      EXPECT_EQ(comm->AsyncError().code(), absl::StatusCode::kAborted);
    }
    AllHere(world);
  });
}

// Whether Revoke works here: every rank revokes a throwaway communicator
// (the same answer on every rank, from the same build and library).
bool CanRevoke(Communicator& world) {
  auto probe = Fresh(world, "probe");
  if (probe == nullptr) return false;
  const absl::Status s = probe->Revoke();
  EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kUnimplemented ||
              s.code() == absl::StatusCode::kFailedPrecondition)
      << s;
  AllHere(world);
  return s.ok();
}

// A revocation by one rank ends the others' pending operations with
// Aborted, and later operations everywhere; the survivors can still shrink.
TEST_P(Conformance, RevokeReachesEveryRankAndShrinkStillWorks) {
  OnEveryRank([&](Communicator& world) {
    if (!CanRevoke(world)) GTEST_SKIP() << world.backend() << " cannot revoke here";
    auto comm = Fresh(world, "revoked");
    ASSERT_NE(comm, nullptr);
    Tensor x(memory(), DataType::kInt32, 1);
    x.Upload();
    std::unique_ptr<Work> pending;
    // The others block in an allreduce rank 0 never joins.
    if (comm->rank() != 0) {
      STRATA_ASSERT_OK_AND_ASSIGN(pending, comm->AllReduce(x.buffer(), x.buffer(), ReduceOp::kSum));
    }
    AllHere(world);
    if (comm->rank() == 0) {
      absl::SleepFor(absl::Milliseconds(50));
      STRATA_ASSERT_OK(comm->Revoke());
      EXPECT_EQ(comm->AsyncError().code(), absl::StatusCode::kAborted);
    } else {
      absl::Status s = pending->Wait(Deadline());
      EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
      EXPECT_THAT(std::string(s.message()), HasSubstr("revoked")) << s;
    }
    AllHere(world);  // every rank has seen the revocation
    auto later = comm->Barrier();
    EXPECT_EQ(later.status().code(), absl::StatusCode::kAborted) << later.status();
    // The survivors of a revoked communicator can still shrink it.
    if (comm->size() > 1) {
      CommOptions options;
      options.name = "after-revoke";
      options.timeout = absl::Seconds(60);
      STRATA_ASSERT_OK_AND_ASSIGN(auto shrunk, comm->Shrink({0}, options));
      EXPECT_EQ(shrunk == nullptr, comm->rank() == 0);
      if (shrunk != nullptr) {
        Tensor one(memory(), DataType::kInt32, 1), sum(memory(), DataType::kInt32, 1);
        one.Set(0, 1);
        one.Upload();
        STRATA_ASSERT_OK_AND_ASSIGN(auto w,
                                    shrunk->AllReduce(one.buffer(), sum.buffer(), ReduceOp::kSum));
        STRATA_ASSERT_OK(Wait(*w));
        sum.Download();
        EXPECT_EQ(sum.Get(0), comm->size() - 1);
      }
    }
    AllHere(world);
  });
}

// ---- structure ----------------------------------------------------------------

TEST_P(Conformance, SplitOrdersByKeyAndSkipsNegativeColors) {
  OnEveryRank([&](Communicator& world) {
    const int rank = world.rank(), size = world.size();
    // Two halves (even/odd ranks), ranked in reverse world order.
    CommOptions options;
    options.name = "half";
    STRATA_ASSERT_OK_AND_ASSIGN(auto half, world.Split(rank % 2, size - rank, options));
    ASSERT_NE(half, nullptr);
    EXPECT_EQ(half->size(), (size + 1 - rank % 2) / 2);
    int above = 0;  // the highest world rank of my parity is group rank 0
    for (int r = rank + 1; r < size; ++r) above += (r % 2 == rank % 2);
    EXPECT_EQ(half->rank(), above);
    EXPECT_EQ(half->name(), "half");
    EXPECT_EQ(half->world_rank(), world.world_rank());
    EXPECT_EQ(half->backend(), world.backend());
    // The half works: the sum of its members' world ranks.
    Tensor mine(memory(), DataType::kInt64, 1), sum(memory(), DataType::kInt64, 1);
    mine.Set(0, rank);
    mine.Upload();
    STRATA_ASSERT_OK_AND_ASSIGN(auto w,
                                half->AllReduce(mine.buffer(), sum.buffer(), ReduceOp::kSum));
    STRATA_ASSERT_OK(Wait(*w));
    sum.Download();
    double want = 0;
    for (int r = rank % 2; r < size; r += 2) want += r;
    EXPECT_EQ(sum.Get(0), want);
    // Only rank 0 takes part in the next split.
    STRATA_ASSERT_OK_AND_ASSIGN(auto solo, world.Split(rank == 0 ? 5 : -1, 0, options));
    EXPECT_EQ(solo == nullptr, rank != 0);
    if (solo) EXPECT_EQ(solo->size(), 1);
    AllHere(world);
  });
}

// Shrink without failures: excluded ranks get no communicator and take no
// part, the others a working one in their old order; survivors that pass
// different lists get an error instead of a communicator.
TEST_P(Conformance, ShrinkExcludesLiveRanks) {
  OnEveryRank([&](Communicator& world) {
    auto comm = Fresh(world, "whole");
    ASSERT_NE(comm, nullptr);
    const int rank = comm->rank(), size = comm->size(), last = size - 1;
    CommOptions options;
    options.name = "shrunk";
    options.timeout = absl::Seconds(60);
    if (size > 1) {
      STRATA_ASSERT_OK_AND_ASSIGN(auto shrunk, comm->Shrink({last}, options));
      if (rank == last) {
        EXPECT_EQ(shrunk, nullptr);
      } else {
        ASSERT_NE(shrunk, nullptr);
        EXPECT_EQ(shrunk->size(), size - 1);
        EXPECT_EQ(shrunk->rank(), rank);
        EXPECT_EQ(shrunk->name(), "shrunk");
        ExpectItCountsItsRanks(*shrunk, memory());
      }
    }
    // Excluding nobody: a copy.
    STRATA_ASSERT_OK_AND_ASSIGN(auto same, comm->Shrink({}, options));
    ASSERT_NE(same, nullptr);
    EXPECT_EQ(same->size(), size);
    EXPECT_EQ(same->rank(), rank);
    if (size >= 3) {
      // Rank 0 excludes the last rank, everybody else excludes nobody.
      options.timeout = absl::Seconds(3);
      std::vector<int> excluded;
      if (rank == 0) excluded.push_back(last);
      auto mixed = comm->Shrink(excluded, options);
      EXPECT_FALSE(mixed.ok());
      const absl::StatusCode code = mixed.status().code();
      EXPECT_TRUE(code == absl::StatusCode::kInvalidArgument ||
                  code == absl::StatusCode::kDeadlineExceeded)
          << mixed.status();
      if (code == absl::StatusCode::kInvalidArgument) {
        EXPECT_THAT(std::string(mixed.status().message()), HasSubstr("different list"));
      }
    }
    AllHere(world);
  });
}

// A shrink told that its excluded ranks are going (excluded_exit_wait)
// still excludes a rank that stays alive: the backend waits at most that
// long for it to be reported failed, then builds the communicator among
// the survivors alone. A negative wait is refused, naming it.
TEST_P(Conformance, ShrinkWaitingForExcludedRanksToExitStillExcludesLiveOnes) {
  OnEveryRank([&](Communicator& world) {
    if (world.size() < 2) GTEST_SKIP() << "needs two ranks";
    auto comm = Fresh(world, "going");
    ASSERT_NE(comm, nullptr);
    const int rank = comm->rank(), size = comm->size(), last = size - 1;
    CommOptions options;
    options.name = "shrunk";
    options.timeout = absl::Seconds(60);
    options.excluded_exit_wait = absl::Seconds(-1);
    auto refused = comm->Shrink({last}, options);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
    EXPECT_THAT(std::string(refused.status().message()),
                HasSubstr("excluded_exit_wait -1s must not be negative"));
    options.excluded_exit_wait = absl::Milliseconds(300);
    STRATA_ASSERT_OK_AND_ASSIGN(auto shrunk, comm->Shrink({last}, options));
    if (rank == last) {
      EXPECT_EQ(shrunk, nullptr);
    } else {
      ASSERT_NE(shrunk, nullptr);
      EXPECT_EQ(shrunk->size(), size - 1);
      EXPECT_EQ(shrunk->rank(), rank);
      ExpectItCountsItsRanks(*shrunk, memory());
    }
    AllHere(world);
  });
}

// A receive given fewer elements than were sent, or more, is an error
// naming both counts, and the communicator stays usable. (NCCL cannot tell:
// its receives take what they are given.)
TEST_P(Conformance, MismatchedSendRecvCountsAreNamed) {
  OnEveryRank([&](Communicator& world) {
    if (world.backend() == "nccl") GTEST_SKIP() << "NCCL does not check message sizes";
    if (world.size() < 2) GTEST_SKIP() << "needs two ranks";
    auto comm = Fresh(world, "mismatch");
    ASSERT_NE(comm, nullptr);
    Tensor data(memory(), DataType::kInt32, 8);
    data.Upload();
    if (comm->rank() == 0) {
      STRATA_ASSERT_OK_AND_ASSIGN(auto s1, comm->Send(data.slice(0, 4), 1));
      STRATA_ASSERT_OK_AND_ASSIGN(auto s2, comm->Send(data.slice(0, 8), 1));
      STRATA_ASSERT_OK(Wait(*s1));
      STRATA_ASSERT_OK(Wait(*s2));
    } else if (comm->rank() == 1) {
      STRATA_ASSERT_OK_AND_ASSIGN(auto r1, comm->Recv(data.slice(0, 8), 0));
      absl::Status shorter = Wait(*r1);
      EXPECT_EQ(shorter.code(), absl::StatusCode::kInvalidArgument) << shorter;
      EXPECT_THAT(std::string(shorter.message()), HasSubstr("received 4 x int32, expected 8"));
      STRATA_ASSERT_OK_AND_ASSIGN(auto r2, comm->Recv(data.slice(0, 4), 0));
      absl::Status longer = Wait(*r2);
      EXPECT_EQ(longer.code(), absl::StatusCode::kInvalidArgument) << longer;
      EXPECT_THAT(std::string(longer.message()), HasSubstr("larger than the buffer"));
    }
    STRATA_ASSERT_OK_AND_ASSIGN(auto done, comm->Barrier());
    STRATA_ASSERT_OK(Wait(*done));
    AllHere(world);
  });
}

}  // namespace
}  // namespace strata::testing
