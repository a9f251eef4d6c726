#include "harness.h"

#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "strata/base/status.h"
#include "strata/comm/launch_env.h"

namespace strata::testing {
namespace {

// Owned by main() through HarnessState; reachable here for the fixture.
std::unique_ptr<Communicator>* g_world = nullptr;

// Prints failed assertions (with the rank) and nothing else: the report of
// ranks other than 0.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_,
                 result.file_name() ? result.file_name() : "?", result.line_number(),
                 result.message());
  }

 private:
  int rank_;
};

}  // namespace

RootOptions HarnessRootOptions() {
  RootOptions options;
  // The same suites run on the MPI backend under mpirun and on the Gloo
  // backend under torchrun (tests/tools/run_torchrun.sh sets this).
  const char* backend = std::getenv("STRATA_TEST_BACKEND");
  options.backend = backend != nullptr && *backend != '\0' ? backend : "mpi";
  options.memory = RootMemory::kHost;
  options.comm.timeout = absl::Seconds(150);
  return options;
}

bool BackendIs(absl::string_view backend) { return HarnessRootOptions().backend == backend; }

Communicator& HarnessWorld() {
  STRATA_CHECK(g_world != nullptr && *g_world != nullptr, "harness root communicator missing");
  return **g_world;
}

absl::StatusOr<bool> VoteOnFailure(bool failed) {
  int32_t mine = failed ? 1 : 0, any = 0;
  absl::StatusOr<std::unique_ptr<Work>> work = HarnessWorld().AllReduce(
      ConstBuffer(&mine, 1, DataType::kInt32), Buffer::Of(&any, 1), ReduceOp::kMax);
  STRATA_RETURN_IF_ERROR(work.status());
  STRATA_RETURN_IF_ERROR((*work)->Wait(absl::Now() + absl::Seconds(120)));
  return any != 0;
}

Communicator& MultiRankTest::world() { return HarnessWorld(); }

void MultiRankTest::TearDown() {
  // Every rank says whether it failed; all agree on the verdict.
  const bool mine = HasFailure();
  const absl::StatusOr<bool> any = VoteOnFailure(mine);
  ASSERT_TRUE(any.ok()) << "end-of-test vote failed: " << any.status();
  if (*any && !mine) ADD_FAILURE() << "the test failed on another rank (see its report)";
}

}  // namespace strata::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  absl::StatusOr<strata::LaunchEnv> env = strata::LaunchEnv::Detect();
  if (!env.ok()) {
    std::fprintf(stderr, "multirank harness: %s\n", env.status().ToString().c_str());
    return 2;
  }
  absl::StatusOr<std::unique_ptr<strata::Communicator>> root =
      strata::CreateRootCommunicator(*env, strata::testing::HarnessRootOptions());
  if (!root.ok()) {
    std::fprintf(stderr, "multirank harness: %s\n", root.status().ToString().c_str());
    return 2;
  }
  std::unique_ptr<strata::Communicator> world = std::move(root).value();
  strata::testing::g_world = &world;
  if (env->rank != 0) {
    ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new strata::testing::FailurePrinter(env->rank));
  }
  int rc = RUN_ALL_TESTS();
  world.reset();
  strata::testing::g_world = nullptr;
  return rc;
}
