// One rank's part of a save: which shards it writes, how they are laid out
// in safetensors files, the copy into staging, and the writing of the files.
//
//   PlanRankSave   (in Save(), cheap)     which shards, which files, headers
//   StageRankSave  (in Save(), the copy)  headers + tensor bytes -> staging
//   WriteRankFiles (writer thread)        staging -> files, checksums, fsync
//
// The staging layout is the file layout: each file's bytes (header, then
// data) lie contiguously in staging at a page-aligned offset, so writing a
// file is a sequence of large write() calls from one buffer. The result of
// WriteRankFiles is this rank's fragment of the manifest.
//
// Thread-safety: free functions; the caller owns the staging memory.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "strata/checkpoint/checkpointer.h"
#include "strata/checkpoint/manifest.h"

namespace strata::checkpoint_internal {

struct PlannedShard {
  ShardedTensor meta;
  size_t request_index = 0;  // into SaveRequest::tensors
  int file = 0;              // into SavePlan::files
  uint64_t begin = 0;        // absolute offset of its data in the file
};

struct PlannedFile {
  std::string name;
  std::string header;  // length prefix + JSON + padding
  uint64_t arena_offset = 0;
  uint64_t size = 0;  // header + data
};

struct SavePlan {
  int64_t step = 0;
  int rank = 0;
  int world_size = 1;
  ChecksumAlgorithm checksum = ChecksumAlgorithm::kXxh3_128;
  uint64_t chunk_bytes = 0;
  std::vector<PlannedFile> files;
  std::vector<PlannedShard> shards;  // the shards this rank writes
  uint64_t arena_bytes = 0;
  bool any_device = false;
  TrainingState state;  // validated, step set
};

struct PlanOptions {
  int rank = 0;
  int world_size = 1;
  uint64_t max_file_bytes = 0;
  ChecksumAlgorithm checksum = ChecksumAlgorithm::kXxh3_128;
  uint64_t chunk_bytes = uint64_t{16} << 20;
};

// Validates the request (shards, duplicate keys, null data, state) and plans
// this rank's files. InvalidArgument naming the offending key.
absl::StatusOr<SavePlan> PlanRankSave(const SaveRequest& request, const PlanOptions& options);

// Copies the headers and this rank's shards into `arena` (at least
// plan.arena_bytes, page-locked when plan.any_device).
absl::Status StageRankSave(const SaveRequest& request, const SavePlan& plan, uint8_t* arena,
                           int threads);

struct WriteControl {
  std::function<absl::Status(absl::string_view point)> hook;  // may be empty
  const std::atomic<bool>* cancel = nullptr;
};

// Writes the planned files from `arena` into `dir`, with checksums, and
// syncs them. Returns this rank's manifest fragment: its files, one tensor
// entry per shard (file indices local to the fragment), its RankState, and
// the shared TrainingState.
absl::StatusOr<Manifest> WriteRankFiles(const SavePlan& plan, const uint8_t* arena,
                                        const std::string& dir, const WriteControl& control);

// "rank00003-000.safetensors"
std::string DataFileName(int rank, int index);
// "fragment-00003.json": a rank's fragment inside step-<N>.tmp/.
std::string FragmentFileName(int rank);

}  // namespace strata::checkpoint_internal
