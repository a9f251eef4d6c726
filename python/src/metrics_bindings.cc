// Bindings for the metrics registry (strata/observe/metrics.h); the
// Pythonic layer (step markers, prometheus_client collector, MFU helpers)
// is python/strata/metrics.py. Also the opaque _OpSink a communicator's
// options take (strata.init(metrics=...) hands the registry's sink to the
// root communicator; children inherit it).
#include <pybind11/stl.h>

#include "registry.h"
#include "status_map.h"
#include "strata/base/settings.h"
#include "strata/observe/metrics.h"

namespace py = pybind11;

namespace strata::bindings {
namespace {

using observe::Metrics;
using observe::MetricsOptions;

std::unique_ptr<Metrics> CreateMetrics(const std::string& job, int rank, int local_rank,
                                       std::optional<int> port, const std::string& bind_address,
                                       std::optional<std::string> file, double flops_per_token,
                                       double peak_flops, std::vector<double> step_buckets,
                                       std::vector<double> collective_buckets,
                                       std::optional<std::map<std::string, std::string>> env) {
  MetricsOptions o;
  o.job = job;
  o.rank = rank;
  o.port = port.value_or(-1);
  o.bind_address = bind_address;
  o.file = file.value_or("");
  o.flops_per_token = flops_per_token;
  o.peak_flops = peak_flops;
  o.step_buckets = std::move(step_buckets);
  o.collective_buckets = std::move(collective_buckets);
  // Explicit arguments win; the variables fill what they leave unset (an
  // explicit file="" or port=None is "unset").
  Settings settings =
      Unwrap(env ? Settings::FromMap(*env) : Settings::FromEnvironment(), ErrorArea::kGeneric);
  ThrowIfError(observe::ApplyMetricsSettings(settings, local_rank, &o), ErrorArea::kGeneric);
  absl::StatusOr<std::unique_ptr<Metrics>> m;
  {
    py::gil_scoped_release release;
    m = Metrics::Create(o);
  }
  return Unwrap(std::move(m), ErrorArea::kGeneric);
}

Registration reg(kOrderBase, [](py::module_& m) {
  py::class_<observe::OpSink, std::shared_ptr<observe::OpSink>>(
      m, "_OpSink", "Where a communicator records its operations (opaque).");

  py::class_<Metrics>(m, "_Metrics")
      .def(py::init(&CreateMetrics), py::arg("job"), py::arg("rank"), py::arg("local_rank"),
           py::arg("port"), py::arg("bind_address"), py::arg("file"), py::arg("flops_per_token"),
           py::arg("peak_flops"), py::arg("step_buckets"), py::arg("collective_buckets"),
           py::arg("env"))
      .def_property_readonly("port", &Metrics::port)
      .def_property_readonly("file", &Metrics::file)
      .def_property_readonly("job", [](const Metrics& x) { return x.options().job; })
      .def_property_readonly("rank", [](const Metrics& x) { return x.options().rank; })
      .def_property_readonly("bind_address",
                             [](const Metrics& x) { return x.options().bind_address; })
      .def("sink", &Metrics::sink)
      .def("stop_serving", &Metrics::StopServing, py::call_guard<py::gil_scoped_release>())
      .def(
          "record_step",
          [](Metrics& x, double seconds, int64_t tokens, double data_wait, double collective_wait) {
            x.RecordStep({absl::Seconds(seconds), tokens, absl::Seconds(data_wait),
                          absl::Seconds(collective_wait)});
          },
          py::arg("seconds"), py::arg("tokens"), py::arg("data_wait"),
          py::arg("collective_wait") = 0.0)
      .def("collective_wait_seconds", &Metrics::CollectiveWaitSeconds)
      .def("record_checkpoint_blocked",
           [](Metrics& x, double s) { x.RecordCheckpointBlocked(absl::Seconds(s)); })
      .def("record_checkpoint_write", &Metrics::RecordCheckpointWrite)
      .def("record_recovery", &Metrics::RecordRecovery)
      .def("record_eviction", [](Metrics& x, const std::string& r) { x.RecordEviction(r); })
      .def("set_mfu", [](Metrics& x, double f,
                         double p) { ThrowIfError(x.SetMfu(f, p), ErrorArea::kGeneric); })
      .def("counter_add",
           [](Metrics& x, const std::string& name, const std::string& help, double v) {
             ThrowIfError(x.CounterAdd(name, help, v), ErrorArea::kGeneric);
           })
      .def("gauge_set",
           [](Metrics& x, const std::string& name, const std::string& help, double v) {
             ThrowIfError(x.GaugeSet(name, help, v), ErrorArea::kGeneric);
           })
      .def("histogram_observe",
           [](Metrics& x, const std::string& name, const std::string& help,
              const std::vector<double>& buckets, double v) {
             ThrowIfError(x.HistogramObserve(name, help, buckets, v), ErrorArea::kGeneric);
           })
      .def("serialize", &Metrics::Serialize)
      .def("write_file",
           [](const Metrics& x) {
             absl::Status s;
             {
               py::gil_scoped_release release;
               s = x.WriteFile();
             }
             ThrowIfError(s, ErrorArea::kGeneric);
           })
      .def("cluster_sample", &Metrics::ClusterSample)
      .def("set_cluster_view",
           [](Metrics& x, const std::vector<std::vector<double>>& samples) {
             ThrowIfError(x.SetClusterView(samples), ErrorArea::kGeneric);
           })
      .def("totals", [](const Metrics& x) {
        Metrics::Totals t = x.totals();
        py::dict d;
        d["steps"] = t.steps;
        d["step_seconds"] = t.step_seconds;
        d["last_step_seconds"] = t.last_step_seconds;
        d["tokens_per_second"] = t.tokens_per_second;
        d["mfu"] = t.mfu;
        return d;
      });

  m.def("_cluster_figure_names", &observe::ClusterFigureNames);
  m.def("_peak_flops_for_device", [](const std::string& name) -> std::optional<double> {
    absl::StatusOr<double> p = observe::PeakFlopsForDevice(name);
    if (!p.ok()) return std::nullopt;
    return *p;
  });
  m.def(
      "_measure_cpu_gemm_peak",
      [](int n, double seconds) {
        py::gil_scoped_release release;
        return observe::MeasureCpuGemmPeak(n, absl::Seconds(seconds));
      },
      py::arg("n"), py::arg("seconds"));
});

}  // namespace
}  // namespace strata::bindings
