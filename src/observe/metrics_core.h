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

#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"
#include "strata/observe/metrics.h"

namespace strata::observe::metrics_internal {

// Observations of one histogram not yet handed to its prometheus-cpp
// Histogram (whose Observe takes a mutex): a count per bucket and the sum
// in nanoseconds, in atomics, so recording one takes two atomic adds.
// Flush() moves them over (ObserveMultiple) before each collection.
class PendingHistogram {
 public:
  // `target` and `bounds` (seconds, increasing) outlive this.
  PendingHistogram(prometheus::Histogram* target, const std::vector<double>* bounds);
  void ObserveNanos(int64_t ns);
  // Hands what was observed since the last Flush to the target. One
  // flusher at a time (Core::mu); Observe may run at the same time (an
  // observation in flight lands in this flush or the next one).
  void Flush();

 private:
  prometheus::Histogram* const target_;
  const std::vector<double>& bounds_;
  const std::unique_ptr<std::atomic<uint64_t>[]> counts_;  // bounds + the +Inf bucket
  std::atomic<int64_t> sum_ns_{0};
};

// One {group, op} of the collective families, made on its first operation
// and never moved (the sink keeps pointers to it).
struct CollectiveSeries {
  CollectiveSeries(prometheus::Histogram* d, prometheus::Counter* b, prometheus::Gauge* bw,
                   const std::vector<double>* buckets)
      : duration(d, buckets), bytes(b), busbw(bw) {}
  PendingHistogram duration;
  prometheus::Counter* bytes = nullptr;
  prometheus::Gauge* busbw = nullptr;
  std::atomic<uint64_t> bytes_total{0};
  std::atomic<int64_t> ns_total{0};
};

constexpr int kOpKinds = static_cast<int>(OpKind::kShrink) + 1;

// The series of one group, found from a communicator's CommRecord
// (SinkSlots) without a lookup; each filled once, under Core::mu.
struct GroupSeries {
  std::atomic<CollectiveSeries*> ops[kOpKinds] = {};
  std::atomic<prometheus::Counter*> wait{nullptr};
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
  // By group name, then by op; the sink reaches them through GroupSeries.
  std::map<std::string, std::unique_ptr<GroupSeries>> groups;
  std::map<std::pair<std::string, int>, std::unique_ptr<CollectiveSeries>> collectives;
  // Every Work::Wait's blocked time so far (CollectiveWaitSeconds).
  std::atomic<int64_t> wait_ns_total{0};
  // Issue-to-completion time of the operations since the last
  // ClusterSample (folded into window.collective_seconds there).
  std::atomic<int64_t> window_collective_ns{0};
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
  // The series of `comm`'s group (`comm` may be null: the group "").
  GroupSeries& Group(const CommRecord* comm);
  // Hands pending histogram observations to the registry; before every
  // Collect of it.
  void Flush();
  // Flush(), then the registry's Collect.
  std::vector<prometheus::MetricFamily> Collect();
};

// What the HTTP exposer collects: the Core's Collect (flushing first).
class CoreCollectable : public prometheus::Collectable {
 public:
  explicit CoreCollectable(std::weak_ptr<Core> core) : core_(std::move(core)) {}
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const std::weak_ptr<Core> core_;
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
  std::shared_ptr<metrics_internal::CoreCollectable> collectable;
  // Declared last: destroyed first, so no scrape runs while the rest goes.
  std::unique_ptr<prometheus::Exposer> exposer;
  int port = -1;
};

}  // namespace strata::observe
