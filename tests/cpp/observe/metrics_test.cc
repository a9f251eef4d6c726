// The metrics registry in one process: names and labels of the exposition,
// the collective figures an OpSink derives from records (bytes as nccl-tests
// counts them, busbw with its factors), the .prom file written atomically,
// the cluster view's statistics, and the errors a user can cause.
#include "strata/observe/metrics.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace strata::observe {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Sample lines of the exposition: "name{labels}" -> value.
std::map<std::string, double> Samples(const std::string& text) {
  std::map<std::string, double> out;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    size_t space = line.rfind(' ');
    out[std::string(line.substr(0, space))] = std::stod(std::string(line.substr(space + 1)));
  }
  return out;
}

std::unique_ptr<Metrics> Make(MetricsOptions o = {}) {
  absl::StatusOr<std::unique_ptr<Metrics>> m = Metrics::Create(o);
  EXPECT_TRUE(m.ok()) << m.status();
  return std::move(m).value();
}

OpRecord Completed(OpKind kind, const std::string& group, int size, size_t in, size_t out,
                   DataType dtype, int64_t nanos) {
  auto comm = std::make_shared<CommRecord>();
  comm->backend = "mpi";
  comm->name = group;
  comm->size = size;
  OpRecord r;
  r.comm = comm;
  r.kind = kind;
  r.input_count = in;
  r.output_count = out;
  r.dtype = dtype;
  r.state = OpState::kCompleted;
  r.time_created_ns = 1'000'000'000;
  r.time_completed_ns = r.time_created_ns + nanos;
  return r;
}

TEST(Metrics, ExposesEveryFamilyWithJobAndRankLabels) {
  MetricsOptions o;
  o.job = "llama";
  o.rank = 3;
  auto m = Make(o);
  m->RecordStep({absl::Milliseconds(250), 1000});
  m->RecordEviction("straggler");
  m->RecordRecovery();
  m->RecordCheckpointWrite(4096);
  m->RecordCheckpointBlocked(absl::Milliseconds(20));
  m->sink()->OnCompleted(
      Completed(OpKind::kAllReduce, "dp", 4, 256, 256, DataType::kFloat32, 1'000'000));
  OpRecord failed = Completed(OpKind::kBarrier, "dp", 4, 0, 0, DataType::kFloat32, 1);
  failed.status = absl::DeadlineExceededError("late");
  m->sink()->OnCompleted(failed);
  const std::string text = m->Serialize();
  for (const char* family :
       {"strata_step_duration_seconds", "strata_tokens_per_second", "strata_mfu_ratio",
        "strata_data_wait_seconds", "strata_collective_duration_seconds",
        "strata_collective_bytes_total", "strata_collective_busbw_bytes_per_second",
        "strata_checkpoint_blocked_seconds", "strata_checkpoint_write_bytes_total",
        "strata_recoveries_total", "strata_evictions_total", "strata_comm_errors_total",
        "strata_build_info"}) {
    EXPECT_THAT(text, HasSubstr(absl::StrCat("# TYPE ", family, " "))) << family;
  }
  auto s = Samples(text);
  const std::string jr = "job=\"llama\",rank=\"3\"";
  EXPECT_EQ(s.at(absl::StrCat("strata_step_duration_seconds_count{", jr, "}")), 1);
  EXPECT_DOUBLE_EQ(s.at(absl::StrCat("strata_step_duration_seconds_sum{", jr, "}")), 0.25);
  EXPECT_DOUBLE_EQ(s.at(absl::StrCat("strata_tokens_per_second{", jr, "}")), 1000 / 0.25);
  EXPECT_EQ(s.at(absl::StrCat("strata_evictions_total{", jr, ",reason=\"straggler\"}")), 1);
  EXPECT_EQ(s.at(absl::StrCat("strata_comm_errors_total{", jr, ",backend=\"mpi\"}")), 1);
  EXPECT_EQ(s.at(absl::StrCat("strata_checkpoint_write_bytes_total{", jr, "}")), 4096);
  EXPECT_EQ(
      s.at(absl::StrCat("strata_collective_bytes_total{", jr, ",group=\"dp\",op=\"all_reduce\"}")),
      256 * 4);
  // Failed operations count as errors, not as traffic.
  EXPECT_EQ(
      s.count(absl::StrCat("strata_collective_bytes_total{", jr, ",group=\"dp\",op=\"barrier\"}")),
      0u);
  // Text format 0.0.4 without timestamps: every sample line is "name value".
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    std::vector<absl::string_view> parts = absl::StrSplit(line, absl::MaxSplits(' ', 10));
    EXPECT_EQ(parts.size(), 2u) << line;
  }
}

TEST(Metrics, CollectiveBytesAndBusBandwidthFollowNcclTests) {
  auto m = Make();
  const int n = 8;
  const int64_t nanos = 2'000'000;  // 2 ms each
  struct Case {
    OpKind kind;
    size_t in, out;
    DataType dtype;
    double size_bytes;  // nccl-tests' size
    double factor;
  };
  const Case cases[] = {
      {OpKind::kAllReduce, 1000, 1000, DataType::kFloat32, 4000, 2.0 * (n - 1) / n},
      {OpKind::kAllGather, 100, 800, DataType::kBFloat16, 1600, (n - 1.0) / n},
      {OpKind::kReduceScatter, 800, 100, DataType::kFloat64, 6400, (n - 1.0) / n},
      {OpKind::kAllToAll, 80, 80, DataType::kInt8, 80, (n - 1.0) / n},
      {OpKind::kBroadcast, 10, 10, DataType::kInt64, 80, 1.0},
      {OpKind::kSend, 7, 0, DataType::kFloat32, 28, 1.0},
      {OpKind::kRecv, 0, 9, DataType::kFloat32, 36, 1.0},  // as Communicator::Recv records it
  };
  const int reps = 3;
  for (const Case& c : cases) {
    for (int i = 0; i < reps; ++i) {
      m->sink()->OnCompleted(Completed(c.kind, "world", n, c.in, c.out, c.dtype, nanos));
    }
  }
  auto s = Samples(m->Serialize());
  for (const Case& c : cases) {
    const std::string labels =
        absl::StrCat("{job=\"strata\",rank=\"0\",group=\"world\",op=\"", OpKindName(c.kind), "\"}");
    EXPECT_DOUBLE_EQ(s.at("strata_collective_bytes_total" + labels), reps * c.size_bytes)
        << OpKindName(c.kind);
    const double algbw = c.size_bytes / (nanos * 1e-9);
    EXPECT_NEAR(s.at("strata_collective_busbw_bytes_per_second" + labels), algbw * c.factor,
                1e-6 * algbw)
        << OpKindName(c.kind);
    EXPECT_EQ(s.at("strata_collective_duration_seconds_count" + labels), reps);
  }
}

TEST(Metrics, MfuIsTokensPerSecondTimesFlopsOverPeak) {
  MetricsOptions o;
  o.flops_per_token = 6e9;
  o.peak_flops = 1e15;
  auto m = Make(o);
  m->RecordStep({absl::Milliseconds(500), 4096});
  const double expected = 4096 / 0.5 * 6e9 / 1e15;
  EXPECT_DOUBLE_EQ(m->totals().mfu, expected);
  EXPECT_DOUBLE_EQ(Samples(m->Serialize()).at("strata_mfu_ratio{job=\"strata\",rank=\"0\"}"),
                   expected);
  EXPECT_THAT(m->SetMfu(1e9, 0).message(), HasSubstr("peak_flops is 0"));
}

TEST(Metrics, PeakTableAndCpuGemm) {
  EXPECT_DOUBLE_EQ(*PeakFlopsForDevice("NVIDIA H100 80GB HBM3"), 989e12);
  EXPECT_DOUBLE_EQ(*PeakFlopsForDevice("NVIDIA H100 PCIe"), 756e12);
  EXPECT_DOUBLE_EQ(*PeakFlopsForDevice("NVIDIA A100-SXM4-80GB"), 312e12);
  EXPECT_THAT(PeakFlopsForDevice("Voodoo 2").status().message(), HasSubstr("Voodoo 2"));
  const double peak = MeasureCpuGemmPeak(128, absl::Milliseconds(20));
  EXPECT_GT(peak, 1e8);  // any CPU of this century does 0.1 GFLOP/s
}

TEST(Metrics, WritesThePromFileAtomically) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / absl::StrCat("strata-metrics-", getpid());
  std::filesystem::create_directories(dir);
  MetricsOptions o;
  o.rank = 5;
  o.file = (dir / "node-{rank}.prom").string();
  auto m = Make(o);
  EXPECT_EQ(m->file(), (dir / "node-5.prom").string());
  m->RecordStep({absl::Seconds(1), 10});
  ASSERT_TRUE(m->WriteFile().ok());
  std::ifstream in(m->file());
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(text.str(), m->Serialize());
  // Only the target remains: the temporary file was renamed onto it.
  int entries = 0;
  for (auto& e : std::filesystem::directory_iterator(dir)) entries += e.is_regular_file();
  EXPECT_EQ(entries, 1);
  std::filesystem::remove_all(dir);
  absl::Status gone = m->WriteFile();
  EXPECT_EQ(gone.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(gone.message(), HasSubstr(m->file()));
}

TEST(Metrics, ClusterViewStatistics) {
  auto m = Make();
  const size_t f = ClusterFigureNames().size();
  std::vector<std::vector<double>> samples;
  // Step times 1..20 s on ranks 0..19, rank 13 the slowest with 100 s.
  for (int r = 0; r < 20; ++r) {
    std::vector<double> s(f, 0.0);
    s[0] = r == 13 ? 100.0 : r + 1;
    samples.push_back(s);
  }
  ASSERT_TRUE(m->SetClusterView(samples).ok());
  std::vector<double> sorted;
  for (auto& s : samples) sorted.push_back(s[0]);
  std::sort(sorted.begin(), sorted.end());
  auto s = Samples(m->Serialize());
  const std::string name = "strata_cluster_step_duration_seconds";
  const std::string jr = "job=\"strata\",rank=\"0\"";
  EXPECT_EQ(s.at(name + "{" + jr + ",stat=\"min\"}"), sorted.front());
  EXPECT_EQ(s.at(name + "{" + jr + ",stat=\"max\"}"), 100.0);
  EXPECT_EQ(s.at(name + "{" + jr + ",stat=\"median\"}"), (sorted[9] + sorted[10]) / 2);
  EXPECT_EQ(s.at(name + "{" + jr + ",stat=\"p95\"}"), sorted[18]);  // ceil(0.95*20) = 19th
  EXPECT_EQ(s.at(name + "_max_rank{" + jr + "}"), 13);
  samples[2].pop_back();
  EXPECT_THAT(m->SetClusterView(samples).message(), HasSubstr("rank 2"));
}

TEST(Metrics, ClusterSampleCoversTheStepsSinceTheLastOne) {
  auto m = Make();
  m->RecordStep({absl::Seconds(1), 100});
  m->RecordStep({absl::Seconds(3), 100});
  std::vector<double> first = m->ClusterSample();
  EXPECT_DOUBLE_EQ(first[0], 2.0);
  EXPECT_DOUBLE_EQ(first[1], 200 / 4.0);
  m->RecordStep({absl::Seconds(5), 50});
  std::vector<double> second = m->ClusterSample();
  EXPECT_DOUBLE_EQ(second[0], 5.0);
  EXPECT_DOUBLE_EQ(second[1], 10.0);
}

// Time blocked in Work::Wait (the sink's OnWaited) is counted per group and
// in total; a step's compute time is its duration less the wait it was
// given (never below zero), and the cluster sample carries both means.
TEST(Metrics, WaitsSplitAStepIntoComputeAndCollectiveWait) {
  auto m = Make();
  const std::vector<std::string>& names = ClusterFigureNames();
  const size_t compute = std::find(names.begin(), names.end(), "compute_seconds") - names.begin();
  const size_t wait =
      std::find(names.begin(), names.end(), "collective_wait_seconds") - names.begin();
  ASSERT_LT(compute, names.size());
  ASSERT_LT(wait, names.size());
  CommRecord dp;
  dp.name = "dp";
  CommRecord tp;
  tp.name = "tp";
  const double before = m->CollectiveWaitSeconds();
  m->sink()->OnWaited(dp, OpKind::kAllReduce, 300'000'000);
  m->sink()->OnWaited(tp, OpKind::kAllGather, 100'000'000);
  m->sink()->OnWaited(dp, OpKind::kAllReduce, 200'000'000);
  const double waited = m->CollectiveWaitSeconds() - before;
  EXPECT_NEAR(waited, 0.6, 1e-9);
  StepSample step{absl::Seconds(1), 0};
  step.collective_wait = absl::Seconds(waited);
  m->RecordStep(step);
  StepSample all_wait{absl::Seconds(1), 0};
  all_wait.collective_wait = absl::Seconds(2);  // more than the step: all of it was waiting
  m->RecordStep(all_wait);
  std::vector<double> sample = m->ClusterSample();
  EXPECT_NEAR(sample[compute], (0.4 + 0.0) / 2, 1e-9);
  EXPECT_NEAR(sample[wait], (0.6 + 1.0) / 2, 1e-9);
  auto s = Samples(m->Serialize());
  const std::string jr = "job=\"strata\",rank=\"0\"";
  EXPECT_NEAR(s.at("strata_collective_wait_seconds_total{" + jr + ",group=\"dp\"}"), 0.5, 1e-9);
  EXPECT_NEAR(s.at("strata_collective_wait_seconds_total{" + jr + ",group=\"tp\"}"), 0.1, 1e-9);
  EXPECT_EQ(s.at("strata_step_compute_seconds_count{" + jr + "}"), 2);
  EXPECT_NEAR(s.at("strata_step_compute_seconds_sum{" + jr + "}"), 0.4, 1e-9);
}

TEST(Metrics, CustomMetrics) {
  auto m = Make();
  ASSERT_TRUE(m->CounterAdd("my_samples_total", "samples", 3).ok());
  ASSERT_TRUE(m->CounterAdd("my_samples_total", "samples", 2).ok());
  ASSERT_TRUE(m->GaugeSet("my_loss", "loss", 1.5).ok());
  ASSERT_TRUE(m->HistogramObserve("my_latency_seconds", "lat", {0.1, 1}, 0.5).ok());
  auto s = Samples(m->Serialize());
  EXPECT_EQ(s.at("my_samples_total{job=\"strata\",rank=\"0\"}"), 5);
  EXPECT_EQ(s.at("my_loss{job=\"strata\",rank=\"0\"}"), 1.5);
  EXPECT_EQ(s.at("my_latency_seconds_bucket{job=\"strata\",rank=\"0\",le=\"1\"}"), 1);
  EXPECT_THAT(m->GaugeSet("my_samples_total", "", 1).message(), HasSubstr("is a counter"));
  EXPECT_THAT(m->GaugeSet("strata_mfu_ratio", "", 1).message(), HasSubstr("strata's own"));
  EXPECT_THAT(m->GaugeSet("3bad name", "", 1).message(), HasSubstr("not a Prometheus"));
  EXPECT_THAT(m->CounterAdd("my_samples_total", "", -1).message(), HasSubstr("only go up"));
  EXPECT_THAT(m->HistogramObserve("h", "", {2, 1}, 0).message(), HasSubstr("increasing"));
}

TEST(Metrics, BadOptionsAndSettingsAreRefused) {
  MetricsOptions o;
  o.rank = -1;
  EXPECT_THAT(Metrics::Create(o).status().message(), HasSubstr("rank must be >= 0, got -1"));
  o = {};
  o.port = 70000;
  EXPECT_THAT(Metrics::Create(o).status().message(), HasSubstr("70000"));
  o = {};
  o.flops_per_token = 1e9;
  EXPECT_THAT(Metrics::Create(o).status().message(), HasSubstr("peak_flops is 0"));
  o = {};
  o.step_buckets = {1, 1};
  EXPECT_THAT(Metrics::Create(o).status().message(), HasSubstr("increasing"));

  Settings s;
  s.metrics_port = "http";
  MetricsOptions from_env;
  EXPECT_THAT(ApplyMetricsSettings(s, 0, &from_env).message(),
              HasSubstr("STRATA_METRICS_PORT='http'"));
  s.metrics_port = "9400";
  s.metrics_file = "/tmp/x-{rank}.prom";
  ASSERT_TRUE(ApplyMetricsSettings(s, 2, &from_env).ok());
  EXPECT_EQ(from_env.port, 9402);
  EXPECT_EQ(from_env.file, "/tmp/x-{rank}.prom");
  MetricsOptions explicit_port;
  explicit_port.port = 0;
  ASSERT_TRUE(ApplyMetricsSettings(s, 2, &explicit_port).ok());
  EXPECT_EQ(explicit_port.port, 0);  // the option wins over the variable
}

TEST(Metrics, ServesOverHttpOnAPortTheOsPicks) {
#if defined(__SANITIZE_ADDRESS__)
  // Debian's civetweb (under prometheus-cpp's exposer) binds the port and
  // then refuses to start its context under ASan ("null context when
  // constructing CivetServer"), before any thread of ours runs; the
  // regular build and the Python tests cover serving.
  GTEST_SKIP() << "civetweb does not start under AddressSanitizer";
#endif
  MetricsOptions o;
  o.port = 0;
  auto m = Make(o);
  EXPECT_GT(m->port(), 0);
  // A second server on the same port is refused with the address named.
  MetricsOptions again;
  again.port = m->port();
  absl::Status busy = Metrics::Create(again).status();
  EXPECT_EQ(busy.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(busy.message(), HasSubstr(absl::StrCat(":", m->port())));
  // Once stopped, the port is free for another registry.
  m->StopServing();
  EXPECT_EQ(m->port(), -1);
  EXPECT_TRUE(Metrics::Create(again).ok());
}

TEST(Metrics, RecordsFromManyThreadsAtOnce) {
  // Sinks are called from issuing, waiting and progress threads at once,
  // while a scrape serializes.
  auto m = Make();
  const int threads = 4, ops = 500;
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (int i = 0; i < ops; ++i) {
        m->sink()->OnCompleted(Completed(OpKind::kAllReduce, t % 2 ? "dp" : "tp", 2, 10, 10,
                                         DataType::kFloat32, 1000));
        m->RecordStep({absl::Microseconds(10), 1});
      }
    });
  }
  std::thread scraper([&] {
    for (int i = 0; i < 50; ++i) (void)m->Serialize();
  });
  for (auto& th : pool) th.join();
  scraper.join();
  auto s = Samples(m->Serialize());
  for (const char* g : {"dp", "tp"}) {
    const std::string labels =
        absl::StrCat("{job=\"strata\",rank=\"0\",group=\"", g, "\",op=\"all_reduce\"}");
    EXPECT_EQ(s.at("strata_collective_bytes_total" + labels), threads / 2 * ops * 40.0);
    // Every duration reached the histogram, scrapes in between or not.
    EXPECT_EQ(s.at("strata_collective_duration_seconds_count" + labels), threads / 2 * ops);
    EXPECT_NEAR(s.at("strata_collective_duration_seconds_sum" + labels), threads / 2 * ops * 1e-6,
                1e-12);
  }
  EXPECT_EQ(m->totals().steps, threads * ops);
}

// A duration lands in the first bucket whose bound is >= it (Prometheus'
// "le"), bounds included, and the buckets add up across scrapes.
TEST(Metrics, CollectiveDurationsLandInTheirLeBucket) {
  MetricsOptions o;
  o.collective_buckets = {0.001, 0.002, 0.004};
  auto m = Make(o);
  const std::vector<int64_t> nanos = {500'000,   1'000'000, 1'000'001, 2'000'000,
                                      3'000'000, 4'000'000, 5'000'000};
  auto comm = Completed(OpKind::kAllGather, "tp", 2, 8, 16, DataType::kFloat32, 0).comm;
  const std::string labels = "{job=\"strata\",rank=\"0\",group=\"tp\",op=\"all_gather\"";
  for (size_t i = 0; i < nanos.size(); ++i) {
    OpRecord r = Completed(OpKind::kAllGather, "tp", 2, 8, 16, DataType::kFloat32, nanos[i]);
    r.comm = comm;  // one communicator, as in a run
    m->sink()->OnCompleted(r);
    if (i == 2) (void)m->Serialize();  // a scrape in between
  }
  auto s = Samples(m->Serialize());
  double sum = 0;
  for (int64_t ns : nanos) sum += static_cast<double>(ns) * 1e-9;
  for (double bound : o.collective_buckets) {
    const double expected =
        static_cast<double>(std::count_if(nanos.begin(), nanos.end(), [&](int64_t ns) {
          return static_cast<double>(ns) * 1e-9 <= bound;
        }));
    std::ostringstream le;
    le << bound;
    EXPECT_EQ(
        s.at("strata_collective_duration_seconds_bucket" + labels + ",le=\"" + le.str() + "\"}"),
        expected)
        << bound;
  }
  EXPECT_EQ(s.at("strata_collective_duration_seconds_bucket" + labels + ",le=\"+Inf\"}"),
            nanos.size());
  EXPECT_EQ(s.at("strata_collective_duration_seconds_count" + labels + "}"), nanos.size());
  EXPECT_NEAR(s.at("strata_collective_duration_seconds_sum" + labels + "}"), sum, 1e-12);
}

// More registries on one communicator than it has slots for (SinkSlots):
// the ones without a slot look their series up by name and count the same.
TEST(Metrics, MoreRegistriesThanACommunicatorHasSlotsFor) {
  std::vector<std::unique_ptr<Metrics>> registries;
  std::vector<std::shared_ptr<OpSink>> sinks;
  for (int i = 0; i < SinkSlots::kSlots + 2; ++i) {
    registries.push_back(Make());
    sinks.push_back(registries.back()->sink());
  }
  std::shared_ptr<OpSink> all = MakeFanOutSink(sinks);
  OpRecord r = Completed(OpKind::kAllReduce, "dp", 4, 256, 256, DataType::kFloat32, 2000);
  const int ops = 10;
  for (int i = 0; i < ops; ++i) {
    all->OnCompleted(r);
    all->OnWaited(*r.comm, r.kind, 1000);
  }
  for (const auto& m : registries) {
    auto s = Samples(m->Serialize());
    const std::string jr = "job=\"strata\",rank=\"0\",group=\"dp\"";
    EXPECT_EQ(s.at("strata_collective_bytes_total{" + jr + ",op=\"all_reduce\"}"), ops * 256 * 4.0);
    EXPECT_EQ(s.at("strata_collective_duration_seconds_count{" + jr + ",op=\"all_reduce\"}"), ops);
    EXPECT_NEAR(s.at("strata_collective_wait_seconds_total{" + jr + "}"), ops * 1e-6, 1e-12);
  }
}

}  // namespace
}  // namespace strata::observe
