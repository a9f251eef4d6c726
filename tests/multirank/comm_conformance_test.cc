// The conformance suite (tests/cpp/comm/conformance) with one rank per
// process: the MPI backend under mpirun, the Gloo backend under torchrun
// (STRATA_TEST_BACKEND, set by the runners), on the harness's root
// communicator. After each test the ranks vote, so a failure on one rank
// fails the test on all of them (harness.h).
#include "conformance.h"
#include "harness.h"  // first: its assertion macros

namespace strata::testing {
namespace {

// Debug builds (the sanitizer builds) check memory, not speed: there the
// large size is 1<<16, so that -O0 references on 8 oversubscribed ranks
// stay within the runner's timeout.
#ifdef NDEBUG
constexpr size_t kLarge = size_t{1} << 20;
#else
constexpr size_t kLarge = size_t{1} << 16;
#endif

class LaunchedEnv final : public Env {
 public:
  void OnEveryRank(const std::function<void(Communicator& world)>& body) override {
    body(HarnessWorld());
  }
  Memory& memory() override { return HostMemory(); }
  size_t large() const override { return kLarge; }
  void AfterTest(bool failed) override {
    const absl::StatusOr<bool> any = VoteOnFailure(failed);
    ASSERT_TRUE(any.ok()) << "end-of-test vote failed: " << any.status();
    if (*any && !failed) ADD_FAILURE() << "the test failed on another rank (see its report)";
  }
};

INSTANTIATE_TEST_SUITE_P(Launched, Conformance,
                         ::testing::Values(EnvFactory{
                             "launched", [] { return std::make_unique<LaunchedEnv>(); }}),
                         EnvName);

}  // namespace
}  // namespace strata::testing
