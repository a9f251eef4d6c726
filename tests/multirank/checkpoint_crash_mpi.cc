// Crash consistency for real, on 4 ranks under mpirun --with-ft ulfm: one
// rank kills itself with SIGKILL at a named point of a save (as a crash,
// an OOM kill or a node loss would stop it: no cleanup, no goodbye), and
//   - the survivors' save fails with an error, neither hanging nor killing
//     them (ULFM keeps them alive);
//   - `latest` still names the previous checkpoint (or, when the kill came
//     after the commit point, the new one), which loads and verifies;
//   - a restarted job (one process) saves again, which cleans up what the
//     crash left, and loads the old checkpoint under its own layout.
//
//   checkpoint_crash_mpi <victim rank> <point>
//
// Point "anywhere" kills the victim from a thread after a random delay of up
// to 30 ms into the save (printed, for a rerun): the kill may land inside a
// write, a sync, an agreement or after the commit, and the invariant must
// hold whichever: `latest` names a whole checkpoint, the old or the new.
//
// Not a GoogleTest binary: a rank dies on purpose, so there is no common
// end-of-test vote; each survivor checks its own results and exits non-zero
// on a failure (mpirun's status under ULFM ignores the killed rank).
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint_util.h"
#include "strata/checkpoint/checkpointer.h"
#include "strata/checkpoint/loader.h"
#include "strata/comm/backend.h"
#include "strata/comm/launch_env.h"
#include "survivor_check.h"

namespace {

using namespace strata;           // NOLINT: a test program
using namespace strata::testing;  // NOLINT
using checkpoint_internal::JoinPath;

// How the checkpointer gets its communicator.
enum class CommUse { kSplitOff, kDedicated };

// Saves this rank's boxes of the model on `mesh` as `step` (comm null: a
// job of one process).
absl::Status Save(Communicator* comm, CommUse use, const std::string& dir, const Mesh& mesh,
                  int64_t step, std::function<absl::Status(absl::string_view)> hook,
                  const std::function<void()>& on_created = nullptr) {
  CheckpointOptions o;
  o.directory = dir;
  (use == CommUse::kSplitOff ? o.split_from : o.group) = GroupHandle::Fixed(comm);
  o.chunk_bytes = 4096;
  o.max_file_bytes = 1024;  // several files per rank: "file_partial" falls between them
  o.commit_timeout = absl::Seconds(60);
  o.test_hook = std::move(hook);
  // Creating the checkpointer splits a communicator off `comm`: a rank that
  // dies during that split fails it on the survivors, which is one outcome
  // of a crash during a save.
  absl::StatusOr<std::unique_ptr<Checkpointer>> created = Checkpointer::Create(o);
  if (!created.ok()) return created.status();
  std::unique_ptr<Checkpointer> ckpt = std::move(*created);
  if (on_created) on_created();
  const std::vector<ShardedTensor> shards =
      ModelLayout{}.Shards(mesh, comm != nullptr ? comm->rank() : 0);
  std::vector<std::vector<uint8_t>> data;
  SaveRequest req;
  req.step = step;
  for (const ShardedTensor& s : shards) {
    data.push_back(BoxBytes(s));
    req.tensors.push_back({s, data.back().data()});
  }
  absl::Status s = ckpt->Save(req);
  if (!s.ok()) return s;
  return ckpt->Wait(Deadline());  // the checkpointer (and its communicator) go here
}

// Loads this rank's boxes of the model on `mesh` from `dir` (step -1:
// latest), collectively over `comm` (null: alone), and checks every value.
void ExpectIntact(Communicator* comm, const std::string& dir, int64_t step, int64_t expect,
                  const Mesh& mesh, int rank) {
  LoadOptions lo;
  lo.directory = dir;
  lo.step = step;
  lo.group = GroupHandle::Fixed(comm);
  lo.timeout = absl::Seconds(60);
  absl::StatusOr<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(lo);
  CHECK_TRUE(reader.ok(), "open step ", step, ": ", reader.status().ToString());
  if (!reader.ok()) return;
  CHECK_TRUE((*reader)->step() == expect, "step ", (*reader)->step(), " instead of ", expect);
  if (comm == nullptr || comm->rank() == 0) {
    VerifyReport v = VerifyCheckpoint((*reader)->step_directory(), (*reader)->manifest());
    CHECK_TRUE(v.ok(), "verify step ", expect, ": ", v.ok() ? "" : v.problems[0].ToString());
  }
  const std::vector<ShardedTensor> want = ModelLayout{}.Shards(mesh, rank);
  std::vector<std::vector<uint8_t>> got;
  std::vector<TensorTarget> targets;
  for (const ShardedTensor& s : want) got.emplace_back(s.local_bytes(), 0);
  for (size_t i = 0; i < want.size(); ++i) targets.push_back({want[i], got[i].data()});
  absl::StatusOr<LoadReport> r = (*reader)->Load(targets);
  CHECK_TRUE(r.ok(), "load step ", expect, ": ", r.status().ToString());
  for (size_t i = 0; r.ok() && i < want.size(); ++i) {
    CHECK_TRUE(got[i] == BoxBytes(want[i]), "values of ", want[i].key, " in step ", expect);
  }
}

// Recovery as a job that is not elastic does it: a restart, here a job of
// one process run by the first survivor, which saves again (cleaning up
// what the crash left) and loads the 4-rank checkpoint under its layout.
// The other survivors report when they are done reading. (Carrying on in
// the same job on a shrunk world is the elastic layer's business; after a
// kill inside a collective, which ULFM may complete on some survivors and
// fail on others, later collectives on the shrunk world of Open MPI 5.0.11
// hung in this test, so it does not depend on them.)
void RestartAlone(const std::string& dir, int victim, int rank) {
  const int first = victim == 0 ? 1 : 0;
  (void)checkpoint_internal::WriteNewFile(JoinPath(dir, absl::StrCat("done-", rank)), "");
  if (rank != first) return;
  // The restart comes after the crashed job: wait until every survivor has
  // read what the crash left (a survivor slower to learn of the failure
  // would otherwise find the restart's step 3 as `latest`).
  const absl::Time until = Deadline();
  for (int r = 0; r < 4; ++r) {
    while (r != victim &&
           !checkpoint_internal::PathExists(JoinPath(dir, absl::StrCat("done-", r))) &&
           absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
  const Mesh alone = MakeMesh(1, 1, 1);
  CHECK_TRUE(Save(nullptr, CommUse::kDedicated, dir, alone, 3, nullptr).ok(), "restarted save");
  ExpectIntact(nullptr, dir, -1, 3, alone, 0);
  CHECK_TRUE(!checkpoint_internal::PathExists(JoinPath(dir, "step-2.tmp")),
             "step-2.tmp left behind");
  ExpectIntact(nullptr, dir, 1, 1, alone, 0);
  (void)checkpoint_internal::RemoveTree(dir);
}

}  // namespace

int main(int argc, char** argv) {
  LaunchEnv env = Must(LaunchEnv::Detect(), "launch env");
  g_rank = env.rank;
  if (env.world_size != 4 || argc < 3 || argc > 4) {
    std::fprintf(stderr, "usage: mpirun -np 4 %s <victim rank> <point> [delay us]\n", argv[0]);
    return 2;
  }
  const int victim = std::atoi(argv[1]);
  const std::string point = argv[2];
  RootOptions options;
  options.backend = "mpi";
  options.comm.timeout = absl::Seconds(60);
  std::unique_ptr<Communicator> world = Must(CreateRootCommunicator(env, options), "root");
  auto dir = std::make_unique<SharedDir>(*world);
  const Mesh tp2dp2 = MakeMesh(4, 2, 1);

  // ---- a committed checkpoint, then a save during which `victim` dies ----
  CHECK_TRUE(Save(world.get(), CommUse::kSplitOff, dir->path(), tp2dp2, 1, nullptr).ok(),
             "first save");
  (void)WaitFor(world->Barrier());
  const bool anywhere = point == "anywhere";
  // "anywhere": the clock starts once the checkpointer exists, so the kill
  // lands in the save itself (staging, writing, agreeing or committing).
  auto start_killer = [&] {
    if (!anywhere || env.rank != victim) return;
    std::random_device seed;
    const int delay_us = argc == 4 ? std::atoi(argv[3]) : static_cast<int>(seed() % 30000);
    std::fprintf(stderr, "[rank %d] dies %d us into the save\n", env.rank, delay_us);
    std::thread([delay_us] {
      absl::SleepFor(absl::Microseconds(delay_us));
      raise(SIGKILL);
    }).detach();
  };
  absl::Status crashed = Save(
      world.get(), CommUse::kSplitOff, dir->path(), tp2dp2, 2,
      [&](absl::string_view p) {
        if (env.rank == victim && p == point) raise(SIGKILL);
        return absl::OkStatus();
      },
      start_killer);
  if (anywhere && env.rank == victim) {
    // The save finished before the kill: wait for it here.
    for (;;) ::pause();
  }
  // Only survivors get here.
  std::fprintf(stderr, "[rank %d] the save during the crash of rank %d at %s: %s\n", env.rank,
               victim, point.c_str(), crashed.ToString().c_str());
  if (!anywhere) CHECK_TRUE(!crashed.ok(), "a save with a dead rank succeeded");
  CHECK_TRUE(crashed.code() != absl::StatusCode::kDeadlineExceeded,
             "the survivor waited for its deadline instead of learning of the failure");

  // ---- what is on disk: `latest` names a whole checkpoint ----------------
  bool past_commit = point == "latest_written";
  if (anywhere) {
    absl::StatusOr<int64_t> latest = LatestCheckpointStep(dir->path());
    CHECK_TRUE(latest.ok() && (*latest == 1 || *latest == 2),
               "latest: ", latest.ok() ? absl::StrCat(*latest) : latest.status().ToString());
    past_commit = latest.ok() && *latest == 2;
    // A save that succeeded on a survivor was committed.
    if (crashed.ok()) CHECK_TRUE(past_commit, "a successful save left latest at step 1");
  }
  ExpectIntact(nullptr, dir->path(), -1, past_commit ? 2 : 1, tp2dp2, env.rank);
  if (point == "renamed") ExpectIntact(nullptr, dir->path(), 2, 2, tp2dp2, env.rank);
  const bool partial_remains = !past_commit && point != "renamed" && !anywhere;
  if (partial_remains) {
    CHECK_TRUE(!checkpoint_internal::PathExists(*dir / "step-2"), "step-2 exists");
  }

  RestartAlone(dir->path(), victim, env.rank);
  std::fprintf(stderr, "[rank %d] %s\n", env.rank, g_failures == 0 ? "PASSED" : "FAILED");
  std::fflush(stderr);
  // After a rank died, Open MPI 5.0.11's MPI_Finalize may wait forever in
  // its closing PMIx fence (docs/mpi.md): leave without it.
  std::_Exit(g_failures == 0 ? 0 : 1);
}
