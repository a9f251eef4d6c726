// Topology detection + NCCL profile + lint on each machine fixture, and on
// this machine (Google Benchmark). Target (issue 5): under 50 ms per fixture.
//
// Each iteration does what `strata-topo` does for one report: walk the sysfs
// tree (and parse the nvidia-smi text where the fixture has one), classify,
// build the profile, collect the settings and lint them (the eleven settings
// of the guide, so every rule family runs). The NCCL version is
// given, so the one-time dlopen of libnccl is measured separately
// (BM_LoadedNcclVersion). Run through benchmarks/run_topo.py.
#include <benchmark/benchmark.h>

#include <filesystem>
#include <string>

#include "strata/comm/topology_report.h"

namespace {

const char* kMachines[] = {"dgx_h100", "pcie_8gpu_dual_socket", "nvlink_pairs_4gpu", "roce_cluster",
                           "aws_p4d",  "tcp_cloud_vm"};

std::map<std::string, std::string> Guide() {
  return {{"NCCL_SOCKET_TIMEOUT", "600"}, {"NCCL_BUFFERS_PER_CHANNEL", "4"},
          {"NCCL_TREE_THRESHOLD", "0"},   {"NCCL_MIN_NRINGS", "4"},
          {"NCCL_MAX_NCHANNELS", "16"},   {"NCCL_NTHREADS", "8"},
          {"NCCL_IB_RETRY_CNT", "13"},    {"NCCL_ASYNC_ERROR_HANDLING", "1"},
          {"NCCL_ALGO", "Ring"},          {"NCCL_PROTO", "Simple"},
          {"NCCL_IB_GID_INDEX", "3"}};
}

void Run(benchmark::State& state, strata::TopoReportOptions options) {
  size_t findings = 0;
  for (auto _ : state) {
    absl::StatusOr<strata::TopoReport> r = strata::BuildTopoReport(options);
    if (!r.ok()) {
      state.SkipWithError(std::string(r.status().message()).c_str());
      return;
    }
    findings = r->lint.findings.size();
    benchmark::DoNotOptimize(r->profile.entries.data());
  }
  state.counters["findings"] = static_cast<double>(findings);
}

void BM_Fixture(benchmark::State& state, const std::string& machine) {
  std::string dir = std::string(STRATA_TOPOLOGY_FIXTURES) + "/" + machine;
  strata::TopoReportOptions o;
  o.detect.sysfs_root = dir + "/sys";
  o.detect.use_nvml = false;
  if (std::filesystem::exists(dir + "/nvidia-smi.txt")) {
    o.detect.nvidia_smi_topo = *strata::ReadTextFile(dir + "/nvidia-smi.txt");
  }
  o.nccl_version = strata::NcclVersion{2, 28, 9};
  o.environment = Guide();
  o.read_conf_files = false;
  Run(state, o);
}

void BM_ThisMachine(benchmark::State& state) {
  strata::TopoReportOptions o;  // /sys, NVML if present, the real NCCL files
  o.nccl_version = strata::NcclVersion{2, 28, 9};
  o.environment = Guide();
  Run(state, o);
}

void BM_LoadedNcclVersion(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(strata::LoadedNcclVersion().ok());
}

int Register() {
  for (const char* m : kMachines) {
    benchmark::RegisterBenchmark((std::string("BM_Fixture/") + m).c_str(), BM_Fixture,
                                 std::string(m))
        ->Unit(benchmark::kMillisecond);
  }
  benchmark::RegisterBenchmark("BM_ThisMachine", BM_ThisMachine)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BM_LoadedNcclVersion", BM_LoadedNcclVersion)
      ->Unit(benchmark::kMillisecond);
  return 0;
}
const int registered = Register();

}  // namespace

BENCHMARK_MAIN();
