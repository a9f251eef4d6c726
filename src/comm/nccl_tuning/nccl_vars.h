// The two halves of the NCCL variable table (internal); nccl_vars.cc joins
// them for NcclVariables().
#pragma once

#include "absl/types/span.h"
#include "strata/comm/nccl_lint.h"

namespace strata {
namespace nccl_tuning_internal {

// Variables in NCCL's environment-variable documentation (2.30 edition, and
// older editions for removed ones).
absl::Span<const NcclVarInfo> DocumentedNcclVars();
// Variables NCCL's source reads that its documentation does not list.
absl::Span<const NcclVarInfo> InternalNcclVars();

}  // namespace nccl_tuning_internal
}  // namespace strata
