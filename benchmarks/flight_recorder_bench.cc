// The flight recorder's own cost per operation (Google Benchmark), in one
// process: the life of one operation's record (issued, started, completed,
// as the Communicator and a backend report it through an OpTrace) with a
// trivial sink and with the FlightRecorder, from 1 and from 4 threads at
// once (the recorder is shared by every group of a rank and called from
// the issuing threads and the backends' progress threads).
//
//   build/benchmarks/flight_recorder_bench
//
// run_flight_recorder.py runs it beside the same-run ratios (an MPI loop of
// small all-reduces, the demo's model) that show what the cost amounts to.
#include <benchmark/benchmark.h>

#include <atomic>
#include <memory>

#include "strata/observe/flight_recorder.h"
#include "strata/observe/op_record.h"

namespace {

using strata::observe::CommRecord;
using strata::observe::OpKind;
using strata::observe::OpRecord;
using strata::observe::OpSink;
using strata::observe::OpTrace;

class TrivialSink final : public OpSink {
 public:
  void OnScheduled(const OpRecord&) override { n.fetch_add(1, std::memory_order_relaxed); }
  void OnStarted(const OpRecord&) override { n.fetch_add(1, std::memory_order_relaxed); }
  void OnCompleted(const OpRecord&) override { n.fetch_add(1, std::memory_order_relaxed); }
  std::atomic<int64_t> n{0};
};

std::shared_ptr<OpSink> Sink(int which) {
  if (which == 0) return std::make_shared<TrivialSink>();
  return std::make_shared<strata::observe::FlightRecorder>(
      strata::observe::FlightRecorderOptions{});
}

// One shared sink per benchmark run (all threads record into it).
std::shared_ptr<OpSink>& Shared() {
  static std::shared_ptr<OpSink> sink;
  return sink;
}

void BM_RecordOneOperation(benchmark::State& state) {
  if (state.thread_index() == 0) Shared() = Sink(static_cast<int>(state.range(0)));
  auto comm = std::make_shared<CommRecord>();
  comm->backend = "mpi";
  comm->name = "world";
  comm->size = 8;
  uint64_t id = 0;
  for (auto _ : state) {
    OpRecord r;
    r.comm = comm;
    r.kind = OpKind::kAllReduce;
    r.op_id = ++id;
    r.collective_seq_id = id;
    r.input_count = r.output_count = 1024;
    r.reduce_op = "sum";
    OpTrace trace(Shared(), std::move(r));
    trace.Started();
    trace.Completed(absl::OkStatus());
  }
  state.SetLabel(state.range(0) == 0 ? "trivial sink" : "flight recorder");
}
BENCHMARK(BM_RecordOneOperation)->Arg(0)->Arg(1)->Threads(1)->Threads(4)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
