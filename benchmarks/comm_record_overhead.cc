// What recording costs (strata/observe/op_record.h): a loop of
// small-message allreduces (start, wait) on three communicators of the same
// ranks, one without a sink, one with a trivial sink (three relaxed atomic
// increments per operation) and one with the flight recorder the World
// installs by default (strata/observe/flight_recorder.h), in rotating
// rounds so that the machine's noise falls on all alike.
//
//   mpirun -np 2 build/benchmarks/comm_record_overhead [--iters 2000] [--rounds 21] [--count 1]
//       [--json FILE]
//
// Prints, per side, the median over rounds of the time per operation (the
// slowest rank's mean in each round) and the differences; --json writes
// the flight recorder's row (benchmarks/results/flight_recorder.json).
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/time/clock.h"
#include "strata/comm/backend.h"
#include "strata/comm/communicator.h"
#include "strata/comm/launch_env.h"
#include "strata/observe/flight_recorder.h"
#include "strata/observe/op_record.h"

namespace {

class CountingSink final : public strata::observe::OpSink {
 public:
  void OnScheduled(const strata::observe::OpRecord&) override {
    scheduled.fetch_add(1, std::memory_order_relaxed);
  }
  void OnStarted(const strata::observe::OpRecord&) override {
    started.fetch_add(1, std::memory_order_relaxed);
  }
  void OnCompleted(const strata::observe::OpRecord&) override {
    completed.fetch_add(1, std::memory_order_relaxed);
  }
  std::atomic<int64_t> scheduled{0}, started{0}, completed{0};
};

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "comm_record_overhead: %s\n", s.ToString().c_str());
  return 1;
}

// Seconds per operation of `iters` allreduces of `x`, the slowest rank's.
absl::StatusOr<double> Loop(strata::Communicator& c, std::vector<float>& x, int iters) {
  strata::Buffer b = strata::Buffer::Of(x.data(), x.size());
  const absl::Time start = absl::Now();
  for (int i = 0; i < iters; ++i) {
    absl::StatusOr<std::unique_ptr<strata::Work>> w = c.AllReduce(b, b, strata::ReduceOp::kMax);
    if (!w.ok()) return w.status();
    absl::Status s = (*w)->Wait(absl::Now() + absl::Seconds(60));
    if (!s.ok()) return s;
  }
  double mine = absl::ToDoubleSeconds(absl::Now() - start) / iters, slowest = 0;
  absl::StatusOr<std::unique_ptr<strata::Work>> w =
      c.AllReduce(strata::ConstBuffer(&mine, 1, strata::DataType::kFloat64),
                  strata::Buffer::Of(&slowest, 1), strata::ReduceOp::kMax);
  if (!w.ok()) return w.status();
  absl::Status s = (*w)->Wait(absl::Now() + absl::Seconds(60));
  if (!s.ok()) return s;
  return slowest;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 2000, rounds = 21, count = 1;
  std::string json_path;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--json") {
      json_path = argv[i + 1];
      continue;
    }
    int* target = flag == "--iters"    ? &iters
                  : flag == "--rounds" ? &rounds
                  : flag == "--count"  ? &count
                                       : nullptr;
    if (target == nullptr || !absl::SimpleAtoi(argv[i + 1], target) || *target < 1) {
      std::fprintf(stderr, "usage: %s [--iters N] [--rounds N] [--count N] [--json FILE]\n",
                   argv[0]);
      return 2;
    }
  }
  absl::StatusOr<strata::LaunchEnv> env = strata::LaunchEnv::Detect();
  if (!env.ok()) return Fail(env.status());
  strata::RootOptions options;
  options.backend = "mpi";
  absl::StatusOr<std::unique_ptr<strata::Communicator>> root =
      strata::CreateRootCommunicator(*env, options);
  if (!root.ok()) return Fail(root.status());
  auto sink = std::make_shared<CountingSink>();
  strata::CommOptions plain_options, recorded_options;
  plain_options.name = "plain";
  recorded_options.name = "recorded";
  recorded_options.sink = sink;
  auto plain = (*root)->Split(0, (*root)->rank(), plain_options);
  auto recorded = (*root)->Split(0, (*root)->rank(), recorded_options);
  strata::CommOptions flight_options;
  flight_options.name = "flight";
  auto recorder =
      std::make_shared<strata::observe::FlightRecorder>(strata::observe::FlightRecorderOptions{});
  flight_options.sink = recorder;
  auto flight = (*root)->Split(0, (*root)->rank(), flight_options);
  if (!plain.ok()) return Fail(plain.status());
  if (!recorded.ok()) return Fail(recorded.status());
  if (!flight.ok()) return Fail(flight.status());
  std::vector<float> x(static_cast<size_t>(count), 1.0f);
  // Warm all up, then rotate which goes first.
  strata::Communicator* sides[3] = {plain->get(), recorded->get(), flight->get()};
  for (auto* c : sides) {
    absl::StatusOr<double> warm = Loop(*c, x, std::max(1, iters / 10));
    if (!warm.ok()) return Fail(warm.status());
  }
  std::vector<double> times[3];
  for (int r = 0; r < rounds; ++r) {
    for (int k = 0; k < 3; ++k) {
      const int side = (r + k) % 3;
      absl::StatusOr<double> t = Loop(*sides[side], x, iters);
      if (!t.ok()) return Fail(t.status());
      times[side].push_back(*t);
    }
  }
  if ((*root)->rank() == 0) {
    const double a = Median(times[0]) * 1e6, b = Median(times[1]) * 1e6, c = Median(times[2]) * 1e6;
    std::printf("allreduce of %d x fp32 on %d ranks (%s), %d rounds of %d operations\n", count,
                (*root)->size(), std::string((*root)->transport()).c_str(), rounds, iters);
    std::printf("  no sink          %8.3f us/op (median of the rounds)\n", a);
    std::printf("  trivial sink     %8.3f us/op\n", b);
    std::printf("  flight recorder  %8.3f us/op (ring of %zu)\n", c, recorder->capacity());
    std::printf("  trivial sink     %+8.3f us/op (%+.1f%%)\n", b - a, (b - a) / a * 100);
    std::printf("  flight recorder  %+8.3f us/op (%+.1f%%)\n", c - a, (c - a) / a * 100);
    if (!json_path.empty()) {
      FILE* f = std::fopen(json_path.c_str(), "w");
      if (f == nullptr) return Fail(absl::UnavailableError("cannot write " + json_path));
      std::fprintf(f,
                   "{\"case\": \"allreduce %d x fp32, %d ranks, start+wait loop\", "
                   "\"us_per_op_off\": %.4f, \"us_per_op_trivial_sink\": %.4f, "
                   "\"us_per_op_on\": %.4f, \"ratio\": %.5f, \"rounds\": %d, \"iters\": %d}\n",
                   count, (*root)->size(), a, b, c, c / a, rounds, iters);
      std::fclose(f);
    }
    std::printf("  sink calls     %lld scheduled, %lld started, %lld completed\n",
                static_cast<long long>(sink->scheduled.load()),
                static_cast<long long>(sink->started.load()),
                static_cast<long long>(sink->completed.load()));
  }
  return 0;
}
