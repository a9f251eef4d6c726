#include "strata/comm/communicator.h"

#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace strata {

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kProd:
      return "prod";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kAvg:
      return "avg";
  }
  return "invalid";
}

absl::StatusOr<ReduceOp> ParseReduceOp(absl::string_view name) {
  const std::string n = absl::AsciiStrToLower(name);
  for (ReduceOp op :
       {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kAvg}) {
    if (n == ReduceOpName(op)) return op;
  }
  if (n == "product") return ReduceOp::kProd;
  if (n == "mean" || n == "average") return ReduceOp::kAvg;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown reduce op '", name, "' (known: sum, prod, min, max, avg)"));
}

}  // namespace strata
