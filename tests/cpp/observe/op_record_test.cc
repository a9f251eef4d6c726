// Records and traces of communication operations, in one process: the
// names PyTorch's flight recorder reads, and the life of an OpTrace (each
// state reported once and in order, whatever thread reports it, and an
// operation dropped unfinished still reported completed).
#include "strata/observe/op_record.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <thread>
#include <vector>

namespace strata::observe {
namespace {

using ::testing::HasSubstr;

struct Seen {
  OpState state;
  OpRecord record;
};

class ListSink : public OpSink {
 public:
  void OnScheduled(const OpRecord& r) override { Add(r); }
  void OnStarted(const OpRecord& r) override { Add(r); }
  void OnCompleted(const OpRecord& r) override { Add(r); }
  std::vector<Seen> seen() const {
    std::lock_guard<std::mutex> lock(mu_);
    return seen_;
  }

 private:
  void Add(const OpRecord& r) {
    std::lock_guard<std::mutex> lock(mu_);
    seen_.push_back(Seen{r.state, r});
  }
  mutable std::mutex mu_;
  std::vector<Seen> seen_;
};

OpRecord Record(OpKind kind, int peer = -1) {
  auto comm = std::make_shared<CommRecord>();
  comm->backend = "nccl";
  comm->name = "tp";
  comm->rank = 1;
  comm->size = 4;
  comm->world_rank = 5;
  OpRecord r;
  r.comm = comm;
  r.kind = kind;
  r.peer = peer;
  r.op_id = 7;
  r.time_created_ns = 100;
  return r;
}

TEST(OpRecord, NamesAreTheFlightRecordersNames) {
  EXPECT_STREQ(OpKindName(OpKind::kAllReduce), "all_reduce");
  EXPECT_STREQ(OpKindName(OpKind::kAllGather), "all_gather");
  EXPECT_STREQ(OpKindName(OpKind::kReduceScatter), "reduce_scatter");
  EXPECT_STREQ(OpKindName(OpKind::kAllToAll), "all_to_all");
  EXPECT_STREQ(OpKindName(OpKind::kAllToAllV), "all_to_all");
  EXPECT_STREQ(OpKindName(OpKind::kBarrier), "barrier");
  EXPECT_EQ(ProfilingName(Record(OpKind::kAllReduce)), "nccl:all_reduce");
  EXPECT_EQ(ProfilingName(Record(OpKind::kSend, 3)), "nccl:send 1->3");
  EXPECT_EQ(ProfilingName(Record(OpKind::kRecv, 0)), "nccl:recv 1<-0");
  EXPECT_TRUE(IsPointToPoint(OpKind::kSend));
  EXPECT_TRUE(IsPointToPoint(OpKind::kRecv));
  EXPECT_FALSE(IsPointToPoint(OpKind::kBroadcast));
  EXPECT_STREQ(OpStateName(OpState::kScheduled), "scheduled");
  EXPECT_STREQ(OpStateName(OpState::kStarted), "started");
  EXPECT_STREQ(OpStateName(OpState::kCompleted), "completed");
  EXPECT_STREQ(TorchScalarTypeName(DataType::kFloat32), "Float");
  EXPECT_STREQ(TorchScalarTypeName(DataType::kBFloat16), "BFloat16");
  EXPECT_STREQ(TorchScalarTypeName(DataType::kInt8), "Char");
  EXPECT_STREQ(TorchScalarTypeName(DataType::kInt64), "Long");
}

TEST(OpTrace, ReportsEachStateOnceAndInOrder) {
  auto sink = std::make_shared<ListSink>();
  {
    OpTrace trace(sink, Record(OpKind::kAllReduce));
    EXPECT_EQ(sink->seen().size(), 1u);
    trace.Started();
    trace.Started();  // once
    trace.Completed(absl::OkStatus());
    trace.Completed(absl::InternalError("late"));  // the first report wins
    trace.Started();                               // too late
    EXPECT_TRUE(trace.completed());
  }  // completed: the destructor reports nothing more
  const std::vector<Seen> seen = sink->seen();
  ASSERT_EQ(seen.size(), 3u);
  EXPECT_EQ(seen[0].state, OpState::kScheduled);
  EXPECT_EQ(seen[1].state, OpState::kStarted);
  EXPECT_EQ(seen[2].state, OpState::kCompleted);
  EXPECT_TRUE(seen[2].record.status.ok());
  EXPECT_GT(seen[1].record.time_started_ns, 0);
  EXPECT_GE(seen[2].record.time_completed_ns, seen[1].record.time_started_ns);
  EXPECT_EQ(seen[2].record.op_id, 7u);
  EXPECT_EQ(seen[2].record.comm->name, "tp");
}

TEST(OpTrace, AnOperationDroppedUnfinishedIsReportedCancelled) {
  auto sink = std::make_shared<ListSink>();
  { OpTrace trace(sink, Record(OpKind::kRecv, 2)); }
  const std::vector<Seen> seen = sink->seen();
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[1].state, OpState::kCompleted);
  EXPECT_EQ(seen[1].record.status.code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(std::string(seen[1].record.status.message()),
              HasSubstr("recv was dropped before it completed"));
}

// Threads race to report the start and the end (as a waiter, a progress
// thread and an abort do): each is reported once, start before end.
TEST(OpTrace, RacingReportsAreReportedOnce) {
  for (int round = 0; round < 200; ++round) {
    auto sink = std::make_shared<ListSink>();
    auto trace = std::make_shared<OpTrace>(sink, Record(OpKind::kBarrier));
    std::atomic<bool> go{false};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        while (!go.load()) std::this_thread::yield();
        if (t % 2 == 0) trace->Started();
        trace->Completed(t == 3 ? absl::AbortedError("aborted") : absl::OkStatus());
      });
    }
    go = true;
    for (auto& t : threads) t.join();
    trace.reset();
    const std::vector<Seen> seen = sink->seen();
    int completed = 0, started = 0;
    for (size_t i = 0; i < seen.size(); ++i) {
      completed += seen[i].state == OpState::kCompleted;
      if (seen[i].state == OpState::kStarted) {
        ++started;
        EXPECT_EQ(completed, 0) << "started after completed";
      }
    }
    EXPECT_EQ(completed, 1);
    EXPECT_LE(started, 1);
    EXPECT_EQ(seen.back().state, OpState::kCompleted);
  }
}

// record() and completed() read while other threads report (a dump reads
// the records of operations in flight): the state a reader sees never goes
// back, and what it sees of a state is what the sink was told of it.
TEST(OpTrace, ReadersSeeTheStatesInOrderWhileThreadsReport) {
  for (int round = 0; round < 100; ++round) {
    auto sink = std::make_shared<ListSink>();
    auto trace = std::make_shared<OpTrace>(sink, Record(OpKind::kAllReduce));
    std::atomic<bool> go{false}, done{false};
    std::thread reader([&] {
      int last = static_cast<int>(OpState::kScheduled);
      while (!done.load()) {
        const OpRecord r = trace->record();
        EXPECT_GE(static_cast<int>(r.state), last);
        last = static_cast<int>(r.state);
        EXPECT_EQ(r.op_id, 7u);
        EXPECT_EQ(r.comm->name, "tp");
        if (r.state == OpState::kStarted) EXPECT_GT(r.time_started_ns, 0);
        if (r.state == OpState::kCompleted) {
          EXPECT_GT(r.time_completed_ns, 0);
          EXPECT_TRUE(r.status.ok()) << r.status;
          EXPECT_TRUE(trace->completed());
        }
      }
    });
    std::thread starter([&] {
      while (!go.load()) std::this_thread::yield();
      trace->Started();
    });
    std::thread completer([&] {
      while (!go.load()) std::this_thread::yield();
      trace->Completed(absl::OkStatus());
    });
    go = true;
    starter.join();
    completer.join();
    done = true;
    reader.join();
    ASSERT_TRUE(trace->completed());
    const OpRecord r = trace->record();
    const std::vector<Seen> seen = sink->seen();
    ASSERT_EQ(seen.back().state, OpState::kCompleted);
    EXPECT_EQ(r.state, OpState::kCompleted);
    EXPECT_EQ(r.time_completed_ns, seen.back().record.time_completed_ns);
    EXPECT_EQ(r.time_started_ns, seen.back().record.time_started_ns);
  }
}

// A sink finds what it attached to a communicator; the first attach of an
// owner wins; once every slot is taken, other owners find nothing (and
// look up by name instead).
TEST(SinkSlots, EachOwnerFindsItsOwnUntilTheSlotsAreTaken) {
  CommRecord comm;
  int owners[SinkSlots::kSlots + 1];
  int values[SinkSlots::kSlots + 1];
  for (int i = 0; i < SinkSlots::kSlots; ++i) {
    EXPECT_EQ(comm.sink_slots.Find(&owners[i]), nullptr);
    EXPECT_TRUE(comm.sink_slots.Attach(&owners[i], &values[i]));
  }
  EXPECT_TRUE(comm.sink_slots.Attach(&owners[0], &values[SinkSlots::kSlots]));
  EXPECT_FALSE(comm.sink_slots.Attach(&owners[SinkSlots::kSlots], &values[SinkSlots::kSlots]));
  EXPECT_EQ(comm.sink_slots.Find(&owners[SinkSlots::kSlots]), nullptr);
  for (int i = 0; i < SinkSlots::kSlots; ++i) {
    EXPECT_EQ(comm.sink_slots.Find(&owners[i]), &values[i]) << i;
  }
}

}  // namespace
}  // namespace strata::observe
