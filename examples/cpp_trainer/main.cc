// A C++ trainer that links the installed strata (find_package(strata)).
//
// It detects its launch environment, builds the mesh given on the command
// line (default dp x tp2 x pp2 over the world) and prints it, as a trainer
// does before it builds its process groups.
//
//   mpirun -np 8 cpp_trainer [--tp 2] [--pp 2] [--cp 1] [--ep 1]
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "strata/comm/launch_env.h"
#include "strata/parallel/mesh.h"
#include "strata/version.h"

int main(int argc, char** argv) {
  strata::MeshSpec spec;
  spec.tp = 2;
  spec.pp = 2;
  for (int i = 1; i + 1 < argc; i += 2) {
    const int value = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--tp"))
      spec.tp = value;
    else if (!std::strcmp(argv[i], "--pp"))
      spec.pp = value;
    else if (!std::strcmp(argv[i], "--cp"))
      spec.cp = value;
    else if (!std::strcmp(argv[i], "--ep"))
      spec.ep = value;
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
  spec.world_size = env->world_size;
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
  std::map<std::string, int> coords = mesh->Coords(env->rank).value();
  std::printf("[rank %d] tp %d dp %d pp %d\n", env->rank, coords["tp"], coords["dp"], coords["pp"]);
  return 0;
}
