// Harness for GoogleTest binaries that run on N ranks under mpirun
// (tests/tools/run_multirank.sh, MPI backend) or torchrun
// (tests/tools/run_torchrun.sh, Gloo backend through a file store). Every
// rank runs every test; the harness
//   - creates one root communicator per process for the tests to use,
//   - votes at the end of each test, so that a failure on any rank fails
//     the test on every rank and the ranks never drift apart (a drift would
//     turn one failure into a hang),
//   - prints the full report on rank 0 and only failures elsewhere.
//
//   class MyTest : public strata::testing::MultiRankTest {};
//   TEST_F(MyTest, Sums) {
//     Communicator& w = world();
//     ... ASSERT_OK(Wait(*work));
//   }
//
// Link with multirank_main (tests/multirank/CMakeLists.txt), which defines
// main().
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "strata/base/status.h"
#include "strata/comm/backend.h"
#include "strata/comm/communicator.h"

namespace strata::testing {

// The options of the harness's root communicator (tests that build their
// own roots start from these): backend $STRATA_TEST_BACKEND (default mpi).
RootOptions HarnessRootOptions();
// Whether the suite runs on `backend` ("mpi", "gloo").
bool BackendIs(absl::string_view backend);
// The process's root communicator (made by main() before the tests run).
Communicator& HarnessWorld();
// Every rank says whether its test failed; returns whether any did.
// Collective over HarnessWorld().
absl::StatusOr<bool> VoteOnFailure(bool failed);

class MultiRankTest : public ::testing::Test {
 protected:
  // The process's root communicator, created on first use.
  static Communicator& world();
  static int rank() { return world().rank(); }
  static int size() { return world().size(); }
  // A generous deadline for waits, so that a hang fails instead of
  // stalling (the runner's timeout is the backstop).
  static absl::Time Deadline(absl::Duration d = absl::Seconds(120)) { return absl::Now() + d; }
  // Waits for `work` with the default deadline.
  static absl::Status Wait(Work& work) { return work.Wait(Deadline()); }

  void TearDown() override;
};

}  // namespace strata::testing

#define STRATA_ASSERT_OK(expr)                           \
  do {                                                   \
    const ::absl::Status strata_s_ = (expr);             \
    ASSERT_TRUE(strata_s_.ok()) << strata_s_.ToString(); \
  } while (0)

#define STRATA_EXPECT_OK(expr)                           \
  do {                                                   \
    const ::absl::Status strata_s_ = (expr);             \
    EXPECT_TRUE(strata_s_.ok()) << strata_s_.ToString(); \
  } while (0)

// Evaluates a StatusOr expression, asserts it is OK, assigns its value.
#define STRATA_ASSERT_OK_AND_ASSIGN(lhs, rexpr) \
  STRATA_ASSERT_OK_AND_ASSIGN_IMPL(STRATA_INTERNAL_CONCAT(strata_or_, __LINE__), lhs, rexpr)
#define STRATA_ASSERT_OK_AND_ASSIGN_IMPL(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                                     \
  ASSERT_TRUE(tmp.ok()) << tmp.status().ToString();       \
  lhs = std::move(tmp).value()
