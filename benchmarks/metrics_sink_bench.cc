// What the metrics registry costs per recorded event, in one process
// (Google Benchmark): the OpSink's OnCompleted for one collective (the
// duration histogram, the byte counter and the busbw gauge of its
// {group, op}), a step, and a scrape's serialization.
//
//   build/benchmarks/metrics_sink_bench
#include <benchmark/benchmark.h>

#include <memory>

#include "strata/observe/metrics.h"

namespace {

using strata::observe::Metrics;
using strata::observe::OpKind;
using strata::observe::OpRecord;

std::unique_ptr<Metrics> Make() { return std::move(Metrics::Create({})).value(); }

OpRecord Record(const char* group) {
  auto comm = std::make_shared<strata::observe::CommRecord>();
  comm->backend = "mpi";
  comm->name = group;
  comm->size = 8;
  OpRecord r;
  r.comm = comm;
  r.kind = OpKind::kAllReduce;
  r.input_count = r.output_count = 1024;
  r.state = strata::observe::OpState::kCompleted;
  r.time_created_ns = 1'000'000;
  r.time_completed_ns = 1'050'000;
  return r;
}

void BM_OnCompleted(benchmark::State& state) {
  auto m = Make();
  auto sink = m->sink();
  OpRecord r = Record("tp-dp-cp");
  for (auto _ : state) sink->OnCompleted(r);
}
BENCHMARK(BM_OnCompleted);

void BM_RecordStep(benchmark::State& state) {
  auto m = Make();
  for (auto _ : state) m->RecordStep({absl::Milliseconds(100), 4096});
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
