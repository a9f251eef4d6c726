// What the elastic loop's per-step commit costs (docs/elastic.md, "Costs"):
// the store protocol strata uses (StoreStepCommit over a file store: one
// Add per rank, one CompareSet by the last voter, one blocking read) against
// one MPIX_Comm_agree per step (the ULFM alternative: the AND of the votes,
// returned alike to every live rank), on the same ranks, same run.
//
//   mpirun --with-ft ulfm --oversubscribe -np 8 elastic_commit_bench [--steps 200]
//
// Rank 0 prints one JSON line: per protocol, the median and 90th percentile
// of one vote (the time from a rank's vote to its answer, the slowest rank
// per step), in microseconds.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "strata/comm/store.h"
#include "strata/elastic/membership.h"
#include "strata/elastic/options.h"
#include "strata/elastic/step_commit.h"

#if defined(STRATA_HAVE_ULFM)
#include <mpi.h>
// After mpi.h, which it needs.
#include <mpi-ext.h>
#endif

int main(int argc, char** argv) {
#if !defined(STRATA_HAVE_ULFM)
  std::fprintf(stderr, "elastic_commit_bench needs a build with MPI and ULFM\n");
  return 77;
#else
  int steps = 200;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--steps")) steps = std::atoi(argv[i + 1]);
  }
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const char* ns = std::getenv("PMIX_NAMESPACE");
  const std::string dir = absl::StrCat(std::filesystem::temp_directory_path().string(),
                                       "/strata-commit-bench-", ns ? ns : "single", "-", getuid());
  strata::FileStoreOptions fso;
  fso.path = dir;
  auto store = strata::OpenFileStore(fso);
  if (!store.ok()) {
    std::fprintf(stderr, "%s\n", store.status().ToString().c_str());
    return 1;
  }
  strata::elastic::ElasticOptions options;
  options.job = "commit_bench";
  strata::MeshSpec spec;
  spec.world_size = size;
  std::unique_ptr<strata::elastic::StepCommit> commit =
      strata::elastic::MakeStoreStepCommit(*store, options);
  if (absl::Status s = commit->Start(strata::elastic::InitialMembership(spec)); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  MPI_Comm ctl;
  MPI_Comm_dup(MPI_COMM_WORLD, &ctl);

  // One vote per step; each step starts together (a barrier outside the
  // timing) and its time is the slowest rank's.
  auto measure = [&](auto vote) {
    std::vector<double> us;
    for (int s = 0; s < steps; ++s) {
      MPI_Barrier(MPI_COMM_WORLD);
      const absl::Time t0 = absl::Now();
      vote(s);
      double mine = absl::ToDoubleMicroseconds(absl::Now() - t0), slowest = 0;
      MPI_Reduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
      us.push_back(slowest);
    }
    std::sort(us.begin(), us.end());
    return std::make_pair(us[us.size() / 2], us[us.size() * 9 / 10]);
  };
  bool ok = true;
  auto store_t = measure([&](int s) {
    absl::StatusOr<bool> c = commit->Vote(s, true);
    ok = ok && c.ok() && *c;
  });
  auto agree_t = measure([&](int) {
    int flag = 1;
    ok = ok && MPIX_Comm_agree(ctl, &flag) == MPI_SUCCESS && flag == 1;
  });
  if (rank == 0) {
    std::printf(
        "{\"bench\": \"elastic_commit\", \"ranks\": %d, \"steps\": %d, \"store\": {\"median_us\": "
        "%.1f, \"p90_us\": %.1f, \"store\": \"%s\"}, \"mpix_comm_agree\": {\"median_us\": %.1f, "
        "\"p90_us\": %.1f}, \"all_committed\": %s}\n",
        size, steps, store_t.first, store_t.second, (*store)->Describe().c_str(), agree_t.first,
        agree_t.second, ok ? "true" : "false");
  }
  MPI_Comm_free(&ctl);
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) std::filesystem::remove_all(dir);
  MPI_Finalize();
  return ok ? 0 : 1;
#endif
}
