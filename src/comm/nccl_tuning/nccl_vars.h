// The NCCL variable table (internal): nccl_vars.tsv, turned into C++ by
// gen_nccl_vars.py at build time; nccl_vars.cc serves it as NcclVariables().
#pragma once

#include "absl/types/span.h"
#include "strata/comm/nccl_lint.h"

namespace strata {
namespace nccl_tuning_internal {

// Every row of nccl_vars.tsv, in file order (documented variables first).
absl::Span<const NcclVarInfo> NcclVarTable();

}  // namespace nccl_tuning_internal
}  // namespace strata
