// The NCCL recovery path by version (nccl_recovery.h).
#include "comm/nccl_recovery.h"

#include "absl/strings/str_cat.h"

namespace strata::nccl {

const char* NcclRecoveryPathName(NcclRecoveryPath path) {
  switch (path) {
    case NcclRecoveryPath::kRevokeThenShrink:
      return "revoke, then shrink";
    case NcclRecoveryPath::kShrinkAbort:
      return "shrink with NCCL_SHRINK_ABORT";
    case NcclRecoveryPath::kFreshInit:
      return "fresh initialisation among the survivors";
  }
  return "?";
}

NcclRecovery ChooseNcclRecovery(const NcclVersion& version, bool has_shrink, bool has_revoke) {
  const std::string v = absl::StrCat("NCCL ", version.ToString());
  const bool shrink_version = version >= kShrinkReleasedIn;
  const bool revoke_version = version >= kRevokeReleasedIn;
  if (revoke_version && has_revoke && has_shrink) {
    return {NcclRecoveryPath::kRevokeThenShrink,
            absl::StrCat(v, " has ncclCommRevoke (>= ", kRevokeReleasedIn.ToString(),
                         ") and ncclCommShrink (>= ", kShrinkReleasedIn.ToString(), ")")};
  }
  if (shrink_version && has_shrink) {
    std::string why = absl::StrCat(v, " has ncclCommShrink (>= ", kShrinkReleasedIn.ToString(),
                                   ") but not ncclCommRevoke");
    absl::StrAppend(&why, revoke_version
                              ? " (the library does not export it)"
                              : absl::StrCat(" (>= ", kRevokeReleasedIn.ToString(), ")"));
    return {NcclRecoveryPath::kShrinkAbort, std::move(why)};
  }
  std::string why = absl::StrCat(v, " has no ncclCommShrink");
  absl::StrAppend(&why, shrink_version ? " (the library does not export it)"
                                       : absl::StrCat(" (>= ", kShrinkReleasedIn.ToString(), ")"));
  return {NcclRecoveryPath::kFreshInit, std::move(why)};
}

}  // namespace strata::nccl
