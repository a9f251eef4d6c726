// Resharding plans: which bytes of which saved shards make up the shard a
// rank needs now.
//
// A checkpoint stores each tensor as boxes (shards), each contiguous in
// row-major order. Loading under another layout (tp=2,dp=2 saved, tp=4
// loaded; a stacked per-layer tensor split over pp=2 saved, pp=4 loaded)
// asks for a different box of the same tensor. PlanReshard intersects the
// wanted box with every saved box and describes the copies as strided
// segments: `count` runs of `length` bytes, the i-th run starting at
// source_offset + i*source_stride in the saved shard and target_offset +
// i*target_stride in the target buffer. A run spans every trailing
// dimension where the intersection is whole in both boxes, so an unchanged
// layout is one run per shard and a split along dim 0 one run per piece.
//
//   std::vector<strata::TensorBox> saved = {{{0, 0}, {4, 8}}, {{4, 0}, {4, 8}}};
//   strata::TensorBox want{{2, 0}, {4, 8}};
//   auto plan = strata::PlanReshard(strata::DataType::kFloat32, {8, 8}, saved, want);
//   // two segments: rows 2..3 of saved[0], rows 0..1 of saved[1]
//
// Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "strata/base/dtype.h"
#include "strata/base/export.h"

namespace strata {

struct STRATA_EXPORT TensorBox {
  std::vector<int64_t> offset;
  std::vector<int64_t> shape;
};

struct STRATA_EXPORT CopySegment {
  size_t source = 0;           // index into the saved boxes
  uint64_t source_offset = 0;  // bytes into the saved shard's data
  uint64_t target_offset = 0;  // bytes into the target buffer
  uint64_t length = 0;         // bytes per run
  uint64_t count = 1;          // runs
  uint64_t source_stride = 0;  // bytes between runs in the source
  uint64_t target_stride = 0;  // bytes between runs in the target

  // Bytes from the first to the end of the last run in the source.
  uint64_t source_span() const { return (count - 1) * source_stride + length; }
};

// The segments that fill `target` from `sources` (boxes of one tensor of
// `global_shape`, none overlapping another), ordered by source and then by
// source offset. InvalidArgument if a box does not fit the global shape or
// ranks differ; NotFound (saying how many elements are covered) if the
// sources do not cover the target.
STRATA_EXPORT absl::StatusOr<std::vector<CopySegment>> PlanReshard(
    DataType dtype, absl::Span<const int64_t> global_shape, absl::Span<const TensorBox> sources,
    const TensorBox& target);

// Executes a plan in memory (tests, and reads of whole shards): copies from
// sources[seg.source] into target.
STRATA_EXPORT void ApplyCopySegments(absl::Span<const CopySegment> segments,
                                     absl::Span<const void* const> sources, void* target);

}  // namespace strata
