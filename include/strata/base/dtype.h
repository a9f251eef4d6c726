// Element types shared by communicators, kernels and checkpoints.
//
//   strata::DataType t = strata::DataType::kBFloat16;
//   strata::DataTypeSize(t);   // 2
//   strata::DataTypeName(t);   // "bf16"
//   strata::ParseDataType("float32");  // kFloat32 (accepts torch and safetensors names)
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "strata/base/export.h"

namespace strata {

enum class DataType : uint8_t {
  kFloat32,
  kFloat64,
  kFloat16,
  kBFloat16,
  kInt8,
  kUInt8,
  kInt32,
  kInt64,
  kInt16,
  kBool,
};

// Every DataType, for exhaustive tests.
inline constexpr DataType kAllDataTypes[] = {
    DataType::kFloat32, DataType::kFloat64, DataType::kFloat16, DataType::kBFloat16,
    DataType::kInt8,    DataType::kUInt8,   DataType::kInt32,   DataType::kInt64,
    DataType::kInt16,   DataType::kBool};

// Size of one element in bytes. CHECK-fails on a value outside the enum.
STRATA_EXPORT size_t DataTypeSize(DataType t);
// Short name: "fp32", "fp64", "fp16", "bf16", "int8", "uint8", "int32",
// "int64", "int16", "bool".
STRATA_EXPORT const char* DataTypeName(DataType t);
// The safetensors name: "F32", "F64", "F16", "BF16", "I8", "U8", "I32",
// "I64", "I16", "BOOL".
STRATA_EXPORT const char* DataTypeSafetensorsName(DataType t);
// True for fp32, fp64, fp16, bf16.
STRATA_EXPORT bool IsFloatingPoint(DataType t);
// Parses a short name, a torch name ("float32", "torch.bfloat16", "half",
// "long") or a safetensors name. InvalidArgument names the unknown string.
STRATA_EXPORT absl::StatusOr<DataType> ParseDataType(absl::string_view name);
// A DataType from its integer value, for values that crossed a C or Python
// boundary. InvalidArgument for values outside the enum.
STRATA_EXPORT absl::StatusOr<DataType> DataTypeFromInt(int value);

}  // namespace strata
