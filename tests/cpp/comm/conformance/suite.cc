// The conformance suite (conformance.h): what every backend must do, with
// the same results and the same messages. Data is checked against
// references computed here (typed.h); misuse against the exact message
// Communicator gives on every backend.
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

// ---- who and what -------------------------------------------------------------

TEST_P(Conformance, KnowsItsGroupAndMemory) {
  OnEveryRank([&](Communicator& world) {
    EXPECT_GE(world.rank(), 0);
    EXPECT_LT(world.rank(), world.size());
    EXPECT_EQ(world.world_rank(), world.rank());  // a root communicator
    EXPECT_FALSE(world.name().empty());
    EXPECT_FALSE(world.backend().empty());
    EXPECT_EQ(world.memory() == MemoryKind::kHost, memory().host());
    ASSERT_NE(world.capabilities().can_move, nullptr);
    ASSERT_NE(world.capabilities().can_reduce, nullptr);
    EXPECT_GT(world.timeout(), absl::ZeroDuration());
    STRATA_EXPECT_OK(world.AsyncError());
  });
}

// Misuse is refused by the call, before the backend sees it, with the same
// message on every backend (Communicator validates; nothing is recorded).
TEST_P(Conformance, MisuseIsNamedTheSameOnEveryBackend) {
  OnEveryRank([&](Communicator& world) {
    const int n = world.size();
    const std::string where = Where(world);
    const std::string ns = std::to_string(n);
    auto sink = std::make_shared<RecordingSink>();
    Tensor x(memory(), DataType::kInt32, 4 * static_cast<size_t>(n) + 8);
    Tensor flags(memory(), DataType::kBool, 2);
    auto message = [](const absl::StatusOr<std::unique_ptr<Work>>& w) {
      EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument) << w.status();
      return std::string(w.status().message());
    };
    const ReduceOp sum = ReduceOp::kSum;
    EXPECT_EQ(
        message(world.AllReduce(ConstBuffer(nullptr, 3, DataType::kInt32), x.slice(0, 3), sum)),
        "allreduce(sum, 3 x int32) on " + where + ": send buffer is null with count 3 x int32");
    EXPECT_EQ(message(world.AllReduce(x.slice(0, 3), x.slice(0, 3), ReduceOp::kAvg)),
              "allreduce(avg, 3 x int32) on " + where +
                  ": reduce op avg is not defined for integer dtype int32 (use sum and divide, or "
                  "a floating-point dtype)");
    EXPECT_EQ(message(world.AllReduce(x.slice(0, 4), x.slice(2, 4), sum)),
              "allreduce(sum, 4 x int32) on " + where +
                  ": send and recv buffers overlap without being in place (allreduce(sum, 4 x "
                  "int32) is in place when send.data == recv.data)");
    EXPECT_EQ(
        message(world.AllReduce(x.slice(0, 2), x.slice(4, 3), sum)),
        "allreduce(sum, 3 x int32) on " + where + ": send has 2 x int32 but recv has 3 x int32");
    EXPECT_EQ(message(world.AllReduce(ConstBuffer(flags.buffer()), flags.buffer(), ReduceOp::kMax)),
              "allreduce(max, 2 x bool) on " + where +
                  ": send buffer dtype bool cannot be reduced by this backend");
    Buffer unknown = x.slice(0, 1);
    unknown.dtype = static_cast<DataType>(77);
    EXPECT_EQ(message(world.Broadcast(unknown, 0)),
              "broadcast(root 0, 1 x dtype#77) on " + where + ": buffer: unknown dtype value 77");
    const size_t huge = std::numeric_limits<size_t>::max() / 2;
    Buffer overflowing = x.slice(0, 1);
    overflowing.count = huge;
    EXPECT_EQ(message(world.Broadcast(overflowing, 0)),
              absl::StrCat("broadcast(root 0, ", huge, " x int32) on ", where, ": buffer of ", huge,
                           " x int32 overflows the byte size"));
    EXPECT_EQ(message(world.Send(x.slice(0, 1), n)),
              absl::StrCat("send(peer ", n, ", 1 x int32) on ", where, ": peer ", n,
                           " is out of range for a group of size ", n, " (valid: 0..", n - 1, ")"));
    EXPECT_EQ(message(world.Recv(x.slice(0, 1), -1)),
              absl::StrCat("recv(peer -1, 1 x int32) on ", where,
                           ": peer -1 is out of range for a group of size ", n, " (valid: 0..",
                           n - 1, ")"));
    EXPECT_EQ(message(world.Reduce(x.slice(0, 1), x.slice(0, 1), sum, n)),
              absl::StrCat("reduce(sum, root ", n, ", 1 x int32) on ", where, ": root ", n,
                           " is out of range for a group of size ", n, " (valid: 0..", n - 1, ")"));
    const size_t wrong = 2 * static_cast<size_t>(n) + 1;
    EXPECT_EQ(message(world.AllGather(x.slice(0, 2), x.slice(2, wrong))),
              absl::StrCat("allgather(2 x int32) on ", where, ": recv has ", wrong,
                           " x int32 but must hold ", n, " x 2 = ", 2 * n, " elements"));
    EXPECT_EQ(message(world.ReduceScatter(x.slice(0, wrong), x.slice(wrong, 2), sum)),
              absl::StrCat("reduce_scatter(sum, 2 x int32) on ", where, ": send has ", wrong,
                           " x int32 but must hold ", n, " x 2 = ", 2 * n, " elements"));
    AllToAllCounts one{{1}, {1}};
    if (n > 1) {
      EXPECT_EQ(message(world.AllToAll(x.slice(0, n + 1), x.slice(n + 1, n + 1))),
                absl::StrCat("all_to_all(", n + 1, " x int32) on ", where, ": count ", n + 1,
                             " is not divisible by the group size ", n,
                             " (equal splits; use AllToAllV for unequal ones)"));
      EXPECT_EQ(message(world.AllToAllV(x.slice(0, 1), x.slice(1, 1), one)),
                absl::StrCat("all_to_all_v(1 x int32) on ", where,
                             ": send_counts has 1 entries and recv_counts 1; both need one per "
                             "rank (",
                             n, ")"));
    }
    OpOptions negative;
    negative.timeout = absl::Seconds(-1);
    EXPECT_EQ(message(world.Barrier(negative)),
              "barrier() on " + where + ": timeout -1s is negative");
    // New communicators' options, and the excluded ranks of a shrink.
    CommOptions unnamed;
    unnamed.name = "";
    EXPECT_EQ(world.Split(0, 0, unnamed).status(),
              absl::InvalidArgumentError("communicator name is empty"));
    CommOptions future;
    future.version = 2;
    EXPECT_EQ(world.Shrink({}, future).status(),
              absl::InvalidArgumentError("CommOptions version 2 is not supported (this build: 1)"));
    CommOptions instant;
    instant.name = "instant";
    instant.timeout = absl::ZeroDuration();
    EXPECT_EQ(world.Split(0, 0, instant).status(),
              absl::InvalidArgumentError("communicator 'instant': timeout 0 must be positive"));
    CommOptions fine;
    fine.name = "shrunk";
    EXPECT_EQ(world.Shrink({n}, fine).status(),
              absl::InvalidArgumentError(absl::StrCat("shrink on ", where, ": excluded rank ", n,
                                                      " is out of range for a group of size ", n)));
    EXPECT_EQ(world.Shrink({0, 0}, fine).status(),
              absl::InvalidArgumentError(
                  absl::StrCat("shrink on ", where, ": excluded rank 0 is listed twice")));
    std::vector<int> everyone;
    for (int r = 0; r < n; ++r) everyone.push_back(r);
    EXPECT_EQ(world.Shrink(everyone, fine).status(),
              absl::InvalidArgumentError(
                  absl::StrCat("shrink on ", where, ": every rank (", n, ") is excluded")));
    STRATA_EXPECT_OK(world.AsyncError());  // misuse breaks nothing
  });
}

// ---- every collective and dtype against the reference ------------------------

std::vector<size_t> Sizes(size_t large) { return {0, 1, 1023, large}; }

// The large size runs for every dtype with sum and for fp32 with every op.
bool RunSize(size_t n, size_t large, ReduceOp op, DataType t) {
  return n < large || op == ReduceOp::kSum || t == DataType::kFloat32;
}

TEST_P(Conformance, AllReduceMatchesTheReference) {
  OnEveryRank([&](Communicator& world) {
    const int rank = world.rank(), size = world.size();
    for (DataType t : kTestedDataTypes) {
      for (ReduceOp op : kAllReduceOps) {
        if (!Valid(op, t)) continue;
        for (size_t n : Sizes(large())) {
          if (!RunSize(n, large(), op, t)) continue;
          for (bool in_place : {false, true}) {
            SCOPED_TRACE(Case("allreduce", t, n, ReduceOpName(op)) + (in_place ? " in-place" : ""));
            Tensor send(memory(), t, n), recv(memory(), t, n);
            for (size_t i = 0; i < n; ++i) send.Set(i, InputValue(rank, size, i, op, t));
            send.Upload();
            Tensor& out = in_place ? send : recv;
            STRATA_ASSERT_OK_AND_ASSIGN(auto work,
                                        world.AllReduce(send.buffer(), out.buffer(), op));
            STRATA_ASSERT_OK(Wait(*work));
            out.Download();
            EXPECT_TRUE(AllEqual(
                n, [&](size_t i) { return out.Get(i); },
                [&](size_t i) { return Reference(size, i, op, t); }));
          }
        }
      }
    }
  });
}

TEST_P(Conformance, BroadcastMatchesTheReference) {
  OnEveryRank([&](Communicator& world) {
    const int rank = world.rank(), size = world.size();
    for (DataType t : kAllDataTypes) {
      for (size_t n : Sizes(large())) {
        for (int root : {0, size - 1}) {
          SCOPED_TRACE(Case("broadcast", t, n) + "root " + std::to_string(root));
          Tensor buf(memory(), t, n);
          for (size_t i = 0; i < n; ++i) buf.Set(i, MoveValue(rank, i, t));
          buf.Upload();
          STRATA_ASSERT_OK_AND_ASSIGN(auto work, world.Broadcast(buf.buffer(), root));
          STRATA_ASSERT_OK(Wait(*work));
          buf.Download();
          EXPECT_TRUE(AllEqual(
              n, [&](size_t i) { return buf.Get(i); },
              [&](size_t i) { return Moved(root, i, t); }));
        }
      }
    }
  });
}

TEST_P(Conformance, ReduceMatchesTheReference) {
  OnEveryRank([&](Communicator& world) {
    const int rank = world.rank(), size = world.size();
    for (DataType t : kTestedDataTypes) {
      for (ReduceOp op : kAllReduceOps) {
        if (!Valid(op, t)) continue;
        for (size_t n : Sizes(large())) {
          if (!RunSize(n, large(), op, t)) continue;
          for (int root : {0, size - 1}) {
            for (bool in_place : {false, true}) {
              SCOPED_TRACE(Case("reduce", t, n, ReduceOpName(op)) + " root " +
                           std::to_string(root) + (in_place ? " in-place" : ""));
              Tensor send(memory(), t, n), recv(memory(), t, n);
              for (size_t i = 0; i < n; ++i) send.Set(i, InputValue(rank, size, i, op, t));
              send.Upload();
              Tensor& out = in_place ? send : recv;
              STRATA_ASSERT_OK_AND_ASSIGN(auto work,
                                          world.Reduce(send.buffer(), out.buffer(), op, root));
              STRATA_ASSERT_OK(Wait(*work));
              if (rank != root) continue;
              out.Download();
              EXPECT_TRUE(AllEqual(
                  n, [&](size_t i) { return out.Get(i); },
                  [&](size_t i) { return Reference(size, i, op, t); }));
            }
          }
        }
      }
    }
  });
}

TEST_P(Conformance, AllGatherMatchesTheReference) {
  OnEveryRank([&](Communicator& world) {
    const int rank = world.rank(), size = world.size();
    for (DataType t : kAllDataTypes) {
      for (size_t n : Sizes(large())) {
        if (n == large() && size > 4) n = large() / 4;  // 8 x 1 M per rank is heavy
        for (bool in_place : {false, true}) {
          SCOPED_TRACE(Case("allgather", t, n) + (in_place ? " in-place" : ""));
          Tensor send(memory(), t, n), recv(memory(), t, n * size);
          Tensor& src = in_place ? recv : send;
          const size_t base = in_place ? n * rank : 0;
          for (size_t i = 0; i < n; ++i) src.Set(base + i, MoveValue(rank, i, t));
          src.Upload();
          Buffer in = in_place ? recv.slice(n * rank, n) : send.buffer();
          STRATA_ASSERT_OK_AND_ASSIGN(auto work, world.AllGather(in, recv.buffer()));
          STRATA_ASSERT_OK(Wait(*work));
          recv.Download();
          EXPECT_TRUE(AllEqual(
              n * size, [&](size_t i) { return recv.Get(i); },
              [&](size_t i) { return Moved(static_cast<int>(i / n), i % n, t); }));
        }
      }
    }
  });
}

TEST_P(Conformance, ReduceScatterMatchesTheReference) {
  OnEveryRank([&](Communicator& world) {
    const int rank = world.rank(), size = world.size();
    for (DataType t : kTestedDataTypes) {
      for (ReduceOp op : kAllReduceOps) {
        if (!Valid(op, t)) continue;
        for (size_t n : Sizes(large())) {  // elements per rank
          if (!RunSize(n, large(), op, t)) continue;
          if (n == large() && size > 4) n = large() / 4;
          for (bool in_place : {false, true}) {
            SCOPED_TRACE(Case("reduce_scatter", t, n, ReduceOpName(op)) +
                         (in_place ? " in-place" : ""));
            const size_t total = n * size;
            Tensor send(memory(), t, total), recv(memory(), t, n);
            for (size_t i = 0; i < total; ++i) send.Set(i, InputValue(rank, size, i, op, t));
            send.Upload();
            Buffer out = in_place ? send.slice(0, n) : recv.buffer();
            STRATA_ASSERT_OK_AND_ASSIGN(auto work, world.ReduceScatter(send.buffer(), out, op));
            STRATA_ASSERT_OK(Wait(*work));
            Tensor& result = in_place ? send : recv;
            result.Download();
            EXPECT_TRUE(AllEqual(
                n, [&](size_t i) { return result.Get(i); },
                [&](size_t i) { return Reference(size, n * rank + i, op, t); }));
          }
        }
      }
    }
  });
}

TEST_P(Conformance, AllToAllMatchesTheReference) {
  OnEveryRank([&](Communicator& world) {
    const int rank = world.rank(), size = world.size();
    for (DataType t : kAllDataTypes) {
      for (size_t n : Sizes(large())) {  // elements per block
        if (n == large() && size > 4) n = large() / 8;
        for (bool in_place : {false, true}) {
          SCOPED_TRACE(Case("all_to_all", t, n) + (in_place ? " in-place" : ""));
          const size_t total = n * size;
          Tensor send(memory(), t, total), recv(memory(), t, total);
          // Block j of rank r holds MoveValue(r * size + j, i).
          for (int j = 0; j < size; ++j) {
            for (size_t i = 0; i < n; ++i) send.Set(j * n + i, MoveValue(rank * size + j, i, t));
          }
          send.Upload();
          Tensor& out = in_place ? send : recv;
          STRATA_ASSERT_OK_AND_ASSIGN(auto work, world.AllToAll(send.buffer(), out.buffer()));
          STRATA_ASSERT_OK(Wait(*work));
          out.Download();
          EXPECT_TRUE(AllEqual(
              n * size, [&](size_t i) { return out.Get(i); },
              [&](size_t i) { return Moved(static_cast<int>(i / n) * size + rank, i % n, t); }));
        }
      }
    }
  });
}

// Variable splits: rank r sends (r + 2 * j) % 3 * unit elements to rank j
// (some blocks empty). In place needs symmetric counts: (r + j) % 3 * unit.
TEST_P(Conformance, AllToAllVMatchesTheReference) {
  OnEveryRank([&](Communicator& world) {
    const int rank = world.rank(), size = world.size();
    for (DataType t : kAllDataTypes) {
      for (size_t unit : {size_t{0}, size_t{1}, size_t{341}}) {
        for (bool in_place : {false, true}) {
          SCOPED_TRACE(Case("all_to_all_v", t, unit) + (in_place ? " in-place" : ""));
          auto count = [&](int from, int to) {
            const int k = in_place ? (from + to) % 3 : (from + 2 * to) % 3;
            return static_cast<size_t>(k) * unit;
          };
          AllToAllCounts counts;
          size_t send_total = 0, recv_total = 0;
          for (int j = 0; j < size; ++j) {
            counts.send_counts.push_back(count(rank, j));
            counts.recv_counts.push_back(count(j, rank));
            send_total += count(rank, j);
            recv_total += count(j, rank);
          }
          Tensor send(memory(), t, send_total), recv(memory(), t, recv_total);
          size_t off = 0;
          for (int j = 0; j < size; ++j) {
            for (size_t i = 0; i < count(rank, j); ++i) {
              send.Set(off++, MoveValue(rank * size + j, i, t));
            }
          }
          send.Upload();
          Tensor& out = in_place ? send : recv;
          STRATA_ASSERT_OK_AND_ASSIGN(auto work,
                                      world.AllToAllV(send.buffer(), out.buffer(), counts));
          STRATA_ASSERT_OK(Wait(*work));
          out.Download();
          std::vector<double> want;
          for (int j = 0; j < size; ++j) {
            for (size_t i = 0; i < count(j, rank); ++i) {
              want.push_back(Moved(j * size + rank, i, t));
            }
          }
          EXPECT_TRUE(AllEqual(
              want.size(), [&](size_t i) { return out.Get(i); },
              [&](size_t i) { return want[i]; }));
        }
      }
    }
  });
}

// Send to the next rank and receive from the previous one, then the other
// way round, all started before any wait.
TEST_P(Conformance, SendRecvRingsBothDirections) {
  OnEveryRank([&](Communicator& world) {
    const int rank = world.rank(), size = world.size();
    if (size == 1 && !world.progresses_independently()) {
      GTEST_SKIP() << world.backend() << " runs a rank's operations in issue order: a send to "
                   << "itself would wait for a receive queued behind it";
    }
    for (DataType t : kAllDataTypes) {
      for (size_t n : {size_t{0}, size_t{1}, size_t{1023}, size_t{1} << 16}) {
        SCOPED_TRACE(Case("send/recv ring", t, n));
        const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
        Tensor out(memory(), t, n), from_prev(memory(), t, n), from_next(memory(), t, n);
        for (size_t i = 0; i < n; ++i) out.Set(i, MoveValue(rank, i, t));
        out.Upload();
        std::vector<std::unique_ptr<Work>> works;
        STRATA_ASSERT_OK(Exchange(world, out.buffer(), next, from_prev.buffer(), prev, &works));
        if (!world.progresses_independently()) {
          for (auto& w : works) STRATA_ASSERT_OK(Wait(*w));
        }
        STRATA_ASSERT_OK(Exchange(world, out.buffer(), prev, from_next.buffer(), next, &works));
        for (auto& w : works) STRATA_ASSERT_OK(Wait(*w));
        from_prev.Download();
        from_next.Download();
        EXPECT_TRUE(AllEqual(
            n, [&](size_t i) { return from_prev.Get(i); },
            [&](size_t i) { return Moved(prev, i, t); }));
        EXPECT_TRUE(AllEqual(
            n, [&](size_t i) { return from_next.Get(i); },
            [&](size_t i) { return Moved(next, i, t); }));
      }
    }
  });
}

TEST_P(Conformance, BarrierAndDescribe) {
  OnEveryRank([&](Communicator& world) {
    STRATA_ASSERT_OK_AND_ASSIGN(auto work, world.Barrier());
    STRATA_ASSERT_OK(Wait(*work));
    EXPECT_EQ(work->Describe(), "barrier() on " + Where(world));
    EXPECT_EQ(work->Test().value_or(false), true);
    STRATA_EXPECT_OK(work->Wait());  // idempotent after completion
    Tensor x(memory(), DataType::kFloat32, 4);
    x.Upload();
    STRATA_ASSERT_OK_AND_ASSIGN(auto sum, world.AllReduce(x.buffer(), x.buffer(), ReduceOp::kSum));
    EXPECT_EQ(sum->Describe(), "allreduce(sum, 4 x fp32) on " + Where(world));
    STRATA_EXPECT_OK(Wait(*sum));
  });
}

// ---- asynchronous work and deadlines ----------------------------------------

// Operations on three communicators at once, waited for in reverse order.
TEST_P(Conformance, SeveralOperationsInFlightOnDifferentGroups) {
  OnEveryRank([&](Communicator& world) {
    const int rank = world.rank(), size = world.size();
    CommOptions options;
    options.name = "pairs";
    STRATA_ASSERT_OK_AND_ASSIGN(auto pairs, world.Split(rank / 2, rank, options));
    options.name = "copy";
    STRATA_ASSERT_OK_AND_ASSIGN(auto copy, world.Split(0, rank, options));
    const size_t n = 1 << 14;
    Tensor a(memory(), DataType::kFloat32, n), b(memory(), DataType::kFloat32, n),
        c(memory(), DataType::kFloat32, n), me(memory(), DataType::kInt64, 1),
        ids(memory(), DataType::kInt64, size);
    me.Set(0, rank);
    me.Upload();
    for (int round = 0; round < 3; ++round) {
      for (size_t i = 0; i < n; ++i) {
        a.Set(i, 1);
        b.Set(i, rank);
        c.Set(i, 2);
      }
      a.Upload();
      b.Upload();
      c.Upload();
      std::vector<std::unique_ptr<Work>> works;
      STRATA_ASSERT_OK_AND_ASSIGN(auto w1, world.AllReduce(a.buffer(), a.buffer(), ReduceOp::kSum));
      STRATA_ASSERT_OK_AND_ASSIGN(auto w2,
                                  pairs->AllReduce(b.buffer(), b.buffer(), ReduceOp::kMax));
      STRATA_ASSERT_OK_AND_ASSIGN(auto w3,
                                  copy->AllReduce(c.buffer(), c.buffer(), ReduceOp::kProd));
      STRATA_ASSERT_OK_AND_ASSIGN(auto w4, copy->AllGather(me.buffer(), ids.buffer()));
      works.push_back(std::move(w1));
      works.push_back(std::move(w2));
      works.push_back(std::move(w3));
      works.push_back(std::move(w4));
      for (auto it = works.rbegin(); it != works.rend(); ++it) STRATA_ASSERT_OK(Wait(**it));
      a.Download();
      b.Download();
      c.Download();
      ids.Download();
      const double pair_max = std::min(rank / 2 * 2 + 1, size - 1);
      for (size_t i = 0; i < n; i += 4097) {
        EXPECT_EQ(a.Get(i), size);
        EXPECT_EQ(b.Get(i), pair_max);
        EXPECT_EQ(c.Get(i), std::pow(2.0, size));
      }
      for (int r = 0; r < size; ++r) EXPECT_EQ(ids.Get(r), r);
    }
    AllHere(world);
  });
}

// Operations of one communicator complete in the order they were issued:
// once a later one is done, every earlier one is done too.
TEST_P(Conformance, CompletesInIssueOrder) {
  OnEveryRank([&](Communicator& world) {
    auto comm = Fresh(world, "ordered");
    ASSERT_NE(comm, nullptr);
    const size_t big = large();
    Tensor x(memory(), DataType::kFloat32, big), one(memory(), DataType::kInt32, 1),
        small(memory(), DataType::kInt32, comm->size());
    for (size_t i = 0; i < big; ++i) x.Set(i, 1);
    x.Upload();
    one.Upload();
    for (int round = 0; round < 5; ++round) {
      STRATA_ASSERT_OK_AND_ASSIGN(auto first,
                                  comm->AllReduce(x.buffer(), x.buffer(), ReduceOp::kMax));
      STRATA_ASSERT_OK_AND_ASSIGN(auto second, comm->AllGather(one.buffer(), small.buffer()));
      STRATA_ASSERT_OK_AND_ASSIGN(auto third, comm->Barrier());
      STRATA_ASSERT_OK(Wait(*third));
      EXPECT_EQ(second->Test().value_or(false), true);
      EXPECT_EQ(first->Test().value_or(false), true);
    }
    AllHere(world);
  });
}

// A wait whose deadline passes says so (naming the operation, the group and
// the rank) and leaves the operation in flight; it completes when the peer
// sends.
TEST_P(Conformance, WaitDeadlineExpiresThenOperationCompletes) {
  OnEveryRank([&](Communicator& world) {
    auto comm = Fresh(world, "late");
    ASSERT_NE(comm, nullptr);
    const int last = comm->size() - 1;
    Tensor value(memory(), DataType::kInt32, 1);
    value.Set(0, comm->rank() == 0 ? 42 : -1);
    value.Upload();
    std::unique_ptr<Work> recv;
    if (comm->rank() == last) {
      STRATA_ASSERT_OK_AND_ASSIGN(recv, comm->Recv(value.buffer(), 0));
      absl::Status early = recv->Wait(absl::Now() + absl::Milliseconds(50));
      EXPECT_EQ(early.code(), absl::StatusCode::kDeadlineExceeded) << early;
      EXPECT_TRUE(absl::StartsWith(early.message(),
                                   absl::StrCat("recv(peer 0, 1 x int32) on ", Where(*comm))))
          << early;
      EXPECT_THAT(std::string(early.message()), HasSubstr("still in flight")) << early;
      EXPECT_EQ(recv->Test().value_or(true), false);
    }
    AllHere(world);  // the receive is posted and has waited: rank 0 may send
    std::unique_ptr<Work> send;
    if (comm->rank() == 0) {
      STRATA_ASSERT_OK_AND_ASSIGN(send, comm->Send(value.buffer(), last));
    }
    if (recv != nullptr) {
      STRATA_ASSERT_OK(Wait(*recv));
      value.Download();
      EXPECT_EQ(value.Get(0), 42);
    }
    if (send != nullptr) STRATA_ASSERT_OK(Wait(*send));
    AllHere(world);
  });
}

// An operation past its own timeout fails with DeadlineExceeded naming it,
// and breaks its communicator (AsyncError, later calls) without touching
// others.
TEST_P(Conformance, OperationTimeoutBreaksOnlyItsCommunicator) {
  OnEveryRank([&](Communicator& world) {
    auto comm = Fresh(world, "stuck");
    ASSERT_NE(comm, nullptr);
    if (comm->rank() == 0) {
      Tensor never(memory(), DataType::kInt32, 1);
      OpOptions options;
      options.timeout = absl::Milliseconds(200);
      const int last = comm->size() - 1;
      STRATA_ASSERT_OK_AND_ASSIGN(auto recv, comm->Recv(never.buffer(), last, options));
      absl::Status s = Wait(*recv);
      EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
      EXPECT_TRUE(absl::StartsWith(
          s.message(), absl::StrCat("recv(peer ", last, ", 1 x int32) on ", Where(*comm))))
          << s;
      EXPECT_EQ(comm->AsyncError().code(), absl::StatusCode::kDeadlineExceeded);
      auto later = comm->Barrier();
      EXPECT_EQ(later.status().code(), absl::StatusCode::kFailedPrecondition) << later.status();
      EXPECT_THAT(std::string(later.status().message()), HasSubstr("failed earlier"));
    }
    AllHere(world);
    STRATA_EXPECT_OK(world.AsyncError());
  });
}

}  // namespace
}  // namespace strata::testing
