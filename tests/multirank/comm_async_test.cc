// Asynchronous behaviour, structure and local fault handling of the MPI
// backend on N ranks: several operations in flight on different groups,
// in-order completion, deadlines that expire with a clear error, Abort in
// bounded time, Split, counts split into several MPI calls, and root
// communicators rebuilt in one process.
#include <atomic>
#include <cmath>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "harness.h"
#include "typed.h"

namespace strata::testing {
namespace {

class AsyncTest : public MultiRankTest {
 protected:
  // A fresh communicator of every rank, for tests that break theirs.
  std::unique_ptr<Communicator> Fresh(const std::string& name) {
    CommOptions options;
    options.name = name;
    options.timeout = absl::Seconds(120);
    absl::StatusOr<std::unique_ptr<Communicator>> c = world().Split(0, rank(), options);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(c).value() : nullptr;
  }

  // Waits on the world until every rank gets here: the peers of a rank
  // that is still using a fresh communicator must not destroy theirs
  // before it is done (on Gloo, a destroyed peer closes the connections,
  // which would end the operation with "connection lost" first).
  void AllHere() {
    absl::StatusOr<std::unique_ptr<Work>> barrier = world().Barrier();
    ASSERT_TRUE(barrier.ok()) << barrier.status();
    STRATA_EXPECT_OK((*barrier)->Wait(absl::Now() + absl::Seconds(120)));
  }
};

TEST_F(AsyncTest, SplitOrdersByKeyAndSkipsNegativeColors) {
  // Two halves (even/odd ranks), ranked in reverse world order.
  CommOptions options;
  options.name = "half";
  STRATA_ASSERT_OK_AND_ASSIGN(auto half, world().Split(rank() % 2, size() - rank(), options));
  ASSERT_NE(half, nullptr);
  const int members = (size() + 1 - rank() % 2) / 2;
  EXPECT_EQ(half->size(), members);
  // Reverse order: the highest world rank of my parity is group rank 0.
  int above = 0;
  for (int r = rank() + 1; r < size(); ++r) above += (r % 2 == rank() % 2);
  EXPECT_EQ(half->rank(), above);
  EXPECT_EQ(half->name(), "half");
  EXPECT_EQ(half->world_rank(), rank());
  // Only rank 0 takes part in the next split.
  STRATA_ASSERT_OK_AND_ASSIGN(auto solo, world().Split(rank() == 0 ? 5 : -1, 0, options));
  EXPECT_EQ(solo == nullptr, rank() != 0);
  if (solo) EXPECT_EQ(solo->size(), 1);
}

// Operations on three communicators at once, waited for in reverse order.
TEST_F(AsyncTest, SeveralOperationsInFlightOnDifferentGroups) {
  CommOptions options;
  options.name = "pairs";
  STRATA_ASSERT_OK_AND_ASSIGN(auto pairs, world().Split(rank() / 2, rank(), options));
  options.name = "copy";
  STRATA_ASSERT_OK_AND_ASSIGN(auto copy, world().Split(0, rank(), options));
  const size_t n = 1 << 16;
  std::vector<float> a(n, 1.0f), b(n, static_cast<float>(rank())), c(n, 2.0f);
  std::vector<int64_t> ids(size());
  int64_t me = rank();
  std::vector<std::unique_ptr<Work>> works;
  for (int round = 0; round < 3; ++round) {
    std::fill(a.begin(), a.end(), 1.0f);
    std::fill(b.begin(), b.end(), static_cast<float>(rank()));
    std::fill(c.begin(), c.end(), 2.0f);
    works.clear();
    STRATA_ASSERT_OK_AND_ASSIGN(
        auto w1,
        world().AllReduce(Buffer::Of(a.data(), n), Buffer::Of(a.data(), n), ReduceOp::kSum));
    STRATA_ASSERT_OK_AND_ASSIGN(auto w2, pairs->AllReduce(Buffer::Of(b.data(), n),
                                                          Buffer::Of(b.data(), n), ReduceOp::kMax));
    STRATA_ASSERT_OK_AND_ASSIGN(auto w3, copy->AllReduce(Buffer::Of(c.data(), n),
                                                         Buffer::Of(c.data(), n), ReduceOp::kProd));
    STRATA_ASSERT_OK_AND_ASSIGN(auto w4, copy->AllGather(ConstBuffer(&me, 1, DataType::kInt64),
                                                         Buffer::Of(ids.data(), ids.size())));
    works.push_back(std::move(w1));
    works.push_back(std::move(w2));
    works.push_back(std::move(w3));
    works.push_back(std::move(w4));
    for (auto it = works.rbegin(); it != works.rend(); ++it) STRATA_ASSERT_OK(Wait(**it));
    const float pair_max = static_cast<float>(std::min(rank() / 2 * 2 + 1, size() - 1));
    for (size_t i = 0; i < n; i += 4097) {
      EXPECT_EQ(a[i], static_cast<float>(size()));
      EXPECT_EQ(b[i], pair_max);
      EXPECT_EQ(c[i], std::pow(2.0f, size()));
    }
    for (int r = 0; r < size(); ++r) EXPECT_EQ(ids[r], r);
  }
}

// Operations of one communicator complete in the order they were issued:
// once a later one is done, every earlier one is done too.
TEST_F(AsyncTest, CompletesInIssueOrder) {
  auto comm = Fresh("ordered");
  ASSERT_NE(comm, nullptr);
  const size_t big = 1 << 20;
  std::vector<float> x(big, 1.0f);
  std::vector<int32_t> small(size());
  int32_t one = 1;
  for (int round = 0; round < 5; ++round) {
    STRATA_ASSERT_OK_AND_ASSIGN(
        auto first,
        comm->AllReduce(Buffer::Of(x.data(), big), Buffer::Of(x.data(), big), ReduceOp::kMax));
    STRATA_ASSERT_OK_AND_ASSIGN(auto second,
                                comm->AllGather(ConstBuffer(&one, 1, DataType::kInt32),
                                                Buffer::Of(small.data(), small.size())));
    STRATA_ASSERT_OK_AND_ASSIGN(auto third, comm->Barrier());
    STRATA_ASSERT_OK(Wait(*third));
    EXPECT_EQ(second->Test().value_or(false), true);
    EXPECT_EQ(first->Test().value_or(false), true);
  }
}

// A wait whose deadline passes says so (naming rank, group and operation)
// and leaves the operation in flight; it completes when the peer arrives.
TEST_F(AsyncTest, WaitDeadlineExpiresThenOperationCompletes) {
  auto comm = Fresh("late");
  ASSERT_NE(comm, nullptr);
  int32_t value = rank() == 0 ? 42 : -1;
  if (rank() == 1) {
    STRATA_ASSERT_OK_AND_ASSIGN(auto recv, comm->Recv(Buffer::Of(&value, 1), 0));
    absl::Status early = recv->Wait(absl::Now() + absl::Milliseconds(50));
    EXPECT_EQ(early.code(), absl::StatusCode::kDeadlineExceeded) << early;
    EXPECT_TRUE(absl::StrContains(early.message(), "recv(peer 0, 1 x int32) on group late (rank 1"))
        << early;
    EXPECT_TRUE(absl::StrContains(early.message(), "still in flight")) << early;
    EXPECT_EQ(recv->Test().value_or(true), false);
    // Tell rank 0 to send now.
    STRATA_ASSERT_OK_AND_ASSIGN(auto go, comm->Send(ConstBuffer(&value, 1, DataType::kInt32), 0));
    STRATA_ASSERT_OK(Wait(*go));
    STRATA_ASSERT_OK(Wait(*recv));
    EXPECT_EQ(value, 42);
  } else if (rank() == 0) {
    int32_t go = 0;
    STRATA_ASSERT_OK_AND_ASSIGN(auto wait_go, comm->Recv(Buffer::Of(&go, 1), 1));
    STRATA_ASSERT_OK(Wait(*wait_go));
    STRATA_ASSERT_OK_AND_ASSIGN(auto send, comm->Send(ConstBuffer(&value, 1, DataType::kInt32), 1));
    STRATA_ASSERT_OK(Wait(*send));
  }
  STRATA_ASSERT_OK_AND_ASSIGN(auto done, comm->Barrier());
  STRATA_ASSERT_OK(Wait(*done));
}

// An operation past its own timeout fails with DeadlineExceeded naming rank,
// group and operation, and breaks its communicator (AsyncError, later
// calls) without touching others.
TEST_F(AsyncTest, OperationTimeoutBreaksOnlyItsCommunicator) {
  auto comm = Fresh("stuck");
  ASSERT_NE(comm, nullptr);
  if (rank() == 0) {
    int32_t never = 0;
    OpOptions options;
    options.timeout = absl::Milliseconds(200);
    STRATA_ASSERT_OK_AND_ASSIGN(auto recv, comm->Recv(Buffer::Of(&never, 1), size() - 1, options));
    absl::Status s = Wait(*recv);
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "recv(peer " + std::to_string(size() - 1) +
                                                   ", 1 x int32) on group stuck (rank 0 of"))
        << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "timeout of 200ms")) << s;
    EXPECT_EQ(comm->AsyncError().code(), absl::StatusCode::kDeadlineExceeded);
    auto later = comm->Barrier();
    EXPECT_EQ(later.status().code(), absl::StatusCode::kFailedPrecondition) << later.status();
    EXPECT_TRUE(absl::StrContains(later.status().message(), "failed earlier"));
  }
  AllHere();
  STRATA_EXPECT_OK(world().AsyncError());
}

// Abort from another thread ends a wait that would otherwise block until
// its deadline; later calls say the communicator was aborted.
TEST_F(AsyncTest, AbortEndsPendingOperationsInBoundedTime) {
  auto comm = Fresh("aborted");
  ASSERT_NE(comm, nullptr);
  if (rank() == 0) {
    int32_t never = 0;
    STRATA_ASSERT_OK_AND_ASSIGN(auto recv, comm->Recv(Buffer::Of(&never, 1), size() - 1));
    std::atomic<bool> waiting{false};
    std::thread aborter([&] {
      while (!waiting.load()) std::this_thread::yield();
      absl::SleepFor(absl::Milliseconds(20));
      EXPECT_TRUE(comm->Abort().ok());
    });
    waiting.store(true);
    // The deadline is far away: only the abort can end this wait.
    absl::Status s = recv->Wait(absl::Now() + absl::Seconds(100));
    aborter.join();
    EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "aborted by this rank")) << s;
    STRATA_EXPECT_OK(comm->Abort());  // idempotent
    auto later = comm->AllReduce(Buffer::Of(&never, 1), Buffer::Of(&never, 1), ReduceOp::kSum);
    EXPECT_EQ(later.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(absl::StrContains(later.status().message(), "was aborted")) << later.status();
    EXPECT_EQ(comm->AsyncError().code(), absl::StatusCode::kAborted);
  }
  AllHere();
}

// With at most 7 elements per MPI call, every operation is split into many
// calls, including the strided, per-root and point-to-point forms.
TEST_F(AsyncTest, CountsLargerThanOneCallAreSplit) {
  RootOptions options = HarnessRootOptions();
  options.mpi.max_elements_per_call = 7;
  options.comm.name = "chunked";
  absl::StatusOr<LaunchEnv> env = LaunchEnv::Detect();
  ASSERT_TRUE(env.ok());
  STRATA_ASSERT_OK_AND_ASSIGN(auto c, CreateRootCommunicator(*env, options));
  const DataType t = DataType::kInt32;
  const ReduceOp sum = ReduceOp::kSum;
  for (size_t n : {size_t{7}, size_t{50}}) {
    for (bool in_place : {false, true}) {
      SCOPED_TRACE(Case("chunked", t, n, in_place ? "in-place" : ""));
      {  // allreduce
        TypedBuffer s(t, n), r(t, n);
        for (size_t i = 0; i < n; ++i) s.Set(i, InputValue(rank(), size(), i, sum, t));
        TypedBuffer& out = in_place ? s : r;
        STRATA_ASSERT_OK_AND_ASSIGN(auto w, c->AllReduce(s.buffer(), out.buffer(), sum));
        STRATA_ASSERT_OK(Wait(*w));
        for (size_t i = 0; i < n; ++i) EXPECT_EQ(out.Get(i), Reference(size(), i, sum, t)) << i;
      }
      {  // allgather (strided chunks)
        TypedBuffer s(t, n), r(t, n * size());
        Buffer in = in_place ? r.slice(n * rank(), n) : s.buffer();
        for (size_t i = 0; i < n; ++i)
          (in_place ? r : s).Set((in_place ? n * rank() : 0) + i, MoveValue(rank(), i, t));
        STRATA_ASSERT_OK_AND_ASSIGN(auto w, c->AllGather(in, r.buffer()));
        STRATA_ASSERT_OK(Wait(*w));
        for (int k = 0; k < size(); ++k) {
          for (size_t i = 0; i < n; ++i) EXPECT_EQ(r.Get(k * n + i), MoveValue(k, i, t));
        }
      }
      {  // reduce-scatter (one reduce per root and chunk)
        TypedBuffer s(t, n * size()), r(t, n);
        for (size_t i = 0; i < n * size(); ++i) s.Set(i, InputValue(rank(), size(), i, sum, t));
        Buffer out = in_place ? s.slice(0, n) : r.buffer();
        STRATA_ASSERT_OK_AND_ASSIGN(auto w, c->ReduceScatter(s.buffer(), out, sum));
        STRATA_ASSERT_OK(Wait(*w));
        TypedBuffer& res = in_place ? s : r;
        for (size_t i = 0; i < n; ++i) {
          EXPECT_EQ(res.Get(i), Reference(size(), n * rank() + i, sum, t)) << i;
        }
      }
      {  // all-to-all (strided chunks)
        TypedBuffer s(t, n * size()), r(t, n * size());
        for (int j = 0; j < size(); ++j) {
          for (size_t i = 0; i < n; ++i) s.Set(j * n + i, MoveValue(rank() * size() + j, i, t));
        }
        TypedBuffer& out = in_place ? s : r;
        STRATA_ASSERT_OK_AND_ASSIGN(auto w, c->AllToAll(s.buffer(), out.buffer()));
        STRATA_ASSERT_OK(Wait(*w));
        for (int j = 0; j < size(); ++j) {
          for (size_t i = 0; i < n; ++i) {
            EXPECT_EQ(out.Get(j * n + i), MoveValue(j * size() + rank(), i, t));
          }
        }
      }
      {  // all-to-all-v (point to point); symmetric counts for in place
        AllToAllCounts counts;
        auto count = [&](int from, int to) {
          return in_place ? n + static_cast<size_t>((from + to) % 2)
                          : n + static_cast<size_t>((from + 2 * to) % 3);
        };
        size_t st = 0, rt = 0;
        for (int j = 0; j < size(); ++j) {
          counts.send_counts.push_back(count(rank(), j));
          counts.recv_counts.push_back(count(j, rank()));
          st += count(rank(), j);
          rt += count(j, rank());
        }
        TypedBuffer s(t, st), r(t, rt);
        size_t off = 0;
        for (int j = 0; j < size(); ++j) {
          for (size_t i = 0; i < count(rank(), j); ++i)
            s.Set(off++, MoveValue(rank() * 8 + j, i, t));
        }
        TypedBuffer& out = in_place ? s : r;
        STRATA_ASSERT_OK_AND_ASSIGN(auto w, c->AllToAllV(s.buffer(), out.buffer(), counts));
        STRATA_ASSERT_OK(Wait(*w));
        off = 0;
        for (int j = 0; j < size(); ++j) {
          for (size_t i = 0; i < count(j, rank()); ++i) {
            EXPECT_EQ(out.Get(off++), MoveValue(j * 8 + rank(), i, t)) << "from " << j;
          }
        }
      }
    }
    {  // broadcast, reduce, send/recv
      TypedBuffer b(t, n), s(t, n), r(t, n), p(t, n), q(t, n);
      for (size_t i = 0; i < n; ++i) {
        b.Set(i, MoveValue(rank(), i, t));
        q.Set(i, MoveValue(rank(), i, t));
        s.Set(i, InputValue(rank(), size(), i, sum, t));
      }
      STRATA_ASSERT_OK_AND_ASSIGN(auto w1, c->Broadcast(b.buffer(), size() - 1));
      STRATA_ASSERT_OK_AND_ASSIGN(auto w2, c->Reduce(s.buffer(), r.buffer(), sum, 0));
      const int next = (rank() + 1) % size(), prev = (rank() + size() - 1) % size();
      STRATA_ASSERT_OK_AND_ASSIGN(auto w3, c->Recv(p.buffer(), prev));
      STRATA_ASSERT_OK_AND_ASSIGN(auto w4, c->Send(q.buffer(), next));
      for (auto* w : {w1.get(), w2.get(), w3.get(), w4.get()}) STRATA_ASSERT_OK(Wait(*w));
      for (size_t i = 0; i < n; ++i) {
        EXPECT_EQ(b.Get(i), MoveValue(size() - 1, i, t));
        if (rank() == 0) EXPECT_EQ(r.Get(i), Reference(size(), i, sum, t));
        EXPECT_EQ(p.Get(i), MoveValue(prev, i, t));
      }
    }
  }
}

// A receive given fewer elements than were sent, or more, is an error
// naming both counts, and the communicator stays usable.
TEST_F(AsyncTest, MismatchedSendRecvCountsAreNamed) {
  auto comm = Fresh("mismatch");
  ASSERT_NE(comm, nullptr);
  std::vector<int32_t> data(8, 3);
  if (rank() == 0) {
    STRATA_ASSERT_OK_AND_ASSIGN(auto s1, comm->Send(Buffer::Of(data.data(), 4), 1));
    STRATA_ASSERT_OK_AND_ASSIGN(auto s2, comm->Send(Buffer::Of(data.data(), 8), 1));
    STRATA_ASSERT_OK(Wait(*s1));
    STRATA_ASSERT_OK(Wait(*s2));
  } else if (rank() == 1) {
    STRATA_ASSERT_OK_AND_ASSIGN(auto r1, comm->Recv(Buffer::Of(data.data(), 8), 0));
    absl::Status shorter = Wait(*r1);
    EXPECT_EQ(shorter.code(), absl::StatusCode::kInvalidArgument) << shorter;
    EXPECT_TRUE(absl::StrContains(shorter.message(), "received 4 x int32, expected 8")) << shorter;
    STRATA_ASSERT_OK_AND_ASSIGN(auto r2, comm->Recv(Buffer::Of(data.data(), 4), 0));
    absl::Status longer = Wait(*r2);
    EXPECT_EQ(longer.code(), absl::StatusCode::kInvalidArgument) << longer;
    EXPECT_TRUE(absl::StrContains(longer.message(), "larger than the buffer")) << longer;
  }
  STRATA_ASSERT_OK_AND_ASSIGN(auto done, comm->Barrier());
  STRATA_ASSERT_OK(Wait(*done));
}

// Shrink without failures: excluded ranks get no communicator, the others
// a working one; survivors that pass different lists get an error instead
// of a communicator with the wrong members.
TEST_F(AsyncTest, ShrinkExcludesLiveRanks) {
  auto comm = Fresh("whole");
  ASSERT_NE(comm, nullptr);
  CommOptions options;
  options.name = "shrunk";
  options.timeout = absl::Seconds(60);
  const int last = size() - 1;
  STRATA_ASSERT_OK_AND_ASSIGN(auto shrunk, comm->Shrink({last}, options));
  if (rank() == last) {
    EXPECT_EQ(shrunk, nullptr);
  } else {
    ASSERT_NE(shrunk, nullptr);
    EXPECT_EQ(shrunk->size(), size() - 1);
    EXPECT_EQ(shrunk->rank(), rank());
    int32_t one = 1, sum = 0;
    STRATA_ASSERT_OK_AND_ASSIGN(
        auto w, shrunk->AllReduce(Buffer::Of(&one, 1), Buffer::Of(&sum, 1), ReduceOp::kSum));
    STRATA_ASSERT_OK(Wait(*w));
    EXPECT_EQ(sum, size() - 1);
  }
  EXPECT_EQ(comm->Shrink({rank(), rank()}, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(comm->Shrink({size()}, options).status().code(), absl::StatusCode::kInvalidArgument);
  if (size() >= 3) {
    // Rank 0 excludes the last rank, everybody else excludes nobody.
    options.timeout = absl::Seconds(3);
    std::vector<int> excluded;
    if (rank() == 0) excluded.push_back(last);
    auto mixed = comm->Shrink(excluded, options);
    EXPECT_FALSE(mixed.ok());
    const absl::StatusCode code = mixed.status().code();
    EXPECT_TRUE(code == absl::StatusCode::kInvalidArgument ||
                code == absl::StatusCode::kDeadlineExceeded)
        << mixed.status();
    if (code == absl::StatusCode::kInvalidArgument) {
      EXPECT_TRUE(absl::StrContains(mixed.status().message(), "different list")) << mixed.status();
    }
  }
}

// Root communicators can be created and destroyed repeatedly in one
// process, with operations in flight when one is destroyed.
TEST_F(AsyncTest, RootCommunicatorsAreRebuilt) {
  absl::StatusOr<LaunchEnv> env = LaunchEnv::Detect();
  ASSERT_TRUE(env.ok());
  for (int round = 0; round < 3; ++round) {
    RootOptions options = HarnessRootOptions();
    options.comm.name = "rebuilt";
    STRATA_ASSERT_OK_AND_ASSIGN(auto c, CreateRootCommunicator(*env, options));
    int32_t v = 1, sum = 0;
    STRATA_ASSERT_OK_AND_ASSIGN(
        auto w, c->AllReduce(Buffer::Of(&v, 1), Buffer::Of(&sum, 1), ReduceOp::kSum));
    STRATA_ASSERT_OK(Wait(*w));
    EXPECT_EQ(sum, size());
    if (round == 2 && rank() == 0) {
      // Destroyed with a receive in flight: the work fails, nothing hangs.
      int32_t never = 0;
      STRATA_ASSERT_OK_AND_ASSIGN(auto pending, c->Recv(Buffer::Of(&never, 1), size() - 1));
      c.reset();
      absl::Status s = pending->Wait(absl::Now() + absl::Seconds(30));
      EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
    }
  }
}

}  // namespace
}  // namespace strata::testing
