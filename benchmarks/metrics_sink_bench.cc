// What metrics and the flight recorder cost per recorded event, in one
// process (Google Benchmark):
//
// - BM_OperationLife/<sinks>: everything recording adds to one operation,
//   done as the Communicator and a backend do it when CommOptions::sink is
//   set (src/comm/communicator.cc): the OpRecord with its CommRecord, the
//   OpTrace (issued), Started, Completed, the two clock reads around
//   Work::Wait and OnWaited, and the trace's release. <sinks>: 0 a trivial
//   sink (three relaxed atomic increments), 1 the flight recorder, 2 the
//   metrics sink, 3 metrics + flight recorder through one fan-out sink (what
//   strata.init(metrics=...) installs). From 1 and 4 threads at once (a
//   rank's groups share one recorder and one registry).
// - BM_OnCompleted: the metrics sink's OnCompleted alone (the duration
//   histogram, the byte counter and the busbw gauge of its {group, op}).
// - BM_RecordStep: Metrics::RecordStep with the two CollectiveWaitSeconds
//   reads a step marker makes around it: the C++ part of the per-step cost
//   (the Python part: metrics_overhead_worker.py times it, run by
//   run_metrics_overhead.py).
// - BM_Serialize: a scrape's serialization.
//
//   build/benchmarks/metrics_sink_bench
#include <benchmark/benchmark.h>

#include <atomic>
#include <memory>

#include "absl/time/clock.h"
#include "strata/observe/flight_recorder.h"
#include "strata/observe/metrics.h"
#include "strata/observe/op_record.h"

namespace {

using strata::observe::CommRecord;
using strata::observe::Metrics;
using strata::observe::OpKind;
using strata::observe::OpRecord;
using strata::observe::OpSink;
using strata::observe::OpTrace;

std::unique_ptr<Metrics> Make() { return std::move(Metrics::Create({})).value(); }

std::shared_ptr<CommRecord> Comm(const char* group) {
  auto comm = std::make_shared<CommRecord>();
  comm->backend = "mpi";
  comm->name = group;
  comm->size = 8;
  return comm;
}

OpRecord Record(const char* group) {
  OpRecord r;
  r.comm = Comm(group);
  r.kind = OpKind::kAllReduce;
  r.input_count = r.output_count = 1024;
  r.state = strata::observe::OpState::kCompleted;
  r.time_created_ns = 1'000'000;
  r.time_completed_ns = 1'050'000;
  return r;
}

class TrivialSink final : public OpSink {
 public:
  void OnScheduled(const OpRecord&) override { n.fetch_add(1, std::memory_order_relaxed); }
  void OnStarted(const OpRecord&) override { n.fetch_add(1, std::memory_order_relaxed); }
  void OnCompleted(const OpRecord&) override { n.fetch_add(1, std::memory_order_relaxed); }
  std::atomic<int64_t> n{0};
};

// The sinks of one benchmark run, shared by its threads.
struct Sinks {
  std::unique_ptr<Metrics> metrics;
  std::shared_ptr<OpSink> sink;
};

Sinks& Shared() {
  static Sinks sinks;
  return sinks;
}

Sinks MakeSinks(int which) {
  Sinks s;
  auto recorder =
      std::make_shared<strata::observe::FlightRecorder>(strata::observe::FlightRecorderOptions{});
  switch (which) {
    case 0:
      s.sink = std::make_shared<TrivialSink>();
      break;
    case 1:
      s.sink = recorder;
      break;
    case 2:
      s.metrics = Make();
      s.sink = s.metrics->sink();
      break;
    default:
      s.metrics = Make();
      s.sink = strata::observe::MakeFanOutSink({s.metrics->sink(), recorder});
      break;
  }
  return s;
}

void BM_OperationLife(benchmark::State& state) {
  if (state.thread_index() == 0) Shared() = MakeSinks(static_cast<int>(state.range(0)));
  // One communicator per thread, as a rank's groups are.
  std::shared_ptr<const CommRecord> comm = Comm(state.thread_index() % 2 == 0 ? "tp" : "dp");
  uint64_t id = 0;
  for (auto _ : state) {
    OpRecord r;
    r.comm = comm;
    r.kind = OpKind::kAllReduce;
    r.op_id = ++id;
    r.collective_seq_id = id;
    r.input_count = r.output_count = 1024;
    r.reduce_op = "sum";
    r.timeout_ms = 600000;
    r.time_created_ns = absl::GetCurrentTimeNanos();  // read with or without a sink
    // Read after the threads' start barrier; copied as the Communicator
    // copies its sink into each trace.
    auto trace = std::make_shared<OpTrace>(Shared().sink, std::move(r));
    trace->Started();
    trace->Completed(absl::OkStatus());
    const int64_t wait_start = absl::GetCurrentTimeNanos();  // Work::Wait
    trace->Waited(absl::GetCurrentTimeNanos() - wait_start);
    trace.reset();
  }
  static const char* kNames[] = {"trivial sink", "flight recorder", "metrics",
                                 "metrics + flight recorder"};
  state.SetLabel(kNames[state.range(0)]);
}
BENCHMARK(BM_OperationLife)->DenseRange(0, 3)->Threads(1)->Threads(4)->UseRealTime();

void BM_OnCompleted(benchmark::State& state) {
  auto m = Make();
  auto sink = m->sink();
  OpRecord r = Record("tp-dp-cp");
  for (auto _ : state) sink->OnCompleted(r);
}
BENCHMARK(BM_OnCompleted);

void BM_RecordStep(benchmark::State& state) {
  auto m = Make();
  for (auto _ : state) {
    const double w0 = m->CollectiveWaitSeconds();
    benchmark::DoNotOptimize(w0);
    m->RecordStep({absl::Milliseconds(100), 4096, absl::ZeroDuration(),
                   absl::Seconds(m->CollectiveWaitSeconds() - w0)});
  }
}
BENCHMARK(BM_RecordStep);

void BM_Serialize(benchmark::State& state) {
  auto m = Make();
  auto sink = m->sink();
  for (const char* g : {"world", "tp", "dp", "pp", "dp-cp"}) sink->OnCompleted(Record(g));
  for (auto _ : state) benchmark::DoNotOptimize(m->Serialize());
}
BENCHMARK(BM_Serialize);

}  // namespace

BENCHMARK_MAIN();
