// Shared pieces of the NCCL lint (internal): nccl_lint.cc checks names,
// sources and the machine; nccl_lint_values.cc checks values.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "strata/comm/nccl_lint.h"

namespace strata {
namespace nccl_tuning_internal {

// strtoll(text, &end, 0) as NCCL calls it (src/misc/param.cc), spelled out so
// the lint can say what NCCL makes of a value.
struct NcclIntParse {
  int64_t value = 0;      // what NCCL stores
  bool digits = false;    // any digit consumed (else NCCL reads 0)
  bool overflow = false;  // ERANGE: NCCL falls back to the default
  bool octal = false;     // leading 0 made it base 8
  std::string rest;       // text after the number, ignored by NCCL
};
NcclIntParse ParseLikeStrtoll(const std::string& text);

struct LintContext {
  const EffectiveSettings& settings;
  const LintOptions& options;
  std::vector<Finding>* out;
  // Near-miss suggestions cost a pass over the table each; a file with
  // thousands of unknown names gets them for the first few only.
  mutable int suggestions_left = 64;
  // The effective setting of each name (EffectiveSettings::Find is linear).
  std::map<std::string, const Setting*> index;

  const Setting* Find(absl::string_view name) const;

  void Add(Severity severity, const Setting& s, std::string rule, std::string message,
           std::string fix) const;
  // The integer NCCL sees for `name` (effective setting, else `fallback`).
  int64_t IntOr(const char* name, int64_t fallback) const;
};

// Value checks for one known variable.
void CheckValue(const LintContext& ctx, const Setting& s, const NcclVarInfo& var);

}  // namespace nccl_tuning_internal
}  // namespace strata
