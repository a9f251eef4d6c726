// ShardedTensor: one rank's piece of a (possibly) distributed tensor, as the
// checkpoint layer sees it.
//
// A tensor of `global_shape` is cut into boxes; this rank holds the box that
// starts at `global_offset` and has `local_shape`, stored contiguously in
// row-major (C) order. A box held identically by several ranks (a tensor
// replicated across data parallelism) is written once: `replica` says which
// copy this rank holds, and AssignWriters() decides deterministically which
// copy writes each box, spreading the bytes across the replicas rather than
// putting them all on replica 0.
//
//   // Column-parallel weight [4096, 1024] on tp=2, dp=2: rank (tp 1, dp 0)
//   strata::ShardedTensor w;
//   w.key = "layers.0.mlp.fc1.weight";
//   w.dtype = strata::DataType::kBFloat16;
//   w.global_shape = {4096, 1024};
//   w.local_shape = {2048, 1024};
//   w.global_offset = {2048, 0};
//   w.replica = {/*index=*/0, /*count=*/2};   // its dp rank and dp size
//
// Thread-safety: plain values; the functions are pure.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "strata/base/dtype.h"
#include "strata/base/export.h"

namespace strata {

// Which of the identical copies of a box this rank holds.
struct STRATA_EXPORT ReplicaInfo {
  int index = 0;  // 0 <= index < count (e.g. the dp rank)
  int count = 1;  // ranks holding the same box (e.g. the dp size); 1: not replicated
};

struct STRATA_EXPORT ShardedTensor {
  std::string key;
  DataType dtype = DataType::kFloat32;
  std::vector<int64_t> global_shape;
  std::vector<int64_t> local_shape;
  std::vector<int64_t> global_offset;
  ReplicaInfo replica;

  // A whole tensor held by one rank: local == global, offset 0.
  static ShardedTensor Whole(std::string key, DataType dtype, std::vector<int64_t> shape);

  // Elements and bytes of the local box (1 element for a 0-d tensor).
  int64_t local_elements() const;
  uint64_t local_bytes() const;
  int64_t global_elements() const;
};

// Longest accepted key, in bytes, and most dimensions.
inline constexpr size_t kMaxTensorKeyBytes = 4096;
inline constexpr size_t kMaxTensorDims = 64;

// Checks one shard: a non-empty valid-UTF-8 key that is not "__metadata__",
// matching ranks, non-negative sizes, the box inside the global shape, no
// element count overflowing int64, 0 <= replica.index < replica.count.
// InvalidArgument naming the key and the values.
STRATA_EXPORT absl::Status ValidateShard(const ShardedTensor& shard);

// The replica that writes each shard (one entry per shard, in input order):
// 0 for shards with replica.count == 1; otherwise balanced by bytes over the
// count replicas (largest shards first, each to the replica with the fewest
// bytes so far, ties to the lower index).
//
// Deterministic and independent of the order of `shards`: every replica that
// passes the same set of replicated shards (as the ranks of one dp group do)
// gets the same answer, so each box is written by exactly one of them. The
// commit checks that every tensor is covered exactly once, so a violated
// precondition is an error, not a silent gap.
STRATA_EXPORT std::vector<int> AssignWriters(absl::Span<const ShardedTensor> shards);

}  // namespace strata
