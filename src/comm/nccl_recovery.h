// How an NCCL communicator is aborted and shrunk after a failure, by the
// version of the NCCL in use (ncclGetVersion() at run time, not the headers
// strata was built with). Compiled in every build (no nccl.h), so the choice
// is tested on machines without a GPU.
//
//   NCCL >= 2.28.7 with ncclCommRevoke and ncclCommShrink: kRevokeThenShrink.
//     Abort() revokes the communicator (ncclCommRevoke stops its in-flight
//     operations) and keeps the handle; Shrink() waits until it is
//     quiescent and calls ncclCommShrink(NCCL_SHRINK_DEFAULT), or
//     NCCL_SHRINK_ABORT when the revoke did not finish cleanly.
//   NCCL >= 2.27.3 with ncclCommShrink: kShrinkAbort. Abort() stops this
//     rank's use (pending Work fails with Aborted) and keeps the handle;
//     Shrink() calls ncclCommShrink(NCCL_SHRINK_ABORT), which terminates the
//     parent's operations first (NCCL's documented way after an error).
//   Older, or a library without ncclCommShrink: kFreshInit. Abort() calls
//     ncclCommAbort (the handle is gone); Shrink() initialises a new
//     communicator among the survivors (ncclCommInitRankConfig with a
//     unique id exchanged through the root's store).
// In every path a communicator that saw a failure is released with
// ncclCommAbort, never ncclCommDestroy (which can block on a dead peer).
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>

#include "strata/comm/nccl_settings.h"

namespace strata::nccl {

// ncclCommShrink was first released in NCCL 2.27.3; ncclCommRevoke in 2.28.7.
inline constexpr NcclVersion kShrinkReleasedIn{2, 27, 3};
inline constexpr NcclVersion kRevokeReleasedIn{2, 28, 7};

enum class NcclRecoveryPath : uint8_t {
  kRevokeThenShrink,
  kShrinkAbort,
  kFreshInit,
};

// "revoke, then shrink", "shrink with NCCL_SHRINK_ABORT", "fresh
// initialisation among the survivors".
const char* NcclRecoveryPathName(NcclRecoveryPath path);

struct NcclRecovery {
  NcclRecoveryPath path = NcclRecoveryPath::kFreshInit;
  // Why this path, naming the version: "NCCL 2.27.5 has ncclCommShrink
  // (>= 2.27.3) but not ncclCommRevoke (>= 2.28.7)".
  std::string why;
};

// The path for `version`, given whether the loaded library exports
// ncclCommShrink and ncclCommRevoke (a library that reports a version with
// the call but does not export it gets the next path down, saying so).
NcclRecovery ChooseNcclRecovery(const NcclVersion& version, bool has_shrink, bool has_revoke);

}  // namespace strata::nccl
