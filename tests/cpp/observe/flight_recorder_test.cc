// The flight recorder's ring and dump, in one process: the last K
// operations in order with their states, the error callback, the JSON in
// PyTorch's flight-recorder format, the file, and many threads at once.
#include "strata/observe/flight_recorder.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <thread>
#include <vector>

#include "nlohmann/json.hpp"

namespace strata::observe {
namespace {

using ::testing::HasSubstr;

std::shared_ptr<CommRecord> Comm(const std::string& name, int rank, int size) {
  auto c = std::make_shared<CommRecord>();
  c->backend = "mpi";
  c->name = name;
  c->rank = rank;
  c->size = size;
  c->world_rank = 5;
  return c;
}

OpRecord Op(const std::shared_ptr<CommRecord>& comm, OpKind kind, uint64_t op_id,
            uint64_t collective, uint64_t p2p = 0, size_t count = 16) {
  OpRecord r;
  r.comm = comm;
  r.kind = kind;
  r.op_id = op_id;
  r.collective_seq_id = collective;
  r.p2p_seq_id = p2p;
  r.input_count = count;
  r.output_count = count;
  r.time_created_ns = 1000 + static_cast<int64_t>(op_id);
  r.timeout_ms = 5000;
  return r;
}

std::shared_ptr<FlightRecorder> Recorder(size_t capacity) {
  FlightRecorderOptions o;
  o.capacity = capacity;
  return std::make_shared<FlightRecorder>(o);
}

TEST(FlightRecorder, KeepsTheLastKOperationsInOrder) {
  auto rec = Recorder(4);
  auto comm = Comm("world", 0, 2);
  std::vector<std::unique_ptr<OpTrace>> traces;
  for (uint64_t i = 1; i <= 10; ++i) {
    traces.push_back(std::make_unique<OpTrace>(rec, Op(comm, OpKind::kAllReduce, i, i)));
  }
  EXPECT_EQ(rec->recorded(), 10u);
  std::vector<RecordedOp> ops = rec->Snapshot();
  ASSERT_EQ(ops.size(), 4u);
  for (size_t i = 0; i < ops.size(); ++i) {
    EXPECT_EQ(ops[i].record_id, 6 + i);
    EXPECT_EQ(ops[i].record.op_id, 7 + i);
    EXPECT_EQ(ops[i].record.state, OpState::kScheduled);
  }
  // Completing an operation that fell out of the ring changes nothing;
  // completing a kept one updates its entry.
  traces[0]->Completed(absl::OkStatus());
  traces[8]->Started();
  traces[9]->Completed(absl::OkStatus());
  ops = rec->Snapshot();
  EXPECT_EQ(ops[2].record.state, OpState::kStarted);
  EXPECT_GT(ops[2].record.time_started_ns, 0);
  EXPECT_EQ(ops[3].record.state, OpState::kCompleted);
  EXPECT_GT(ops[3].record.time_completed_ns, 0);
  EXPECT_EQ(ops[0].record.state, OpState::kScheduled);
}

TEST(FlightRecorder, CapacityZeroIsRejected) {
  FlightRecorderOptions o;
  o.capacity = 0;
  absl::StatusOr<std::shared_ptr<FlightRecorder>> r = FlightRecorder::Create(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("capacity is 0"));
}

TEST(FlightRecorder, ErrorCallbackSeesFailuresButNotCancellations) {
  std::vector<absl::StatusCode> seen;
  FlightRecorderOptions o;
  o.capacity = 8;
  o.on_error = [&](const OpRecord& r) { seen.push_back(r.status.code()); };
  auto rec = std::make_shared<FlightRecorder>(o);
  auto comm = Comm("tp", 0, 2);
  OpTrace(rec, Op(comm, OpKind::kAllReduce, 1, 1)).Completed(absl::OkStatus());
  OpTrace(rec, Op(comm, OpKind::kAllReduce, 2, 2)).Completed(absl::DeadlineExceededError("late"));
  { OpTrace dropped(rec, Op(comm, OpKind::kAllReduce, 3, 3)); }  // Cancelled
  OpTrace(rec, Op(comm, OpKind::kBarrier, 4, 4)).Completed(absl::UnavailableError("peer lost"));
  EXPECT_EQ(seen, (std::vector<absl::StatusCode>{absl::StatusCode::kDeadlineExceeded,
                                                 absl::StatusCode::kUnavailable}));
}

TEST(FlightRecorder, DumpsInPyTorchsFormat) {
  auto rec = Recorder(16);
  auto world = Comm("world", 1, 4);
  auto tp = Comm("tp", 1, 2);
  auto tp_again = Comm("tp", 0, 2);  // a rebuilt World's tp
  OpTrace(rec, Op(world, OpKind::kAllReduce, 1, 1)).Completed(absl::OkStatus());
  OpRecord send = Op(tp, OpKind::kSend, 1, 0, 1, 8);
  send.peer = 0;
  send.output_count = 0;
  OpTrace(rec, send).Completed(absl::OkStatus());
  OpTrace started(rec, Op(world, OpKind::kBroadcast, 2, 2));
  started.Started();
  OpTrace(rec, Op(tp_again, OpKind::kAllGather, 1, 1))
      .Completed(absl::DeadlineExceededError("allgather timed out"));

  DumpOptions d;
  d.world_rank = 5;
  d.world_size = 8;
  d.reason = "called";
  d.group_ranks = [](const CommRecord& c) -> std::optional<std::vector<int>> {
    if (c.name == "world") return std::vector<int>{0, 5, 6, 7};
    return std::nullopt;
  };
  nlohmann::json j = nlohmann::json::parse(rec->DumpJson(d));
  EXPECT_EQ(j["version"], "2.10");
  EXPECT_EQ(j["pg_config"]["world"]["ranks"], "[0, 5, 6, 7]");
  EXPECT_EQ(j["pg_config"]["tp"]["ranks"], "[]");
  EXPECT_EQ(j["pg_config"]["tp#2"]["desc"], "tp");
  EXPECT_EQ(j["pg_status"]["world"]["last_enqueued_collective"], 2);
  EXPECT_EQ(j["pg_status"]["world"]["last_started_collective"], 2);
  EXPECT_EQ(j["pg_status"]["world"]["last_completed_collective"], 1);
  ASSERT_EQ(j["entries"].size(), 4u);
  const nlohmann::json& e0 = j["entries"][0];
  EXPECT_EQ(e0["record_id"], 0);
  EXPECT_EQ(e0["process_group"], nlohmann::json::array({"world", "world"}));
  EXPECT_EQ(e0["profiling_name"], "mpi:all_reduce");
  EXPECT_EQ(e0["input_sizes"], nlohmann::json::parse("[[16]]"));
  EXPECT_EQ(e0["input_dtypes"], nlohmann::json::parse(R"(["Float"])"));
  EXPECT_EQ(e0["state"], "completed");
  EXPECT_EQ(e0["is_p2p"], false);
  EXPECT_EQ(e0["timeout_ms"], 5000);
  const nlohmann::json& e1 = j["entries"][1];
  EXPECT_EQ(e1["profiling_name"], "mpi:send 1->0");
  EXPECT_EQ(e1["is_p2p"], true);
  EXPECT_EQ(e1["p2p_seq_id"], 1);
  // A send's one buffer is both its input and its output, as PyTorch has it.
  EXPECT_EQ(e1["output_sizes"], nlohmann::json::parse("[[8]]"));
  const nlohmann::json& e2 = j["entries"][2];
  EXPECT_EQ(e2["state"], "started");
  EXPECT_TRUE(e2["time_discovered_completed_ns"].is_null());
  EXPECT_FALSE(e2["time_discovered_started_ns"].is_null());
  const nlohmann::json& e3 = j["entries"][3];
  EXPECT_EQ(e3["process_group"][0], "tp#2");
  EXPECT_THAT(e3["strata"]["error"].get<std::string>(), HasSubstr("allgather timed out"));
  EXPECT_EQ(j["strata"]["rank"], 5);
  EXPECT_EQ(j["strata"]["world_size"], 8);
  EXPECT_EQ(j["strata"]["reason"], "called");
  EXPECT_EQ(j["strata"]["recorded"], 4);
}

TEST(FlightRecorder, DumpWritesOneFilePerRank) {
  auto rec = Recorder(4);
  OpTrace(rec, Op(Comm("world", 0, 1), OpKind::kBarrier, 1, 1)).Completed(absl::OkStatus());
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / "fr_dump_test" / "sub";
  std::filesystem::remove_all(dir);
  DumpOptions d;
  d.world_rank = 3;
  absl::StatusOr<std::string> path = rec->Dump(dir.string(), d);
  ASSERT_TRUE(path.ok()) << path.status();
  EXPECT_EQ(*path, (dir / "strata_trace_rank_3.json").string());
  std::ifstream in(*path);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(nlohmann::json::parse(text.str())["entries"].size(), 1u);
  // Nothing but the dump is left behind.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir),
                          std::filesystem::directory_iterator()),
            1);
  // A directory that cannot be made names itself.
  absl::StatusOr<std::string> bad = rec->Dump((dir / "strata_trace_rank_3.json" / "x").string(), d);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(bad.status().message(), HasSubstr("strata_trace_rank_3.json/x"));
}

TEST(FlightRecorder, ManyThreadsAtOnce) {
  constexpr int kThreads = 4, kOps = 500;
  auto rec = Recorder(64);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto comm = Comm("g" + std::to_string(t), 0, 1);
      for (int i = 1; i <= kOps; ++i) {
        auto trace = std::make_shared<OpTrace>(rec, Op(comm, OpKind::kAllReduce, i, i));
        // Completed from another thread, as a backend's progress thread does.
        std::thread([trace] {
          trace->Started();
          trace->Completed(absl::OkStatus());
        }).join();
        if (i % 100 == 0) (void)rec->DumpJson(DumpOptions{});
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(rec->recorded(), static_cast<uint64_t>(kThreads * kOps));
  for (const RecordedOp& op : rec->Snapshot()) {
    EXPECT_EQ(op.record.state, OpState::kCompleted) << op.record_id;
  }
}

// Snapshots and dumps taken while threads record (a dump on a deadline
// does not stop the other groups): each holds at most K entries, oldest
// first, and each entry whole (its fields those of one operation).
TEST(FlightRecorder, SnapshotsWhileThreadsRecordHoldWholeEntries) {
  constexpr int kThreads = 3, kOps = 1500;
  constexpr size_t kCapacity = 16;
  auto rec = Recorder(kCapacity);
  std::atomic<int> running{kThreads};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto comm = Comm("g" + std::to_string(t), 0, 1);
      for (int i = 1; i <= kOps; ++i) {
        // The count tells whose operation an entry is: 100000 t + i.
        OpTrace trace(rec, Op(comm, OpKind::kAllReduce, i, i, 0, 100000u * t + i));
        trace.Started();
        trace.Completed(absl::OkStatus());
      }
      running.fetch_sub(1);
    });
  }
  int snapshots = 0;
  while (running.load() > 0) {
    const std::vector<RecordedOp> ops = rec->Snapshot();
    ASSERT_LE(ops.size(), kCapacity);
    for (size_t i = 0; i < ops.size(); ++i) {
      const OpRecord& r = ops[i].record;
      if (i > 0) EXPECT_GT(ops[i].record_id, ops[i - 1].record_id);
      EXPECT_EQ(r.collective_seq_id, r.op_id);
      const int t = std::stoi(r.comm->name.substr(1));
      EXPECT_EQ(r.input_count, 100000u * t + r.op_id) << r.comm->name;
      if (r.state != OpState::kScheduled) EXPECT_GT(r.time_started_ns, 0);
      if (r.state == OpState::kCompleted) EXPECT_GE(r.time_completed_ns, r.time_started_ns);
    }
    if (++snapshots % 8 == 0) {
      const nlohmann::json dump = nlohmann::json::parse(rec->DumpJson(DumpOptions{}));
      EXPECT_LE(dump["entries"].size(), kCapacity);
    }
  }
  for (std::thread& t : threads) t.join();
  const std::vector<RecordedOp> ops = rec->Snapshot();
  ASSERT_EQ(ops.size(), kCapacity);
  EXPECT_EQ(rec->recorded(), static_cast<uint64_t>(kThreads * kOps));
  for (size_t i = 0; i < ops.size(); ++i) {
    EXPECT_EQ(ops[i].record_id, rec->recorded() - kCapacity + i);
    EXPECT_EQ(ops[i].record.state, OpState::kCompleted);
  }
}

// A ring of one written from several threads at once (the ring going round
// while an operation is between its number and its entry): the entry left
// is the newest operation's, completed.
TEST(FlightRecorder, ARingOfOneHoldsTheNewestOperation) {
  constexpr int kThreads = 4, kOps = 500;
  auto rec = Recorder(1);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto comm = Comm("g" + std::to_string(t), 0, 1);
      for (int i = 1; i <= kOps; ++i) {
        OpTrace trace(rec, Op(comm, OpKind::kBroadcast, i, i));
        trace.Started();
        trace.Completed(absl::OkStatus());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  const std::vector<RecordedOp> ops = rec->Snapshot();
  ASSERT_EQ(ops.size(), 1u);
  EXPECT_EQ(ops[0].record_id, rec->recorded() - 1);
  EXPECT_EQ(ops[0].record.state, OpState::kCompleted);
}

}  // namespace
}  // namespace strata::observe
