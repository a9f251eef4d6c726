// Metrics: creation, the exposition (text, .prom file, HTTP), device peaks
// for MFU, and the cluster view (strata/observe/metrics.h).
#include <cblas.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <exception>
#include <numeric>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "observe/metrics_core.h"
#include "prometheus/text_serializer.h"
#include "strata/observe/metrics.h"

namespace strata::observe {

using metrics_internal::Core;

absl::StatusOr<std::unique_ptr<Metrics>> Metrics::Create(const MetricsOptions& options) {
  if (absl::Status s = metrics_internal::CheckOptions(options); !s.ok()) return s;
  auto impl = std::make_unique<Impl>();
  impl->core = std::make_shared<Core>();
  Core& c = *impl->core;
  c.options = options;
  c.file = absl::StrReplaceAll(options.file, {{"{rank}", absl::StrCat(options.rank)}});
  c.base = {{"job", options.job}, {"rank", absl::StrCat(options.rank)}};
  {
    std::lock_guard<std::mutex> lock(c.mu);
    c.flops_per_token = options.flops_per_token;
    c.peak_flops = options.peak_flops;
  }
  metrics_internal::RegisterBuiltins(c);
  impl->sink = metrics_internal::MakeSink(impl->core);
  if (options.port >= 0) {
    const std::string address = absl::StrCat(options.bind_address, ":", options.port);
    std::lock_guard<std::mutex> lock(impl->mu);
    try {
      // One server thread: a scrape is a few kilobytes.
      impl->exposer = std::make_unique<prometheus::Exposer>(address, 1);
      impl->collectable = std::make_shared<metrics_internal::CoreCollectable>(impl->core);
      impl->exposer->RegisterCollectable(impl->collectable);
      std::vector<int> ports = impl->exposer->GetListeningPorts();
      impl->port = ports.empty() ? -1 : ports.front();
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", address, " (rank ",
                                                 options.rank, "): ", e.what()));
    }
  }
  return std::unique_ptr<Metrics>(new Metrics(std::move(impl)));
}

Metrics::~Metrics() = default;

int Metrics::port() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->port;
}

void Metrics::StopServing() {
  std::unique_ptr<prometheus::Exposer> exposer;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    exposer = std::move(impl_->exposer);
    impl_->port = -1;
  }
  exposer.reset();  // joins civetweb's threads, outside the lock
}

std::string Metrics::Serialize() const {
  return prometheus::TextSerializer().Serialize(impl_->core->Collect());
}

absl::Status Metrics::WriteFile() const {
  const std::string& path = impl_->core->file;
  if (path.empty()) return absl::OkStatus();
  const std::string text = Serialize();
  // Beside the target, so rename() is atomic; the pid keeps two writers of
  // one path (a misconfigured {rank}-less name) from sharing a temp file.
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  auto fail = [&](const char* what, const std::string& p) {
    return absl::UnavailableError(absl::StrCat("cannot write metrics file ", path, ": ", what, " ",
                                               p, ": ", std::strerror(errno)));
  };
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return fail("open", tmp);
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      absl::Status s = fail("write", tmp);
      ::close(fd);
      ::unlink(tmp.c_str());
      return s;
    }
    done += static_cast<size_t>(n);
  }
  if (::close(fd) != 0) {
    absl::Status s = fail("close", tmp);
    ::unlink(tmp.c_str());
    return s;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    absl::Status s = fail("rename", tmp);
    ::unlink(tmp.c_str());
    return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<double> PeakFlopsForDevice(absl::string_view name) {
  // Dense BF16 tensor-core peaks, as torchtitan's get_peak_flops
  // (torchtitan/tools/utils.py) tabulates them from the vendors' data
  // sheets. More specific names first.
  struct Row {
    std::vector<const char*> all_of;
    double flops;
  };
  static const Row kRows[] = {
      {{"GB200"}, 2.5e15},        {{"B200"}, 2.25e15},   {{"H100", "NVL"}, 835e12},
      {{"H100", "PCIe"}, 756e12}, {{"H100"}, 989e12},    {{"H200"}, 989e12},
      {{"H800"}, 989e12},         {{"H20"}, 148e12},     {{"A100"}, 312e12},
      {{"A800"}, 312e12},         {{"L40S"}, 362e12},    {{"L4"}, 121e12},
      {{"MI355X"}, 2500e12},      {{"MI325X"}, 1300e12}, {{"MI300X"}, 1300e12},
      {{"MI250X"}, 191.5e12},
  };
  for (const Row& row : kRows) {
    bool all = true;
    for (const char* part : row.all_of) all = all && absl::StrContains(name, part);
    if (all) return row.flops;
  }
  return absl::NotFoundError(
      absl::StrCat("no peak FLOP/s known for device '", name,
                   "'; give peak_flops (the device's dense BF16 FLOP/s) yourself"));
}

double MeasureCpuGemmPeak(int n, absl::Duration duration) {
  std::vector<float> a(static_cast<size_t>(n) * n, 1.0f), b(a.size(), 0.5f), c(a.size(), 0.0f);
  auto gemm = [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n,
                0.0f, c.data(), n);
  };
  gemm();  // warm-up: threads, pages
  int64_t iters = 0;
  const absl::Time start = absl::Now();
  absl::Time now = start;
  do {
    gemm();
    ++iters;
    now = absl::Now();
  } while (now - start < duration);
  const double seconds = absl::ToDoubleSeconds(now - start);
  return 2.0 * n * n * static_cast<double>(n) * static_cast<double>(iters) / seconds;
}

const std::vector<std::string>& ClusterFigureNames() {
  static const std::vector<std::string> kNames = {
      "step_duration_seconds",        // mean over the window
      "tokens_per_second",            // window tokens / window step time
      "mfu_ratio",                    // last step
      "data_wait_seconds",            // mean per step over the window
      "collective_seconds_per_step",  // collective time / steps over the window
      "checkpoint_blocked_seconds",   // total over the window
      "compute_seconds",              // mean per step: step time - time blocked in Wait
      "collective_wait_seconds",      // mean per step: time blocked in Work::Wait
  };
  return kNames;
}

std::vector<double> Metrics::ClusterSample() {
  Core& c = *impl_->core;
  std::lock_guard<std::mutex> lock(c.mu);
  c.window.collective_seconds +=
      static_cast<double>(c.window_collective_ns.exchange(0, std::memory_order_relaxed)) * 1e-9;
  const Core::Window& w = c.window;
  if (w.steps == 0 && !c.last_sample.empty()) {
    // Nothing new: the previous figures still describe this rank.
    std::vector<double> s = c.last_sample;
    s[5] = w.checkpoint_blocked_seconds;
    c.window = {};
    return s;
  }
  const double steps = static_cast<double>(std::max<int64_t>(w.steps, 1));
  std::vector<double> s = {
      w.step_seconds / steps,
      w.step_seconds > 0 ? w.tokens / w.step_seconds : 0.0,
      c.totals.mfu,
      w.data_wait_seconds / steps,
      w.collective_seconds / steps,
      w.checkpoint_blocked_seconds,
      w.compute_seconds / steps,
      w.collective_wait_seconds / steps,
  };
  c.last_sample = s;
  c.window = {};
  return s;
}

absl::Status Metrics::SetClusterView(const std::vector<std::vector<double>>& samples) {
  const std::vector<std::string>& names = ClusterFigureNames();
  if (samples.empty())
    return absl::InvalidArgumentError("the cluster view needs samples of at least one rank");
  for (size_t r = 0; r < samples.size(); ++r) {
    if (samples[r].size() != names.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", r, "'s sample has ", samples[r].size(),
                       " figures; the cluster view takes ", names.size()));
    }
  }
  Core& c = *impl_->core;
  std::lock_guard<std::mutex> lock(c.mu);
  if (c.cluster_stats.empty()) {
    for (const std::string& name : names) {
      c.cluster_stats.push_back(
          &prometheus::BuildGauge()
               .Name(absl::StrCat("strata_cluster_", name))
               .Help(absl::StrCat("Across ranks: min, median, p95 and max of ", name))
               .Labels(c.base)
               .Register(*c.registry));
      c.cluster_max_rank.push_back(&prometheus::BuildGauge()
                                        .Name(absl::StrCat("strata_cluster_", name, "_max_rank"))
                                        .Help(absl::StrCat("The rank with the largest ", name))
                                        .Labels(c.base)
                                        .Register(*c.registry)
                                        .Add({}));
    }
  }
  const size_t n = samples.size();
  std::vector<double> v(n);
  for (size_t f = 0; f < names.size(); ++f) {
    size_t argmax = 0;
    for (size_t r = 0; r < n; ++r) {
      v[r] = samples[r][f];
      if (v[r] > v[argmax]) argmax = r;
    }
    std::sort(v.begin(), v.end());
    const double median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
    // Nearest rank: the smallest value with at least 95% of ranks at or below it.
    const size_t p95 = static_cast<size_t>(std::ceil(0.95 * static_cast<double>(n))) - 1;
    auto& family = *c.cluster_stats[f];
    family.Add({{"stat", "min"}}).Set(v.front());
    family.Add({{"stat", "median"}}).Set(median);
    family.Add({{"stat", "p95"}}).Set(v[p95]);
    family.Add({{"stat", "max"}}).Set(v.back());
    c.cluster_max_rank[f]->Set(static_cast<double>(argmax));
  }
  return absl::OkStatus();
}

}  // namespace strata::observe
