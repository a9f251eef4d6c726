// Every collective x every dtype x sizes (0, 1, 1023, 1<<20) x every reduce
// op, in place and out of place, against references computed here (see
// typed.h). Runs on 2, 3, 4 and 8 ranks.
//
// 1<<20 elements run for every dtype with sum, and for fp32 with every op
// (enough to cover the long paths without making oversubscribed 8-rank
// runs slow); 0, 1 and 1023 run for every combination.
#include <algorithm>
#include <memory>
#include <vector>

#include "harness.h"
#include "typed.h"

namespace strata::testing {
namespace {

// Debug builds (the sanitizer builds) check memory, not speed: there the
// large size is 1<<16, so that -O0 references on 8 oversubscribed ranks
// stay within the runner's timeout.
#ifdef NDEBUG
constexpr size_t kLarge = size_t{1} << 20;
#else
constexpr size_t kLarge = size_t{1} << 16;
#endif
constexpr size_t kSizes[] = {0, 1, 1023, kLarge};

bool RunSize(size_t n, ReduceOp op, DataType t) {
  if (n < kLarge) return true;
  return op == ReduceOp::kSum || t == DataType::kFloat32;
}

bool Valid(ReduceOp op, DataType t) { return !(op == ReduceOp::kAvg && IsInteger(t)); }

class CollectivesTest : public MultiRankTest {};

TEST_F(CollectivesTest, AllReduce) {
  for (DataType t : kTestedDataTypes) {
    for (ReduceOp op : kAllReduceOps) {
      if (!Valid(op, t)) continue;
      for (size_t n : kSizes) {
        if (!RunSize(n, op, t)) continue;
        for (bool in_place : {false, true}) {
          SCOPED_TRACE(Case("allreduce", t, n, ReduceOpName(op)) + (in_place ? " in-place" : ""));
          TypedBuffer send(t, n), recv(t, n);
          for (size_t i = 0; i < n; ++i) send.Set(i, InputValue(rank(), size(), i, op, t));
          TypedBuffer& out = in_place ? send : recv;
          STRATA_ASSERT_OK_AND_ASSIGN(auto work,
                                      world().AllReduce(send.buffer(), out.buffer(), op));
          STRATA_ASSERT_OK(Wait(*work));
          EXPECT_TRUE(AllEqual(
              n, [&](size_t i) { return out.Get(i); },
              [&](size_t i) { return Reference(size(), i, op, t); }));
        }
      }
    }
  }
}

TEST_F(CollectivesTest, Broadcast) {
  for (DataType t : kTestedDataTypes) {
    for (size_t n : kSizes) {
      for (int root : {0, size() - 1}) {
        SCOPED_TRACE(Case("broadcast", t, n) + "root " + std::to_string(root));
        TypedBuffer buf(t, n);
        for (size_t i = 0; i < n; ++i) buf.Set(i, MoveValue(rank(), i, t));
        STRATA_ASSERT_OK_AND_ASSIGN(auto work, world().Broadcast(buf.buffer(), root));
        STRATA_ASSERT_OK(Wait(*work));
        EXPECT_TRUE(AllEqual(
            n, [&](size_t i) { return buf.Get(i); },
            [&](size_t i) { return MoveValue(root, i, t); }));
      }
    }
  }
}

TEST_F(CollectivesTest, Reduce) {
  for (DataType t : kTestedDataTypes) {
    for (ReduceOp op : kAllReduceOps) {
      if (!Valid(op, t)) continue;
      for (size_t n : kSizes) {
        if (!RunSize(n, op, t)) continue;
        for (int root : {0, size() - 1}) {
          for (bool in_place : {false, true}) {
            SCOPED_TRACE(Case("reduce", t, n, ReduceOpName(op)) + " root " + std::to_string(root) +
                         (in_place ? " in-place" : ""));
            TypedBuffer send(t, n), recv(t, n);
            for (size_t i = 0; i < n; ++i) send.Set(i, InputValue(rank(), size(), i, op, t));
            TypedBuffer& out = in_place ? send : recv;
            STRATA_ASSERT_OK_AND_ASSIGN(auto work,
                                        world().Reduce(send.buffer(), out.buffer(), op, root));
            STRATA_ASSERT_OK(Wait(*work));
            if (rank() != root) continue;
            EXPECT_TRUE(AllEqual(
                n, [&](size_t i) { return out.Get(i); },
                [&](size_t i) { return Reference(size(), i, op, t); }));
          }
        }
      }
    }
  }
}

TEST_F(CollectivesTest, AllGather) {
  for (DataType t : kTestedDataTypes) {
    for (size_t n : kSizes) {
      if (n == kLarge && size() > 4) n = kLarge / 4;  // 8 x 1 M per rank is heavy
      for (bool in_place : {false, true}) {
        SCOPED_TRACE(Case("allgather", t, n) + (in_place ? " in-place" : ""));
        TypedBuffer send(t, n), recv(t, n * size());
        Buffer in = in_place ? recv.slice(n * rank(), n) : send.buffer();
        TypedBuffer& src = in_place ? recv : send;
        const size_t base = in_place ? n * rank() : 0;
        for (size_t i = 0; i < n; ++i) src.Set(base + i, MoveValue(rank(), i, t));
        STRATA_ASSERT_OK_AND_ASSIGN(auto work, world().AllGather(in, recv.buffer()));
        STRATA_ASSERT_OK(Wait(*work));
        EXPECT_TRUE(AllEqual(
            n * size(), [&](size_t i) { return recv.Get(i); },
            [&](size_t i) { return MoveValue(static_cast<int>(i / n), i % n, t); }));
      }
    }
  }
}

TEST_F(CollectivesTest, ReduceScatter) {
  for (DataType t : kTestedDataTypes) {
    for (ReduceOp op : kAllReduceOps) {
      if (!Valid(op, t)) continue;
      for (size_t n : kSizes) {  // elements per rank
        if (!RunSize(n, op, t)) continue;
        if (n == kLarge && size() > 4) n = kLarge / 4;
        for (bool in_place : {false, true}) {
          SCOPED_TRACE(Case("reduce_scatter", t, n, ReduceOpName(op)) +
                       (in_place ? " in-place" : ""));
          const size_t total = n * size();
          TypedBuffer send(t, total), recv(t, n);
          for (size_t i = 0; i < total; ++i) send.Set(i, InputValue(rank(), size(), i, op, t));
          Buffer out = in_place ? send.slice(0, n) : recv.buffer();
          STRATA_ASSERT_OK_AND_ASSIGN(auto work, world().ReduceScatter(send.buffer(), out, op));
          STRATA_ASSERT_OK(Wait(*work));
          TypedBuffer& result = in_place ? send : recv;
          EXPECT_TRUE(AllEqual(
              n, [&](size_t i) { return result.Get(i); },
              [&](size_t i) { return Reference(size(), n * rank() + i, op, t); }));
        }
      }
    }
  }
}

TEST_F(CollectivesTest, AllToAll) {
  for (DataType t : kTestedDataTypes) {
    for (size_t n : kSizes) {  // elements per block
      if (n == kLarge && size() > 4) n = kLarge / 8;
      for (bool in_place : {false, true}) {
        SCOPED_TRACE(Case("all_to_all", t, n) + (in_place ? " in-place" : ""));
        const size_t total = n * size();
        TypedBuffer send(t, total), recv(t, total);
        // Block j of rank r holds MoveValue(r * size + j, i).
        for (int j = 0; j < size(); ++j) {
          for (size_t i = 0; i < n; ++i) send.Set(j * n + i, MoveValue(rank() * size() + j, i, t));
        }
        TypedBuffer& out = in_place ? send : recv;
        STRATA_ASSERT_OK_AND_ASSIGN(auto work, world().AllToAll(send.buffer(), out.buffer()));
        STRATA_ASSERT_OK(Wait(*work));
        EXPECT_TRUE(AllEqual(
            n * size(), [&](size_t i) { return out.Get(i); },
            [&](size_t i) {
              return MoveValue(static_cast<int>(i / n) * size() + rank(), i % n, t);
            }));
      }
    }
  }
}

// Variable splits: rank r sends (r + 2 * j) % 3 * unit elements to rank j
// (some blocks empty). In place needs symmetric counts: (r + j) % 3 * unit.
TEST_F(CollectivesTest, AllToAllV) {
  for (DataType t : kTestedDataTypes) {
    for (size_t unit : {size_t{0}, size_t{1}, size_t{341}}) {
      for (bool in_place : {false, true}) {
        SCOPED_TRACE(Case("all_to_all_v", t, unit) + (in_place ? " in-place" : ""));
        auto count = [&](int from, int to) {
          const int k = in_place ? (from + to) % 3 : (from + 2 * to) % 3;
          return static_cast<size_t>(k) * unit;
        };
        AllToAllCounts counts;
        size_t send_total = 0, recv_total = 0;
        for (int j = 0; j < size(); ++j) {
          counts.send_counts.push_back(count(rank(), j));
          counts.recv_counts.push_back(count(j, rank()));
          send_total += count(rank(), j);
          recv_total += count(j, rank());
        }
        TypedBuffer send(t, send_total), recv(t, recv_total);
        size_t off = 0;
        for (int j = 0; j < size(); ++j) {
          for (size_t i = 0; i < count(rank(), j); ++i) {
            send.Set(off++, MoveValue(rank() * size() + j, i, t));
          }
        }
        TypedBuffer& out = in_place ? send : recv;
        STRATA_ASSERT_OK_AND_ASSIGN(auto work,
                                    world().AllToAllV(send.buffer(), out.buffer(), counts));
        STRATA_ASSERT_OK(Wait(*work));
        std::vector<double> want;
        for (int j = 0; j < size(); ++j) {
          for (size_t i = 0; i < count(j, rank()); ++i)
            want.push_back(MoveValue(j * size() + rank(), i, t));
        }
        EXPECT_TRUE(AllEqual(
            want.size(), [&](size_t i) { return out.Get(i); }, [&](size_t i) { return want[i]; }));
      }
    }
  }
}

// Send to the next rank and receive from the previous one, then the other
// way round, all started before any wait: no deadlock in either direction.
TEST_F(CollectivesTest, SendRecvRingsBothDirections) {
  for (DataType t : kTestedDataTypes) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{1023}, size_t{1} << 16}) {
      SCOPED_TRACE(Case("send/recv ring", t, n));
      const int next = (rank() + 1) % size(), prev = (rank() + size() - 1) % size();
      TypedBuffer out(t, n), from_prev(t, n), from_next(t, n);
      for (size_t i = 0; i < n; ++i) out.Set(i, MoveValue(rank(), i, t));
      std::vector<std::unique_ptr<Work>> works;
      for (auto [to, from, buf] :
           {std::tuple{next, prev, &from_prev}, std::tuple{prev, next, &from_next}}) {
        STRATA_ASSERT_OK_AND_ASSIGN(auto r, world().Recv(buf->buffer(), from));
        STRATA_ASSERT_OK_AND_ASSIGN(auto s, world().Send(out.buffer(), to));
        works.push_back(std::move(r));
        works.push_back(std::move(s));
      }
      for (auto& w : works) STRATA_ASSERT_OK(Wait(*w));
      EXPECT_TRUE(AllEqual(
          n, [&](size_t i) { return from_prev.Get(i); },
          [&](size_t i) { return MoveValue(prev, i, t); }));
      EXPECT_TRUE(AllEqual(
          n, [&](size_t i) { return from_next.Get(i); },
          [&](size_t i) { return MoveValue(next, i, t); }));
    }
  }
}

TEST_F(CollectivesTest, BarrierAndDescribe) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto work, world().Barrier());
  STRATA_ASSERT_OK(Wait(*work));
  EXPECT_EQ(work->Describe(), "barrier() on group world (rank " + std::to_string(rank()) + " of " +
                                  std::to_string(size()) + ", world rank " +
                                  std::to_string(rank()) + ")");
  EXPECT_EQ(work->Test().value_or(false), true);
  STRATA_EXPECT_OK(work->Wait());  // idempotent after completion
}

}  // namespace
}  // namespace strata::testing
