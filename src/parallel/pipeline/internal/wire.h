// What the runner puts on the wire besides the tensors themselves: the
// shape header of a forward transfer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "strata/parallel/pipeline/runner.h"

namespace strata::pipeline::internal {

// Header layout, in int64 words: magic, tensor count, then per tensor
// (dtype, ndim, dims[kMaxTensorDims]).
inline constexpr int64_t kHeaderMagic = 0x5354504950450001;  // "STPIPE", version 1
inline constexpr size_t kTensorWords = 2 + kMaxTensorDims;
inline constexpr size_t kHeaderWords = 2 + kMaxTransferTensors * kTensorWords;
// The most elements one tensor may have (keeps byte counts far from overflow).
inline constexpr int64_t kMaxElements = int64_t{1} << 48;

// InvalidArgument unless the spec has at most kMaxTensorDims dims, none
// negative, and at most kMaxElements elements.
absl::Status CheckSpec(const TensorSpec& spec);
// "[fp32[4, 16], int64[4]]".
std::string SpecList(const std::vector<TensorSpec>& specs);
std::vector<TensorSpec> SpecsOf(const TensorList& tensors);

// The header for `specs` (1..kMaxTransferTensors valid specs).
std::vector<int64_t> EncodeHeader(const std::vector<TensorSpec>& specs);
// The specs in a received header; DataLoss when it is malformed.
absl::StatusOr<std::vector<TensorSpec>> DecodeHeader(const std::vector<int64_t>& header);

}  // namespace strata::pipeline::internal
