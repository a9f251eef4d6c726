// The conformance suite (conformance.h), continued: the records of
// operations a sink receives. See suite.cc.
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

// ---- recording ----------------------------------------------------------------

using observe::OpKind;
using observe::OpRecord;
using observe::OpState;

// Every operation is recorded once scheduled and once completed (started
// in between where the backend can tell), numbered per communicator:
// collectives and point-to-point operations separately, from 1, as
// PyTorch's flight recorder numbers them; children inherit the sink.
TEST_P(Conformance, RecordsEveryOperationWithItsSequenceNumbers) {
  OnEveryRank([&](Communicator& world) {
    auto sink = std::make_shared<RecordingSink>();
    auto comm = Fresh(world, "watched", sink);
    ASSERT_NE(comm, nullptr);
    EXPECT_EQ(comm->sink(), sink);
    const int rank = comm->rank(), size = comm->size();
    const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
    Tensor x(memory(), DataType::kFloat32, 6), y(memory(), DataType::kFloat32, 6 * size);
    x.Upload();
    std::vector<std::unique_ptr<Work>> works;
    auto add = [&](absl::StatusOr<std::unique_ptr<Work>> w) {
      ASSERT_TRUE(w.ok()) << w.status();
      works.push_back(std::move(w).value());
    };
    add(comm->AllReduce(x.buffer(), x.buffer(), ReduceOp::kMax));  // collective 1
    add(comm->Broadcast(x.buffer(), size - 1));                    // collective 2
    const bool p2p = size > 1 || comm->progresses_independently();
    if (p2p) {
      for (auto& w : works) STRATA_ASSERT_OK(Wait(*w));
      std::vector<std::unique_ptr<Work>> ring;  // p2p 1 and 2
      STRATA_ASSERT_OK(Exchange(*comm, x.slice(0, 2), next, x.slice(2, 2), prev, &ring));
      for (auto& w : ring) works.push_back(std::move(w));
    }
    // Its own input: the ring above may still be receiving into x.
    Tensor g(memory(), DataType::kFloat32, 6);
    g.Upload();
    add(comm->AllGather(g.buffer(), y.buffer()));  // collective 3
    add(comm->Barrier());                          // collective 4
    for (auto& w : works) STRATA_ASSERT_OK(Wait(*w));
    // A child without a sink of its own records into its parent's.
    CommOptions child_options;
    child_options.name = "watched-child";
    STRATA_ASSERT_OK_AND_ASSIGN(auto child, comm->Split(0, rank, child_options));  // collective 5
    ASSERT_NE(child, nullptr);
    EXPECT_EQ(child->sink(), sink);
    STRATA_ASSERT_OK_AND_ASSIGN(auto cw, child->AllReduce(x.buffer(), x.buffer(), ReduceOp::kSum));
    STRATA_ASSERT_OK(Wait(*cw));

    std::vector<OpRecord> mine, childs;
    for (const OpRecord& r : sink->records()) {
      ASSERT_NE(r.comm, nullptr);
      (r.comm->name == "watched" ? mine : childs).push_back(r);
    }
    // The parent's own operations: the collectives 1..5 in issue order, the
    // sends and receives 1..2, each completed successfully.
    std::vector<OpKind> kinds;
    uint64_t collective = 0, p2p_seen = 0, last_op = 0;
    for (const OpRecord& r : mine) {
      SCOPED_TRACE(observe::ProfilingName(r));
      kinds.push_back(r.kind);
      EXPECT_EQ(r.comm->backend, std::string(comm->backend()));
      EXPECT_EQ(r.comm->rank, rank);
      EXPECT_EQ(r.comm->size, size);
      EXPECT_EQ(r.comm->world_rank, world.world_rank());
      EXPECT_EQ(r.state, OpState::kCompleted);
      STRATA_EXPECT_OK(r.status);
      EXPECT_GT(r.op_id, last_op);
      last_op = r.op_id;
      EXPECT_GT(r.time_created_ns, 0);
      EXPECT_GE(r.time_completed_ns, r.time_created_ns);
      if (r.time_started_ns != 0) {
        EXPECT_GE(r.time_started_ns, r.time_created_ns);
        EXPECT_LE(r.time_started_ns, r.time_completed_ns);
      }
      if (observe::IsPointToPoint(r.kind)) {
        EXPECT_EQ(r.p2p_seq_id, ++p2p_seen);
        EXPECT_EQ(r.collective_seq_id, collective);
        EXPECT_EQ(r.peer, r.kind == OpKind::kSend ? next : prev);
        EXPECT_EQ(r.kind == OpKind::kSend ? r.input_count : r.output_count, 2u);
      } else {
        EXPECT_EQ(r.collective_seq_id, ++collective);
        EXPECT_EQ(r.p2p_seq_id, p2p_seen);
      }
      // A split is bounded by the new communicator's timeout.
      const absl::Duration limit =
          r.kind == OpKind::kSplit ? child_options.timeout : comm->timeout();
      EXPECT_EQ(r.timeout_ms, absl::ToInt64Milliseconds(limit)) << observe::OpKindName(r.kind);
    }
    EXPECT_EQ(kinds.size(), p2p ? 7u : 5u);
    // Collectives in order; the two p2p operations in the order posted.
    std::vector<OpKind> collectives_only;
    for (OpKind k : kinds) {
      if (!observe::IsPointToPoint(k)) collectives_only.push_back(k);
    }
    EXPECT_EQ(collectives_only,
              (std::vector<OpKind>{OpKind::kAllReduce, OpKind::kBroadcast, OpKind::kAllGather,
                                   OpKind::kBarrier, OpKind::kSplit}));
    // What the records say about each operation.
    ASSERT_GE(mine.size(), 2u);
    EXPECT_EQ(observe::ProfilingName(mine[0]), absl::StrCat(comm->backend(), ":all_reduce"));
    EXPECT_EQ(mine[0].input_count, 6u);
    EXPECT_EQ(mine[0].output_count, 6u);
    EXPECT_EQ(mine[0].dtype, DataType::kFloat32);
    EXPECT_STREQ(mine[0].reduce_op, "max");
    EXPECT_EQ(mine[1].root, size - 1);
    EXPECT_EQ(mine[1].reduce_op, nullptr);
    for (const OpRecord& r : mine) {
      if (r.kind == OpKind::kAllGather) EXPECT_EQ(r.output_count, 6u * size);
      if (r.kind == OpKind::kSend) {
        EXPECT_EQ(observe::ProfilingName(r),
                  absl::StrCat(comm->backend(), ":send ", rank, "->", next));
      }
      if (r.kind == OpKind::kRecv) {
        EXPECT_EQ(observe::ProfilingName(r),
                  absl::StrCat(comm->backend(), ":recv ", rank, "<-", prev));
      }
    }
    // The child's numbers are its own.
    ASSERT_EQ(childs.size(), 1u);
    EXPECT_EQ(childs[0].collective_seq_id, 1u);
    EXPECT_EQ(childs[0].op_id, 1u);
    EXPECT_EQ(childs[0].comm->name, "watched-child");
    // Each operation was scheduled before anything else was said of it, and
    // completed exactly once.
    std::map<std::pair<const void*, uint64_t>, std::vector<RecordingSink::Call::Kind>> seen;
    for (const RecordingSink::Call& c : sink->calls()) {
      seen[{c.record.comm.get(), c.record.op_id}].push_back(c.kind);
    }
    for (const auto& [op, calls] : seen) {
      ASSERT_FALSE(calls.empty());
      EXPECT_EQ(calls.front(), RecordingSink::Call::kScheduled);
      EXPECT_EQ(calls.back(), RecordingSink::Call::kCompleted);
      EXPECT_LE(calls.size(), 3u);
    }
    AllHere(world);
  });
}

// The end of an operation is recorded when the backend sees it, not only
// when someone waits for it: waiting for a later operation of the same
// communicator (they complete in order) leaves the earlier one recorded
// complete.
TEST_P(Conformance, RecordsCompletionsNobodyWaitsFor) {
  OnEveryRank([&](Communicator& world) {
    auto sink = std::make_shared<RecordingSink>();
    auto comm = Fresh(world, "unwaited", sink);
    ASSERT_NE(comm, nullptr);
    Tensor x(memory(), DataType::kFloat32, 1024);
    x.Upload();
    STRATA_ASSERT_OK_AND_ASSIGN(auto first,
                                comm->AllReduce(x.buffer(), x.buffer(), ReduceOp::kSum));
    STRATA_ASSERT_OK_AND_ASSIGN(auto second, comm->Barrier());
    STRATA_ASSERT_OK(Wait(*second));
    const std::vector<OpRecord> records = sink->records();
    ASSERT_EQ(records.size(), 2u);
    EXPECT_EQ(records[0].kind, OpKind::kAllReduce);
    EXPECT_EQ(records[0].state, OpState::kCompleted);
    STRATA_EXPECT_OK(records[0].status);
    EXPECT_EQ(records[1].state, OpState::kCompleted);
    first.reset();  // dropping a completed Work changes nothing
    EXPECT_EQ(sink->records().size(), 2u);
    AllHere(world);
  });
}

// The time a caller spends blocked in Work::Wait reaches the sink, once per
// call, naming the communicator and the operation (what tells a rank's
// compute time from its waiting for peers): the ranks waiting for a late
// rank report about its delay, and never more than they were blocked.
TEST_P(Conformance, ReportsTheTimeBlockedInWait) {
  OnEveryRank([&](Communicator& world) {
    auto sink = std::make_shared<RecordingSink>();
    auto comm = Fresh(world, "waited", sink);
    ASSERT_NE(comm, nullptr);
    Tensor x(memory(), DataType::kFloat32, 16);
    x.Upload();
    const absl::Duration delay = absl::Milliseconds(200);
    if (comm->rank() == 0) absl::SleepFor(delay);
    STRATA_ASSERT_OK_AND_ASSIGN(auto work, comm->AllReduce(x.buffer(), x.buffer(), ReduceOp::kSum));
    const absl::Time start = absl::Now();
    STRATA_ASSERT_OK(Wait(*work));
    const int64_t blocked = absl::ToInt64Nanoseconds(absl::Now() - start);
    std::vector<RecordingSink::Waited> waits = sink->waits();
    ASSERT_EQ(waits.size(), 1u);
    EXPECT_EQ(waits[0].group, "waited");
    EXPECT_EQ(waits[0].kind, OpKind::kAllReduce);
    EXPECT_GE(waits[0].ns, 0);
    EXPECT_LE(waits[0].ns, blocked);
    if (comm->rank() != 0) EXPECT_GE(waits[0].ns, absl::ToInt64Nanoseconds(delay) / 2);
    STRATA_ASSERT_OK(Wait(*work));  // again, on a completed operation: reported again
    EXPECT_EQ(sink->waits().size(), 2u);
    AllHere(world);
  });
}

// A failed operation is recorded with its error; an operation refused as
// misuse is not an operation and is not recorded; a call on a broken
// communicator is recorded with the reason.
TEST_P(Conformance, RecordsFailuresButNotMisuse) {
  OnEveryRank([&](Communicator& world) {
    auto sink = std::make_shared<RecordingSink>();
    auto comm = Fresh(world, "failing", sink);
    ASSERT_NE(comm, nullptr);
    Tensor x(memory(), DataType::kInt32, 4);
    x.Upload();
    EXPECT_FALSE(comm->AllReduce(x.buffer(), x.buffer(), ReduceOp::kAvg).ok());  // misuse
    EXPECT_FALSE(comm->Send(x.buffer(), comm->size()).ok());                     // misuse
    EXPECT_TRUE(sink->records().empty());
    if (comm->rank() == 0) {
      OpOptions quick;
      quick.timeout = absl::Milliseconds(100);
      STRATA_ASSERT_OK_AND_ASSIGN(auto never, comm->Recv(x.slice(0, 1), comm->size() - 1, quick));
      EXPECT_EQ(Wait(*never).code(), absl::StatusCode::kDeadlineExceeded);
      EXPECT_FALSE(comm->Barrier().ok());  // broken now
      const std::vector<OpRecord> records = sink->records();
      ASSERT_EQ(records.size(), 2u);
      EXPECT_EQ(records[0].kind, OpKind::kRecv);
      EXPECT_EQ(records[0].timeout_ms, 100);
      EXPECT_EQ(records[0].state, OpState::kCompleted);
      EXPECT_EQ(records[0].status.code(), absl::StatusCode::kDeadlineExceeded);
      EXPECT_EQ(records[1].kind, OpKind::kBarrier);
      EXPECT_EQ(records[1].status.code(), absl::StatusCode::kFailedPrecondition);
    }
    AllHere(world);
  });
}

}  // namespace
}  // namespace strata::testing
