#include "strata/base/status.h"

#include <gtest/gtest.h>

namespace strata {
namespace {

absl::Status Fails() { return absl::UnavailableError("peer 3 lost"); }
absl::StatusOr<int> Value(bool ok) {
  if (!ok) return absl::InvalidArgumentError("bad");
  return 7;
}

absl::Status WithContext() {
  STRATA_RETURN_IF_ERROR_CTX(Fails(), "allreduce on group tp (rank ", 1, ")");
  return absl::OkStatus();
}

absl::StatusOr<int> Assign(bool ok) {
  STRATA_ASSIGN_OR_RETURN(int v, Value(ok));
  return v + 1;
}

TEST(StatusTest, ContextIsPrependedAndCodeKept) {
  absl::Status s = WithContext();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), "allreduce on group tp (rank 1): peer 3 lost");
}

TEST(StatusTest, AnnotateKeepsPayloads) {
  absl::Status s = absl::AbortedError("revoked");
  s.SetPayload("strata/rank-failure", absl::Cord("3"));
  absl::Status a = internal::Annotate(s, "ctx");
  EXPECT_EQ(a.message(), "ctx: revoked");
  EXPECT_EQ(a.GetPayload("strata/rank-failure").value(), absl::Cord("3"));
  EXPECT_TRUE(internal::Annotate(absl::OkStatus(), "ctx").ok());
}

TEST(StatusTest, AssignOrReturn) {
  EXPECT_EQ(Assign(true).value(), 8);
  EXPECT_EQ(Assign(false).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(StatusDeathTest, CheckAbortsWithMessage) {
  EXPECT_DEATH(STRATA_CHECK(1 + 1 == 3, "math is ", "broken"), "1 \\+ 1 == 3: math is broken");
}

}  // namespace
}  // namespace strata
