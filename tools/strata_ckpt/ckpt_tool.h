// The pieces of strata-ckpt, on the public checkpoint API only (the tool
// links the installed libstrata).
//
// Thread-safety: free functions.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "strata/checkpoint/loader.h"
#include "strata/checkpoint/safetensors.h"

namespace strata::ckpt_tool {

// Opens `path`: a root (the step `latest` names, or `step` when >= 0) or a
// step directory step-<N> (then `step` must be -1 or N).
absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenCheckpoint(const std::string& path,
                                                                 int64_t step, bool verify);

// The inspect report: header lines, a table of tensors (dtype, global
// shape, shards, bytes), their shards (the first 4 of each unless `all`),
// and the files.
std::string DescribeCheckpoint(const CheckpointReader& reader, bool all_shards);
std::string DescribeSafetensors(const SafetensorsFile& file);

// Writes every tensor whole into one safetensors file (via out.tmp, synced,
// renamed): memory of the largest tensor. Returns the bytes written.
absl::StatusOr<uint64_t> ConvertToSafetensors(const CheckpointReader& reader,
                                              const std::string& out);

std::string HumanBytes(uint64_t bytes);

}  // namespace strata::ckpt_tool
