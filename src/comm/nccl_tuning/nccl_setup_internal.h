// Test hook for the once-per-process NCCL setup (internal).
#pragma once

namespace strata {
namespace nccl_tuning_internal {

// Forgets that this process applied a profile, so a test can run the first
// call again. Does not undo environment variables already set.
void ResetNcclSetupForTesting();

}  // namespace nccl_tuning_internal
}  // namespace strata
