// The metrics registry: families, steps, collectives (strata/observe/
// metrics.h). Export (text, file, HTTP), MFU peaks and the cluster view are
// in metrics_export.cc.
#include "strata/observe/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "observe/metrics_core.h"
#include "prometheus/check_names.h"
#include "strata/version.h"

namespace strata::observe {
namespace metrics_internal {
namespace {

std::vector<double> Doubling(double first, int n) {
  std::vector<double> b;
  for (int i = 0; i < n; ++i) b.push_back(first * std::ldexp(1.0, i));
  return b;
}

absl::Status CheckBuckets(const std::vector<double>& buckets, absl::string_view what) {
  for (size_t i = 0; i < buckets.size(); ++i) {
    if (!std::isfinite(buckets[i]) || (i > 0 && buckets[i] <= buckets[i - 1])) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " must be finite and increasing; bucket ", i, " is ", buckets[i],
                       i > 0 ? absl::StrCat(" after ", buckets[i - 1]) : std::string()));
    }
  }
  return absl::OkStatus();
}

// nccl-tests' "size" of an operation, in bytes, and its busbw factor.
double MessageBytes(const OpRecord& r) {
  const double elem = static_cast<double>(DataTypeSize(r.dtype));
  switch (r.kind) {
    case OpKind::kAllGather:
    case OpKind::kRecv:  // a receive has only an output buffer
      return elem * static_cast<double>(r.output_count);
    default:
      return elem * static_cast<double>(r.input_count);
  }
}

double BusBwFactor(OpKind kind, int n) {
  if (n <= 1) return 1.0;
  switch (kind) {
    case OpKind::kAllReduce:
      return 2.0 * (n - 1) / n;
    case OpKind::kAllGather:
    case OpKind::kReduceScatter:
    case OpKind::kAllToAll:
    case OpKind::kAllToAllV:
      return static_cast<double>(n - 1) / n;
    default:
      return 1.0;
  }
}

class Sink : public OpSink {
 public:
  explicit Sink(std::shared_ptr<Core> core) : core_(std::move(core)) {}
  void OnScheduled(const OpRecord&) override {}
  void OnCompleted(const OpRecord& record) override { core_->OnCompleted(record); }
  void OnWaited(const CommRecord& comm, OpKind, int64_t waited_ns) override {
    core_->OnWaited(comm, waited_ns);
  }

 private:
  const std::shared_ptr<Core> core_;
};

}  // namespace

PendingHistogram::PendingHistogram(prometheus::Histogram* target, const std::vector<double>* bounds)
    : target_(target),
      bounds_(*bounds),
      counts_(std::make_unique<std::atomic<uint64_t>[]>(bounds->size() + 1)) {}

void PendingHistogram::ObserveNanos(int64_t ns) {
  const double seconds = static_cast<double>(ns) * 1e-9;
  // prometheus-cpp's bucket: the first bound >= the value (le), else +Inf.
  const size_t i = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), seconds) -
                                       bounds_.begin());
  counts_[i].fetch_add(1, std::memory_order_relaxed);
  sum_ns_.fetch_add(ns, std::memory_order_relaxed);
}

void PendingHistogram::Flush() {
  std::vector<double> increments(bounds_.size() + 1);
  bool any = false;
  for (size_t i = 0; i < increments.size(); ++i) {
    const uint64_t n = counts_[i].exchange(0, std::memory_order_relaxed);
    increments[i] = static_cast<double>(n);
    any = any || n != 0;
  }
  const int64_t sum_ns = sum_ns_.exchange(0, std::memory_order_relaxed);
  if (any || sum_ns != 0) target_->ObserveMultiple(increments, static_cast<double>(sum_ns) * 1e-9);
}

GroupSeries& Core::Group(const CommRecord* comm) {
  if (comm != nullptr) {
    if (void* found = comm->sink_slots.Find(this)) return *static_cast<GroupSeries*>(found);
  }
  // The communicator's first operation seen here (or no slot was free):
  // by name, once.
  std::lock_guard<std::mutex> lock(mu);
  std::unique_ptr<GroupSeries>& g = groups[comm != nullptr ? comm->name : std::string()];
  if (g == nullptr) g = std::make_unique<GroupSeries>();
  if (comm != nullptr) comm->sink_slots.Attach(this, g.get());
  return *g;
}

void Core::OnCompleted(const OpRecord& r) {
  if (r.kind == OpKind::kSplit || r.kind == OpKind::kShrink) return;
  if (!r.status.ok()) {
    comm_errors->Add({{"backend", r.comm != nullptr ? r.comm->backend : std::string("unknown")}})
        .Increment();
    return;
  }
  const int64_t ns =
      r.time_completed_ns > r.time_created_ns ? r.time_completed_ns - r.time_created_ns : 0;
  GroupSeries& g = Group(r.comm.get());
  const int kind = static_cast<int>(r.kind);
  CollectiveSeries* s = g.ops[kind].load(std::memory_order_acquire);
  if (s == nullptr) {
    std::lock_guard<std::mutex> lock(mu);
    s = g.ops[kind].load(std::memory_order_relaxed);
    if (s == nullptr) {
      const std::string group = r.comm != nullptr ? r.comm->name : std::string();
      std::unique_ptr<CollectiveSeries>& owned = collectives[{group, kind}];
      if (owned == nullptr) {
        prometheus::Labels labels{{"group", group}, {"op", OpKindName(r.kind)}};
        owned = std::make_unique<CollectiveSeries>(
            &collective_duration->Add(labels, collective_buckets), &collective_bytes->Add(labels),
            &collective_busbw->Add(labels), &collective_buckets);
      }
      s = owned.get();
      g.ops[kind].store(s, std::memory_order_release);
    }
  }
  const double bytes = MessageBytes(r);
  s->duration.ObserveNanos(ns);
  s->bytes->Increment(bytes);
  const uint64_t bytes_total =
      s->bytes_total.fetch_add(static_cast<uint64_t>(bytes), std::memory_order_relaxed) +
      static_cast<uint64_t>(bytes);
  const int64_t ns_total = s->ns_total.fetch_add(ns, std::memory_order_relaxed) + ns;
  if (ns_total > 0) {
    s->busbw->Set(static_cast<double>(bytes_total) / (static_cast<double>(ns_total) * 1e-9) *
                  BusBwFactor(r.kind, r.comm != nullptr ? r.comm->size : 1));
  }
  window_collective_ns.fetch_add(ns, std::memory_order_relaxed);
}

void Core::OnWaited(const CommRecord& comm, int64_t waited_ns) {
  if (waited_ns <= 0) return;
  wait_ns_total.fetch_add(waited_ns, std::memory_order_relaxed);
  GroupSeries& g = Group(&comm);
  prometheus::Counter* counter = g.wait.load(std::memory_order_acquire);
  if (counter == nullptr) {
    std::lock_guard<std::mutex> lock(mu);
    counter = g.wait.load(std::memory_order_relaxed);
    if (counter == nullptr) {
      counter = &collective_wait->Add({{"group", comm.name}});
      g.wait.store(counter, std::memory_order_release);
    }
  }
  counter->Increment(static_cast<double>(waited_ns) * 1e-9);
}

void Core::Flush() {
  std::lock_guard<std::mutex> lock(mu);
  for (auto& [key, series] : collectives) series->duration.Flush();
}

std::vector<prometheus::MetricFamily> Core::Collect() {
  Flush();
  return registry->Collect();
}

std::vector<prometheus::MetricFamily> CoreCollectable::Collect() const {
  std::shared_ptr<Core> core = core_.lock();
  if (core == nullptr) return {};
  return core->Collect();
}

void RegisterBuiltins(Core& c) {
  auto& reg = *c.registry;
  const auto& base = c.base;
  std::vector<double> step_buckets =
      c.options.step_buckets.empty() ? Doubling(1e-3, 18) : c.options.step_buckets;
  c.collective_buckets =
      c.options.collective_buckets.empty() ? Doubling(1e-5, 24) : c.options.collective_buckets;
  c.step = &prometheus::BuildHistogram()
                .Name("strata_step_duration_seconds")
                .Help("Duration of one training step")
                .Labels(base)
                .Register(reg)
                .Add({}, step_buckets);
  c.tokens_per_second = &prometheus::BuildGauge()
                             .Name("strata_tokens_per_second")
                             .Help("Tokens per second of the last step")
                             .Labels(base)
                             .Register(reg)
                             .Add({});
  c.mfu = &prometheus::BuildGauge()
               .Name("strata_mfu_ratio")
               .Help("Model FLOPs utilisation of the last step (achieved / peak FLOP/s, 0-1)")
               .Labels(base)
               .Register(reg)
               .Add({});
  c.data_wait = &prometheus::BuildHistogram()
                     .Name("strata_data_wait_seconds")
                     .Help("Time a step waited for its input data")
                     .Labels(base)
                     .Register(reg)
                     .Add({}, step_buckets);
  c.step_compute = &prometheus::BuildHistogram()
                        .Name("strata_step_compute_seconds")
                        .Help(
                            "Step time minus the time the step was blocked waiting for "
                            "collectives (Work::Wait): this rank's own work")
                        .Labels(base)
                        .Register(reg)
                        .Add({}, step_buckets);
  c.collective_wait = &prometheus::BuildCounter()
                           .Name("strata_collective_wait_seconds_total")
                           .Help("Time callers were blocked waiting for operations to complete")
                           .Labels(base)
                           .Register(reg);
  c.collective_duration =
      &prometheus::BuildHistogram()
           .Name("strata_collective_duration_seconds")
           .Help("Collective and point-to-point operations, issue to completion")
           .Labels(base)
           .Register(reg);
  c.collective_bytes = &prometheus::BuildCounter()
                            .Name("strata_collective_bytes_total")
                            .Help("Message bytes of completed operations (nccl-tests' size)")
                            .Labels(base)
                            .Register(reg);
  c.collective_busbw =
      &prometheus::BuildGauge()
           .Name("strata_collective_busbw_bytes_per_second")
           .Help("Bus bandwidth (nccl-tests factors) over all completed operations")
           .Labels(base)
           .Register(reg);
  c.checkpoint_blocked = &prometheus::BuildHistogram()
                              .Name("strata_checkpoint_blocked_seconds")
                              .Help("Time training was blocked by a checkpoint save")
                              .Labels(base)
                              .Register(reg)
                              .Add({}, step_buckets);
  c.checkpoint_write_bytes = &prometheus::BuildCounter()
                                  .Name("strata_checkpoint_write_bytes_total")
                                  .Help("Bytes written by checkpoint saves")
                                  .Labels(base)
                                  .Register(reg)
                                  .Add({});
  c.recoveries = &prometheus::BuildCounter()
                      .Name("strata_recoveries_total")
                      .Help("In-process recoveries from failed ranks")
                      .Labels(base)
                      .Register(reg)
                      .Add({});
  c.evictions = &prometheus::BuildCounter()
                     .Name("strata_evictions_total")
                     .Help("Ranks evicted, by reason")
                     .Labels(base)
                     .Register(reg);
  c.comm_errors = &prometheus::BuildCounter()
                       .Name("strata_comm_errors_total")
                       .Help("Communication operations that ended in an error, by backend")
                       .Labels(base)
                       .Register(reg);
  BuildInfo info = GetBuildInfo();
  auto yes = [](bool b) { return std::string(b ? "1" : "0"); };
  prometheus::BuildGauge()
      .Name("strata_build_info")
      .Help("strata's version and compiled-in backends (value 1)")
      .Labels(base)
      .Register(reg)
      .Add({{"version", info.version},
            {"cuda", yes(info.cuda)},
            {"nccl", yes(info.nccl)},
            {"mpi", yes(info.mpi)},
            {"gloo", yes(info.gloo)}})
      .Set(1);
  std::lock_guard<std::mutex> lock(c.mu);
  for (const char* n :
       {"strata_step_duration_seconds", "strata_tokens_per_second", "strata_mfu_ratio",
        "strata_data_wait_seconds", "strata_collective_duration_seconds",
        "strata_collective_bytes_total", "strata_collective_busbw_bytes_per_second",
        "strata_checkpoint_blocked_seconds", "strata_checkpoint_write_bytes_total",
        "strata_recoveries_total", "strata_evictions_total", "strata_comm_errors_total",
        "strata_build_info"}) {
    c.builtin_names[n] = true;
  }
}

std::shared_ptr<OpSink> MakeSink(std::shared_ptr<Core> core) {
  return std::make_shared<Sink>(std::move(core));
}

absl::Status CheckMfu(double flops_per_token, double peak_flops) {
  if (!std::isfinite(flops_per_token) || flops_per_token < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("flops_per_token must be >= 0, got ", flops_per_token));
  }
  if (!std::isfinite(peak_flops) || peak_flops < 0) {
    return absl::InvalidArgumentError(absl::StrCat("peak_flops must be >= 0, got ", peak_flops));
  }
  if (flops_per_token > 0 && peak_flops == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("flops_per_token is ", flops_per_token,
                     " but peak_flops is 0: MFU needs the device's peak (PeakFlopsForDevice, "
                     "MeasureCpuGemmPeak)"));
  }
  return absl::OkStatus();
}

absl::Status CheckOptions(const MetricsOptions& o) {
  if (o.version != MetricsOptions::kVersion) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MetricsOptions version ", o.version, " is not this library's ", MetricsOptions::kVersion));
  }
  if (o.rank < 0)
    return absl::InvalidArgumentError(absl::StrCat("rank must be >= 0, got ", o.rank));
  if (o.port < -1 || o.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("port must be -1 (none), 0 (any) or 1..65535, got ", o.port));
  }
  if (o.job.empty()) return absl::InvalidArgumentError("job must not be empty");
  if (absl::Status s = CheckBuckets(o.step_buckets, "step_buckets"); !s.ok()) return s;
  if (absl::Status s = CheckBuckets(o.collective_buckets, "collective_buckets"); !s.ok()) return s;
  return CheckMfu(o.flops_per_token, o.peak_flops);
}

}  // namespace metrics_internal

using metrics_internal::Core;
using metrics_internal::CustomKind;

absl::Status ApplyMetricsSettings(const Settings& settings, int local_rank,
                                  MetricsOptions* options) {
  if (options->port == -1 && !settings.metrics_port.empty()) {
    int port = 0;
    if (!absl::SimpleAtoi(settings.metrics_port, &port) || port < 0 || port > 65535) {
      return absl::InvalidArgumentError(absl::StrCat(
          "STRATA_METRICS_PORT='", settings.metrics_port,
          "' is not a port (0..65535; 0 lets the OS pick); see docs/observability.md"));
    }
    if (port > 0 && port + local_rank > 65535) {
      return absl::InvalidArgumentError(absl::StrCat("STRATA_METRICS_PORT=", port, " + local rank ",
                                                     local_rank, " is past 65535"));
    }
    options->port = port > 0 ? port + local_rank : 0;
  }
  if (options->file.empty()) options->file = settings.metrics_file;
  return absl::OkStatus();
}

Metrics::Metrics(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

const MetricsOptions& Metrics::options() const { return impl_->core->options; }
const std::string& Metrics::file() const { return impl_->core->file; }
std::shared_ptr<OpSink> Metrics::sink() { return impl_->sink; }

void Metrics::RecordStep(const StepSample& step) {
  Core& c = *impl_->core;
  const double seconds = absl::ToDoubleSeconds(step.duration);
  c.step->Observe(seconds);
  if (step.data_wait > absl::ZeroDuration())
    c.data_wait->Observe(absl::ToDoubleSeconds(step.data_wait));
  const double waited = std::min(seconds, absl::ToDoubleSeconds(step.collective_wait));
  const double compute = std::max(0.0, seconds - std::max(0.0, waited));
  c.step_compute->Observe(compute);
  std::lock_guard<std::mutex> lock(c.mu);
  c.totals.steps += 1;
  c.totals.step_seconds += seconds;
  c.totals.last_step_seconds = seconds;
  c.window.steps += 1;
  c.window.step_seconds += seconds;
  c.window.tokens += static_cast<double>(step.tokens);
  c.window.data_wait_seconds += absl::ToDoubleSeconds(step.data_wait);
  c.window.compute_seconds += compute;
  c.window.collective_wait_seconds += seconds - compute;
  if (step.tokens > 0 && seconds > 0) {
    const double tps = static_cast<double>(step.tokens) / seconds;
    c.totals.tokens_per_second = tps;
    c.tokens_per_second->Set(tps);
    if (c.flops_per_token > 0) {
      c.totals.mfu = tps * c.flops_per_token / c.peak_flops;
      c.mfu->Set(c.totals.mfu);
    }
  }
}

void Metrics::RecordCheckpointBlocked(absl::Duration blocked) {
  Core& c = *impl_->core;
  c.checkpoint_blocked->Observe(absl::ToDoubleSeconds(blocked));
  std::lock_guard<std::mutex> lock(c.mu);
  c.window.checkpoint_blocked_seconds += absl::ToDoubleSeconds(blocked);
}

void Metrics::RecordCheckpointWrite(int64_t bytes) {
  if (bytes > 0) impl_->core->checkpoint_write_bytes->Increment(static_cast<double>(bytes));
}
void Metrics::RecordRecovery() { impl_->core->recoveries->Increment(); }
void Metrics::RecordEviction(absl::string_view reason) {
  impl_->core->evictions->Add({{"reason", std::string(reason)}}).Increment();
}

absl::Status Metrics::SetMfu(double flops_per_token, double peak_flops) {
  if (absl::Status s = metrics_internal::CheckMfu(flops_per_token, peak_flops); !s.ok()) return s;
  Core& c = *impl_->core;
  std::lock_guard<std::mutex> lock(c.mu);
  c.flops_per_token = flops_per_token;
  c.peak_flops = peak_flops;
  return absl::OkStatus();
}

namespace {

// The family of custom metric `name` of `kind`, registered on first use.
template <typename T>
absl::StatusOr<prometheus::Family<T>*> CustomFamily(Core& c, absl::string_view name_view,
                                                    absl::string_view help, CustomKind kind,
                                                    prometheus::detail::Builder<T> builder) {
  std::string name(name_view);
  if (!prometheus::CheckMetricName(name)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", name, "' is not a Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*, not __*)"));
  }
  if (c.builtin_names.count(name)) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", name, "' is one of strata's own metrics; pick another name"));
  }
  auto it = c.custom_kinds.find(name);
  if (it != c.custom_kinds.end()) {
    if (it->second != kind) {
      static const char* kNames[] = {"counter", "gauge", "histogram"};
      return absl::InvalidArgumentError(absl::StrCat("metric '", name, "' is a ",
                                                     kNames[static_cast<int>(it->second)],
                                                     ", not a ", kNames[static_cast<int>(kind)]));
    }
    return static_cast<prometheus::Family<T>*>(c.custom_families[name]);
  }
  auto* family = &builder.Name(name).Help(std::string(help)).Labels(c.base).Register(*c.registry);
  c.custom_kinds[name] = kind;
  c.custom_families[name] = family;
  return family;
}

}  // namespace

absl::Status Metrics::CounterAdd(absl::string_view name, absl::string_view help, double value) {
  if (!(value >= 0) || !std::isfinite(value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("counter '", name, "' can only go up; got an increment of ", value));
  }
  Core& c = *impl_->core;
  std::lock_guard<std::mutex> lock(c.mu);
  auto f = CustomFamily(c, name, help, CustomKind::kCounter, prometheus::BuildCounter());
  if (!f.ok()) return f.status();
  (*f)->Add({}).Increment(value);
  return absl::OkStatus();
}

absl::Status Metrics::GaugeSet(absl::string_view name, absl::string_view help, double value) {
  Core& c = *impl_->core;
  std::lock_guard<std::mutex> lock(c.mu);
  auto f = CustomFamily(c, name, help, CustomKind::kGauge, prometheus::BuildGauge());
  if (!f.ok()) return f.status();
  (*f)->Add({}).Set(value);
  return absl::OkStatus();
}

absl::Status Metrics::HistogramObserve(absl::string_view name, absl::string_view help,
                                       const std::vector<double>& buckets, double value) {
  if (absl::Status s =
          metrics_internal::CheckBuckets(buckets, absl::StrCat("buckets of '", name, "'"));
      !s.ok()) {
    return s;
  }
  if (buckets.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("histogram '", name, "' needs buckets"));
  }
  Core& c = *impl_->core;
  std::lock_guard<std::mutex> lock(c.mu);
  auto f = CustomFamily(c, name, help, CustomKind::kHistogram, prometheus::BuildHistogram());
  if (!f.ok()) return f.status();
  // Add returns the existing histogram for the same labels: its buckets win.
  (*f)->Add({}, buckets).Observe(value);
  return absl::OkStatus();
}

double Metrics::CollectiveWaitSeconds() const {
  return static_cast<double>(impl_->core->wait_ns_total.load(std::memory_order_relaxed)) * 1e-9;
}

Metrics::Totals Metrics::totals() const {
  Core& c = *impl_->core;
  std::lock_guard<std::mutex> lock(c.mu);
  return c.totals;
}

}  // namespace strata::observe
