// A C++ trainer that links the installed strata (find_package(strata)).
//
// It detects its launch environment, builds the mesh given on the command
// line (default dp x tp2 x pp2 over the world) and prints it, as a trainer
// does before it builds its process groups. Built against strata::torch
// (LibTorch available), it then trains a small tensor-parallel MLP
// (strata::nn::ParallelMLP) on the World's tp groups, averaging gradients
// over dp, and prints the loss falling.
//
// With --elastic-steps N it trains a linear model data-parallel with
// strata::elastic::ElasticLoop instead (no LibTorch needed;
// elastic_training.h): with --kill-rank R [--kill-step S] a watcher process
// SIGKILLs rank R after step S and the survivors recover and finish.
//
//   mpirun -np 8 cpp_trainer [--tp 2] [--pp 2] [--cp 1] [--ep 1] [--steps 40]
//   mpirun --with-ft ulfm -np 8 cpp_trainer --tp 2 --pp 1 --elastic-steps 40 \
//       --kill-rank 5 --kill-step 10 [--check 1] [--agreement store|ulfm] [--spares N]
//       [--step-sleep-ms 20] [--run-dir DIR]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>

#include "elastic_training.h"
#include "strata/comm/launch_env.h"
#include "strata/parallel/mesh.h"
#include "strata/version.h"

#if STRATA_TRAINER_WITH_TORCH
#include "mlp_training.h"
#endif

int main(int argc, char** argv) {
  strata::MeshSpec spec;
  spec.tp = 2;
  spec.pp = 2;
  int steps = 40;
  int elastic_steps = 0;
  ElasticDemoOptions elastic;
  for (int i = 1; i + 1 < argc; i += 2) {
    const int value = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--elastic-steps"))
      elastic_steps = value;
    else if (!std::strcmp(argv[i], "--kill-rank"))
      elastic.kill_rank = value;
    else if (!std::strcmp(argv[i], "--kill-step"))
      elastic.kill_step = value;
    else if (!std::strcmp(argv[i], "--step-sleep-ms"))
      elastic.step_sleep_ms = value;
    else if (!std::strcmp(argv[i], "--spares"))
      elastic.spares = value;
    else if (!std::strcmp(argv[i], "--check"))
      elastic.check = value != 0;
    else if (!std::strcmp(argv[i], "--agreement"))
      elastic.agreement = argv[i + 1];
    else if (!std::strcmp(argv[i], "--run-dir"))
      elastic.run_dir = argv[i + 1];
    else if (!std::strcmp(argv[i], "--tp"))
      spec.tp = value;
    else if (!std::strcmp(argv[i], "--pp"))
      spec.pp = value;
    else if (!std::strcmp(argv[i], "--cp"))
      spec.cp = value;
    else if (!std::strcmp(argv[i], "--ep"))
      spec.ep = value;
    else if (!std::strcmp(argv[i], "--steps"))
      steps = value;
    else {
      std::fprintf(stderr, "unknown option %s\n", argv[i]);
      return 2;
    }
  }
  absl::StatusOr<strata::LaunchEnv> env = strata::LaunchEnv::Detect();
  if (!env.ok()) {
    std::fprintf(stderr, "launch environment: %s\n", std::string(env.status().message()).c_str());
    return 1;
  }
  if (elastic_steps > 0 && elastic.kill_rank == env->rank) {
    // Before MPI starts: the watcher is a process of its own.
    std::error_code ec;
    std::filesystem::create_directories(RunDir(elastic), ec);
    StartKillWatcher(RunDir(elastic), env->rank, elastic.kill_step);
  }
  spec.world_size = env->world_size - elastic.spares;
  spec.ranks_per_node = env->local_world_size;
  absl::StatusOr<strata::Mesh> mesh = strata::Mesh::Create(spec);
  if (!mesh.ok()) {
    std::fprintf(stderr, "mesh: %s\n", std::string(mesh.status().message()).c_str());
    return 1;
  }
  if (env->rank == 0) {
    std::printf("cpp_trainer linked against strata %s\n%s", strata::GetBuildInfo().version,
                mesh->Describe().c_str());
  }
  if (env->rank < mesh->world_size()) {
    std::map<std::string, int> coords = mesh->Coords(env->rank).value();
    std::printf("[rank %d] tp %d dp %d pp %d\n", env->rank, coords["tp"], coords["dp"],
                coords["pp"]);
  } else {
    std::printf("[rank %d] hot spare\n", env->rank);
  }
  std::fflush(stdout);
  if (elastic_steps > 0) {
    elastic.steps = elastic_steps;
    absl::Status trained = TrainElastic(*env, *mesh, elastic);
    if (!trained.ok()) {
      std::fprintf(stderr, "[rank %d] elastic training: %s\n", env->rank,
                   std::string(trained.message()).c_str());
      return 1;
    }
    return 0;
  }
#if STRATA_TRAINER_WITH_TORCH
  if (steps > 0) {
    absl::Status trained = TrainParallelMLP(*env, *mesh, steps);
    if (!trained.ok()) {
      std::fprintf(stderr, "[rank %d] training: %s\n", env->rank,
                   std::string(trained.message()).c_str());
      return 1;
    }
  }
#else
  if (env->rank == 0) std::printf("built without LibTorch: no training (steps %d)\n", steps);
#endif
  return 0;
}
