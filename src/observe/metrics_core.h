// The state behind strata::observe::Metrics (strata/observe/metrics.h),
// shared by the Metrics object and the OpSink it hands to communicators, so
// that a communicator outliving its Metrics still records into live memory.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "strata/observe/metrics.h"

namespace strata::observe::metrics_internal {

// One {group, op} of the collective families.
struct CollectiveSeries {
  prometheus::Histogram* duration = nullptr;
  prometheus::Counter* bytes = nullptr;
  prometheus::Gauge* busbw = nullptr;
  double bytes_total = 0;
  double seconds_total = 0;
};

enum class CustomKind { kCounter, kGauge, kHistogram };

struct Core {
  MetricsOptions options;
  std::string file;
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  prometheus::Labels base;  // job, rank

  prometheus::Histogram* step = nullptr;
  prometheus::Gauge* tokens_per_second = nullptr;
  prometheus::Gauge* mfu = nullptr;
  prometheus::Histogram* data_wait = nullptr;
  prometheus::Histogram* step_compute = nullptr;
  prometheus::Family<prometheus::Counter>* collective_wait = nullptr;
  prometheus::Family<prometheus::Histogram>* collective_duration = nullptr;
  prometheus::Family<prometheus::Counter>* collective_bytes = nullptr;
  prometheus::Family<prometheus::Gauge>* collective_busbw = nullptr;
  prometheus::Histogram* checkpoint_blocked = nullptr;
  prometheus::Counter* checkpoint_write_bytes = nullptr;
  prometheus::Counter* recoveries = nullptr;
  prometheus::Family<prometheus::Counter>* evictions = nullptr;
  prometheus::Family<prometheus::Counter>* comm_errors = nullptr;
  std::vector<double> collective_buckets;

  std::mutex mu;
  double flops_per_token = 0;
  double peak_flops = 0;
  std::map<std::pair<std::string, int>, CollectiveSeries> collectives;
  std::map<std::string, prometheus::Counter*> waits;  // by group
  // Every Work::Wait's blocked time so far (CollectiveWaitSeconds).
  std::atomic<int64_t> wait_ns_total{0};
  // Every family name registered, builtin or custom, with its kind (builtins
  // are never custom, so any clash is refused).
  std::map<std::string, CustomKind> custom_kinds;
  std::map<std::string, void*> custom_families;
  std::map<std::string, bool> builtin_names;
  // Totals, and the figures since the last ClusterSample().
  Metrics::Totals totals;
  struct Window {
    int64_t steps = 0;
    double step_seconds = 0;
    double tokens = 0;
    double data_wait_seconds = 0;
    double collective_seconds = 0;
    double checkpoint_blocked_seconds = 0;
    double compute_seconds = 0;
    double collective_wait_seconds = 0;
  };
  Window window;
  std::vector<double> last_sample;
  // The cluster view's gauges, made on the first SetClusterView.
  std::vector<prometheus::Family<prometheus::Gauge>*> cluster_stats;
  std::vector<prometheus::Gauge*> cluster_max_rank;

  // Called by the sink.
  void OnCompleted(const OpRecord& record);
  void OnWaited(const CommRecord& comm, int64_t waited_ns);
};

// Registers the builtin families on `core` (Create).
void RegisterBuiltins(Core& core);

// The OpSink of a Core.
std::shared_ptr<OpSink> MakeSink(std::shared_ptr<Core> core);

absl::Status CheckOptions(const MetricsOptions& options);
absl::Status CheckMfu(double flops_per_token, double peak_flops);

}  // namespace strata::observe::metrics_internal

namespace strata::observe {

class Metrics::Impl {
 public:
  std::shared_ptr<metrics_internal::Core> core;
  std::shared_ptr<OpSink> sink;
  std::mutex mu;  // guards exposer and port (StopServing)
  // Declared last: destroyed first, so no scrape runs while the rest goes.
  std::unique_ptr<prometheus::Exposer> exposer;
  int port = -1;
};

}  // namespace strata::observe
