// Building a mesh and enumerating every group of every axis, for 1,024,
// 16,384 and 131,072 ranks (Google Benchmark). Target (issue 2): all groups of
// a 131,072-rank mesh in under 100 ms, memory linear in the world size.
//
// Run through benchmarks/run_mesh.py, which also times a peer (an
// independent pure-Python implementation of Megatron-Core's rule) and
// writes benchmarks/results/mesh.json.
#include <benchmark/benchmark.h>

#include "strata/parallel/mesh.h"

namespace {

// A layout a 131,072-GPU job might use: tp 8 within a node, cp 2, pp 16,
// ep 8 carved out of dp*cp.
strata::MeshSpec Spec(int world) {
  strata::MeshSpec s;
  s.world_size = world;
  s.tp = 8;
  s.cp = 2;
  s.pp = world >= 16384 ? 16 : 4;
  s.ep = 8;
  s.ranks_per_node = 8;
  return s;
}

const char* kDense[] = {"tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-cp", "tp-dp-cp"};
const char* kExpert[] = {"tp", "ep", "dp", "tp-ep", "tp-ep-pp"};

void BM_MeshAllGroups(benchmark::State& state) {
  const int world = static_cast<int>(state.range(0));
  size_t bytes = 0;
  for (auto _ : state) {
    absl::StatusOr<strata::Mesh> mesh = strata::Mesh::Create(Spec(world));
    if (!mesh.ok()) {
      state.SkipWithError(std::string(mesh.status().message()).c_str());
      return;
    }
    bytes = 0;
    for (const char* axes : kDense) {
      absl::StatusOr<strata::RankGroups> g = mesh->Groups(axes);
      benchmark::DoNotOptimize(g->flat().data());
      bytes += g->flat().capacity() * sizeof(int);
    }
    for (const char* axes : kExpert) {
      absl::StatusOr<strata::RankGroups> g = mesh->ExpertGroups(axes);
      benchmark::DoNotOptimize(g->flat().data());
      bytes += g->flat().capacity() * sizeof(int);
    }
  }
  state.counters["ranks"] = world;
  state.counters["group_bytes"] = static_cast<double>(bytes);
  state.counters["bytes_per_rank"] = static_cast<double>(bytes) / world;
}
BENCHMARK(BM_MeshAllGroups)->Arg(1024)->Arg(16384)->Arg(131072)->Unit(benchmark::kMillisecond);

void BM_MeshCheckTopology(benchmark::State& state) {
  const int world = static_cast<int>(state.range(0));
  strata::MeshSpec s = Spec(world);
  s.order = "dp-tp-cp-ep-pp";  // tp across nodes: the check searches for a fix
  absl::StatusOr<strata::Mesh> mesh = strata::Mesh::Create(s);
  for (auto _ : state) benchmark::DoNotOptimize(mesh->CheckTopology());
  state.counters["ranks"] = world;
}
BENCHMARK(BM_MeshCheckTopology)->Arg(1024)->Arg(16384)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
