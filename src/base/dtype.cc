#include "strata/base/dtype.h"

#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "strata/base/status.h"

namespace strata {

size_t DataTypeSize(DataType t) {
  switch (t) {
    case DataType::kFloat32:
    case DataType::kInt32:
      return 4;
    case DataType::kFloat64:
    case DataType::kInt64:
      return 8;
    case DataType::kFloat16:
    case DataType::kBFloat16:
    case DataType::kInt16:
      return 2;
    case DataType::kInt8:
    case DataType::kUInt8:
    case DataType::kBool:
      return 1;
  }
  STRATA_CHECK(false, "DataType value ", static_cast<int>(t), " outside the enum");
}

const char* DataTypeName(DataType t) {
  switch (t) {
    case DataType::kFloat32:
      return "fp32";
    case DataType::kFloat64:
      return "fp64";
    case DataType::kFloat16:
      return "fp16";
    case DataType::kBFloat16:
      return "bf16";
    case DataType::kInt8:
      return "int8";
    case DataType::kUInt8:
      return "uint8";
    case DataType::kInt32:
      return "int32";
    case DataType::kInt64:
      return "int64";
    case DataType::kInt16:
      return "int16";
    case DataType::kBool:
      return "bool";
  }
  return "invalid";
}

const char* DataTypeSafetensorsName(DataType t) {
  switch (t) {
    case DataType::kFloat32:
      return "F32";
    case DataType::kFloat64:
      return "F64";
    case DataType::kFloat16:
      return "F16";
    case DataType::kBFloat16:
      return "BF16";
    case DataType::kInt8:
      return "I8";
    case DataType::kUInt8:
      return "U8";
    case DataType::kInt32:
      return "I32";
    case DataType::kInt64:
      return "I64";
    case DataType::kInt16:
      return "I16";
    case DataType::kBool:
      return "BOOL";
  }
  return "invalid";
}

bool IsFloatingPoint(DataType t) {
  return t == DataType::kFloat32 || t == DataType::kFloat64 || t == DataType::kFloat16 ||
         t == DataType::kBFloat16;
}

absl::StatusOr<DataType> ParseDataType(absl::string_view name) {
  std::string n = absl::AsciiStrToLower(name);
  if (absl::StartsWith(n, "torch.")) n = n.substr(6);
  struct Alias {
    const char* name;
    DataType type;
  };
  static constexpr Alias kAliases[] = {
      {"fp32", DataType::kFloat32},   {"float32", DataType::kFloat32},
      {"float", DataType::kFloat32},  {"f32", DataType::kFloat32},
      {"fp64", DataType::kFloat64},   {"float64", DataType::kFloat64},
      {"double", DataType::kFloat64}, {"f64", DataType::kFloat64},
      {"fp16", DataType::kFloat16},   {"float16", DataType::kFloat16},
      {"half", DataType::kFloat16},   {"f16", DataType::kFloat16},
      {"bf16", DataType::kBFloat16},  {"bfloat16", DataType::kBFloat16},
      {"int8", DataType::kInt8},      {"i8", DataType::kInt8},
      {"uint8", DataType::kUInt8},    {"u8", DataType::kUInt8},
      {"int32", DataType::kInt32},    {"int", DataType::kInt32},
      {"i32", DataType::kInt32},      {"int64", DataType::kInt64},
      {"long", DataType::kInt64},     {"i64", DataType::kInt64},
      {"int16", DataType::kInt16},    {"short", DataType::kInt16},
      {"i16", DataType::kInt16},      {"bool", DataType::kBool},
  };
  for (const Alias& a : kAliases) {
    if (n == a.name) return a.type;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown dtype '", name,
      "' (known: fp32, fp64, fp16, bf16, int8, uint8, int16, int32, int64, bool, and their "
      "torch and safetensors names)"));
}

absl::StatusOr<DataType> DataTypeFromInt(int value) {
  if (value < 0 || value > static_cast<int>(DataType::kBool)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown dtype value ", value, " (valid: 0..",
                                                   static_cast<int>(DataType::kBool), ")"));
  }
  return static_cast<DataType>(value);
}

}  // namespace strata
