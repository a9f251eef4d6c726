// What the conformance suite (comm_conformance_test) cannot say for every
// backend, on N ranks of a launched job: counts split into several MPI calls
// (MpiOptions::max_elements_per_call), root communicators rebuilt in one
// process with an operation in flight, and a receive failed by Abort that
// leaves its buffer alone when the message comes later.
#include <memory>
#include <vector>

#include "harness.h"
#include "typed.h"

namespace strata::testing {
namespace {

class AsyncTest : public MultiRankTest {};

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

// Once a pending receive has failed (here by Abort), its caller may free
// the buffer: a message that arrives afterwards must not be written into it
// (MPI cannot forget a posted receive unless it is cancelled; the pipeline
// runner frees its receive buffers after a failed step).
TEST_F(AsyncTest, AnAbortedReceiveLeavesItsBufferAlone) {
  if (size() < 2) GTEST_SKIP() << "needs 2 ranks";
  absl::StatusOr<LaunchEnv> env = LaunchEnv::Detect();
  ASSERT_TRUE(env.ok());
  RootOptions options = HarnessRootOptions();
  options.comm.name = "aborted";
  STRATA_ASSERT_OK_AND_ASSIGN(auto c, CreateRootCommunicator(*env, options));
  CommOptions control_options;
  control_options.name = "control";
  STRATA_ASSERT_OK_AND_ASSIGN(auto control, c->Split(0, rank(), control_options));
  auto barrier = [&] {
    STRATA_ASSERT_OK_AND_ASSIGN(auto w, control->Barrier());
    STRATA_ASSERT_OK(Wait(*w));
  };
  std::vector<int32_t> got(4, -1);
  if (rank() == 0) {
    STRATA_ASSERT_OK_AND_ASSIGN(auto pending, c->Recv(Buffer::Of(got.data(), got.size()), 1));
    STRATA_ASSERT_OK(c->Abort());
    absl::Status s = pending->Wait(absl::Now() + absl::Seconds(30));
    EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  }
  barrier();  // rank 0's receive has failed: rank 1 sends what it waited for
  if (rank() == 1) {
    // MPI delivers the message to nobody; Gloo tells the sender that rank 0
    // gave up on it.
    std::vector<int32_t> seven(4, 7);
    STRATA_ASSERT_OK_AND_ASSIGN(auto w, c->Send(Buffer::Of(seven.data(), seven.size()), 0));
    absl::Status sent = Wait(*w);
    EXPECT_TRUE(sent.ok() || sent.code() == absl::StatusCode::kUnavailable) << sent;
  }
  barrier();
  if (rank() == 0) {
    absl::SleepFor(absl::Milliseconds(300));  // time for the message to land anywhere
    barrier();
    EXPECT_EQ(got, std::vector<int32_t>(4, -1)) << "the aborted receive's buffer was written";
  } else {
    barrier();
  }
}

}  // namespace
}  // namespace strata::testing
