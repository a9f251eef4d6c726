// Metrics: a rank's training and communication figures, in Prometheus form.
//
// A Metrics object holds one Prometheus registry (prometheus-cpp) with the
// families below, every series labelled with `job` and `rank`, and nothing
// of higher cardinality (no step numbers, no peers):
//
//   strata_step_duration_seconds               histogram  one per Step()
//   strata_tokens_per_second                   gauge      tokens / duration of the last step
//   strata_mfu_ratio                           gauge      last step: achieved FLOP/s / peak (0-1)
//   strata_data_wait_seconds                   histogram  time a step waited for its data
//   strata_step_compute_seconds                histogram  step time minus time blocked in Wait
//   strata_collective_wait_seconds_total{group}  counter  time blocked in Work::Wait
//   strata_collective_duration_seconds{group,op}  histogram  issue -> completion of each op
//   strata_collective_bytes_total{group,op}    counter    message size (nccl-tests' "size")
//   strata_collective_busbw_bytes_per_second{group,op}  gauge  nccl-tests bus bandwidth
//   strata_checkpoint_blocked_seconds          histogram  time training waited on a save
//   strata_checkpoint_write_bytes_total        counter
//   strata_recoveries_total                    counter
//   strata_evictions_total{reason}             counter
//   strata_comm_errors_total{backend}          counter    operations that ended in an error
//   strata_build_info{version,cuda,nccl,mpi,gloo}  gauge (1)
//
// Collective figures come from the communicators: sink() is an OpSink
// (strata/observe/op_record.h) to name in CommOptions::sink (children
// inherit it), so every backend is measured in one place. The message size
// of an operation is nccl-tests' "size": the buffer of an all-reduce,
// broadcast, reduce, send or recv (its output count); the gathered output of an all-gather;
// the input of a reduce-scatter; the send total of an all-to-all. The bus
// bandwidth gauge is size_total / duration_total x the nccl-tests factor
// (2(n-1)/n for all-reduce, (n-1)/n for all-gather, reduce-scatter and
// all-to-all, 1 otherwise), so for a loop of one size it is the busbw
// nccl-tests reports for that size.
//
// Export: Serialize() gives the text exposition format 0.0.4 (prometheus-
// cpp's TextSerializer, no timestamps); WriteFile() writes it atomically
// (a temporary file beside the target, then rename) for node_exporter's
// textfile collector; MetricsOptions::port serves it over HTTP
// (prometheus-cpp's Exposer) at /metrics.
//
// Cluster view: ClusterSample() is a fixed-size vector of this rank's
// figures; whoever gathers the samples of every rank (Python's
// strata.metrics does it with one all-gather over the world) hands them to
// SetClusterView() on rank 0, which publishes min / median / p95 / max per
// figure and the rank holding the max as strata_cluster_* gauges. Its cost
// depends on the number of ranks, not of steps.
//
//   strata::observe::MetricsOptions o;
//   o.rank = env.rank; o.file = "/var/lib/node_exporter/strata-{rank}.prom";
//   o.flops_per_token = 6.0 * n_params;
//   absl::StatusOr<std::unique_ptr<Metrics>> m = Metrics::Create(o);
//   root_options.comm.sink = (*m)->sink();
//   ... (*m)->RecordStep({.duration = d, .tokens = n});  (*m)->WriteFile();
//
// Thread-safety: every method may be called from any thread at once. The
// sink takes a lock only for the first operation of a {group, op} (to make
// its series); after that an operation costs a few atomic operations: the
// communicator's series are found through CommRecord::sink_slots, and
// collective durations are counted in atomics that Serialize (and a
// scrape) hand to the histograms first.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "strata/base/export.h"
#include "strata/base/settings.h"
#include "strata/observe/op_record.h"

namespace strata::observe {

struct STRATA_EXPORT MetricsOptions {
  static constexpr int kVersion = 1;
  int version = kVersion;
  // The `job` and `rank` labels of every series.
  std::string job = "strata";
  int rank = 0;
  // Serve the exposition over HTTP at http://<bind_address>:<port>/metrics:
  // -1 not at all, 0 on a port the OS picks (Metrics::port() says which).
  int port = -1;
  std::string bind_address = "127.0.0.1";
  // Where WriteFile() writes (".prom" for node_exporter); "{rank}" is
  // replaced by the rank. "" : nowhere.
  std::string file;
  // FLOPs one token costs (forward + backward); 0: strata_mfu_ratio is not
  // reported. peak_flops: the device's peak FLOP/s; 0 with flops_per_token
  // set is an error (PeakFlopsForDevice / MeasureCpuGemmPeak give one).
  double flops_per_token = 0;
  double peak_flops = 0;
  // Histogram bucket upper bounds (seconds); empty: the defaults
  // (steps: 1 ms .. ~2 min by x2; collectives: 10 us .. ~80 s by x2).
  std::vector<double> step_buckets;
  std::vector<double> collective_buckets;
};

// Applies STRATA_METRICS_PORT and STRATA_METRICS_FILE from `settings` to
// `options` where the options leave them unset (port -1, file ""). Ranks
// sharing a host serve on port + local_rank (port 0 stays 0: each its own).
// A port that is not an integer in 0..65535 is InvalidArgument naming the
// variable.
STRATA_EXPORT absl::Status ApplyMetricsSettings(const Settings& settings, int local_rank,
                                                MetricsOptions* options);

// One training step.
struct STRATA_EXPORT StepSample {
  absl::Duration duration;
  int64_t tokens = 0;                               // 0: no tokens/s or MFU for it
  absl::Duration data_wait = absl::ZeroDuration();  // recorded when > 0
  // Time the step was blocked in Work::Wait (the difference of two
  // CollectiveWaitSeconds() around it); the step's compute time is the
  // rest: strata_step_compute_seconds and the straggler report.
  absl::Duration collective_wait = absl::ZeroDuration();
};

// Peak dense BF16 FLOP/s (tensor cores, no sparsity) of a GPU named as
// CUDA names it ("NVIDIA H100 80GB HBM3"); NotFound for a device the table
// does not hold. The table is in metrics.cc with its sources.
STRATA_EXPORT absl::StatusOr<double> PeakFlopsForDevice(absl::string_view device_name);
// The FP32 GEMM rate this process reaches on the CPU (OpenBLAS sgemm of
// n x n, repeated for about `duration`): the CPU's "peak" for MFU.
STRATA_EXPORT double MeasureCpuGemmPeak(int n = 512,
                                        absl::Duration duration = absl::Milliseconds(200));

// The figures of the cluster view, in ClusterSample() order.
STRATA_EXPORT const std::vector<std::string>& ClusterFigureNames();

class STRATA_EXPORT Metrics {
 public:
  // InvalidArgument for a bad option (rank < 0, port outside -1..65535,
  // buckets not increasing, flops_per_token without peak_flops);
  // Unavailable when the port cannot be bound (naming it).
  static absl::StatusOr<std::unique_ptr<Metrics>> Create(const MetricsOptions& options);
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  const MetricsOptions& options() const;
  // The HTTP port served on; -1 when not serving.
  int port() const;
  // Stops serving over HTTP (joining the server's threads; the port is
  // free when it returns). Recording and the file go on. Idempotent.
  void StopServing();
  // The file WriteFile() writes ({rank} replaced); "" when none.
  const std::string& file() const;

  // The sink to name in CommOptions::sink.
  std::shared_ptr<OpSink> sink();

  void RecordStep(const StepSample& step);
  void RecordCheckpointBlocked(absl::Duration blocked);
  void RecordCheckpointWrite(int64_t bytes);
  void RecordRecovery();
  void RecordEviction(absl::string_view reason);
  // Sets the FLOPs per token (and peak) from now on; same checks as Create.
  absl::Status SetMfu(double flops_per_token, double peak_flops);

  // Custom metrics, registered on first use with the job/rank labels.
  // InvalidArgument for a name Prometheus does not allow, a name of a
  // different kind already registered, or a negative counter increment.
  absl::Status CounterAdd(absl::string_view name, absl::string_view help, double value);
  absl::Status GaugeSet(absl::string_view name, absl::string_view help, double value);
  absl::Status HistogramObserve(absl::string_view name, absl::string_view help,
                                const std::vector<double>& buckets, double value);

  // The text exposition (format 0.0.4) of every family.
  std::string Serialize() const;
  // Writes Serialize() to file() atomically; OK without a file. Unavailable
  // (naming the path and errno) when the directory cannot be written.
  absl::Status WriteFile() const;

  // This rank's figures for the cluster view (ClusterFigureNames() order):
  // figures over the steps since the previous ClusterSample().
  std::vector<double> ClusterSample();
  // Publishes the cluster view from the samples of every rank (samples[r]
  // is rank r's). InvalidArgument when a sample has the wrong length.
  absl::Status SetClusterView(const std::vector<std::vector<double>>& samples);

  // Seconds callers of Work::Wait have been blocked so far, every group
  // of every communicator whose sink this is (for StepSample).
  double CollectiveWaitSeconds() const;

  // Cumulative figures for tests and summaries.
  struct Totals {
    int64_t steps = 0;
    double step_seconds = 0;
    double last_step_seconds = 0;
    double tokens_per_second = 0;
    double mfu = 0;
  };
  Totals totals() const;

  class Impl;

 private:
  explicit Metrics(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::observe
