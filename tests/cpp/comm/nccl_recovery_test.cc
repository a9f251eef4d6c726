// The NCCL recovery path by the version ncclGetVersion() reports
// (comm/nccl_recovery.h): no GPU needed, every version boundary checked.
#include "comm/nccl_recovery.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "strata/comm/nccl_settings.h"

namespace strata::nccl {
namespace {

using ::testing::HasSubstr;

NcclVersion V(int major, int minor, int patch) { return NcclVersion{major, minor, patch}; }

TEST(NcclRecovery, NewestNcclRevokesThenShrinks) {
  for (NcclVersion v : {V(2, 28, 7), V(2, 28, 9), V(2, 30, 7), V(3, 0, 0)}) {
    NcclRecovery r = ChooseNcclRecovery(v, /*has_shrink=*/true, /*has_revoke=*/true);
    EXPECT_EQ(r.path, NcclRecoveryPath::kRevokeThenShrink) << v.ToString();
    EXPECT_THAT(r.why, HasSubstr("NCCL " + v.ToString())) << r.why;
  }
}

TEST(NcclRecovery, ShrinkWithoutRevokeAbortsInTheShrink) {
  // 2.27.3 .. 2.28.6: ncclCommShrink exists, ncclCommRevoke does not.
  for (NcclVersion v : {V(2, 27, 3), V(2, 27, 7), V(2, 28, 6)}) {
    NcclRecovery r = ChooseNcclRecovery(v, true, /*has_revoke=*/false);
    EXPECT_EQ(r.path, NcclRecoveryPath::kShrinkAbort) << v.ToString();
    EXPECT_THAT(r.why, HasSubstr("2.28.7")) << r.why;
  }
  // A library below 2.28.7 that exported a revoke would still not be
  // trusted with it: the version decides.
  EXPECT_EQ(ChooseNcclRecovery(V(2, 28, 6), true, true).path, NcclRecoveryPath::kShrinkAbort);
}

TEST(NcclRecovery, OlderNcclInitialisesAfresh) {
  for (NcclVersion v : {V(2, 18, 5), V(2, 21, 5), V(2, 26, 2), V(2, 27, 2)}) {
    NcclRecovery r = ChooseNcclRecovery(v, false, false);
    EXPECT_EQ(r.path, NcclRecoveryPath::kFreshInit) << v.ToString();
    EXPECT_THAT(r.why, HasSubstr("no ncclCommShrink (>= 2.27.3)")) << r.why;
    EXPECT_THAT(r.why, HasSubstr(v.ToString())) << r.why;
  }
  // 2.27.0 .. 2.27.2 were never released with ncclCommShrink: a library
  // reporting one is given the fresh initialisation even if it has the symbol.
  EXPECT_EQ(ChooseNcclRecovery(V(2, 27, 2), true, false).path, NcclRecoveryPath::kFreshInit);
}

TEST(NcclRecovery, AMissingSymbolDropsToTheNextPathAndSaysSo) {
  NcclRecovery r = ChooseNcclRecovery(V(2, 30, 7), true, /*has_revoke=*/false);
  EXPECT_EQ(r.path, NcclRecoveryPath::kShrinkAbort);
  EXPECT_THAT(r.why, HasSubstr("does not export"));
  r = ChooseNcclRecovery(V(2, 30, 7), /*has_shrink=*/false, true);
  EXPECT_EQ(r.path, NcclRecoveryPath::kFreshInit);
  EXPECT_THAT(r.why, HasSubstr("does not export"));
}

TEST(NcclRecovery, PathsHaveNames) {
  EXPECT_STREQ(NcclRecoveryPathName(NcclRecoveryPath::kRevokeThenShrink), "revoke, then shrink");
  EXPECT_STREQ(NcclRecoveryPathName(NcclRecoveryPath::kShrinkAbort),
               "shrink with NCCL_SHRINK_ABORT");
  EXPECT_STREQ(NcclRecoveryPathName(NcclRecoveryPath::kFreshInit),
               "fresh initialisation among the survivors");
}

}  // namespace
}  // namespace strata::nccl
