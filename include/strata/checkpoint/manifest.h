// The checkpoint manifest: manifest.json in each committed step directory.
//
// It records everything needed to load, verify and reshard a checkpoint
// without opening the data files: the mesh, every tensor's dtype and global
// shape, which byte ranges of which safetensors file hold which shard (box)
// of it, a checksum for each chunk of each shard, each file's size and
// checksum, the training state, the library version and the creation time.
// Schema (version 1; docs/checkpoint.md has the full description):
//
//   {"format": "strata-checkpoint", "version": 1, "step": 100,
//    "created": "2025-01-01T12:00:00Z", "library_version": "0.1.0",
//    "checksum": {"algorithm": "xxh3-128", "chunk_bytes": 16777216},
//    "world_size": 4, "mesh": {"version": 1, "world_size": 4, "tp": 2, ...},
//    "state": {"version": 1, "step": 100, "optimizer_step": 100,
//              "lr_schedule": {...} | null, "extra": {...} | null},
//    "ranks": [{"rank": 0, "rng_states": {"cpu": "<base64>"}, "data_loader": null}, ...],
//    "files": [{"name": "rank00000-000.safetensors", "rank": 0, "size": 8392704,
//               "checksum": "<hex>"}, ...],
//    "tensors": [{"key": "w", "dtype": "F32", "shape": [1024, 1024],
//                 "shards": [{"offset": [0, 0], "shape": [512, 1024], "file": 0,
//                             "byte_range": [4096, 2101248],
//                             "chunk_checksums": ["<hex>"]}, ...]}, ...]}
//
// ParseManifest treats the text as hostile (bounded size and depth, every
// field type- and range-checked, file names confined to the directory) and
// then ValidateManifest checks the meaning: byte ranges match dtype x shape
// and lie inside their files, no two shards share bytes, and the shards of
// each tensor cover it exactly once. Errors are DataLoss naming the field
// (a corrupt or edited manifest); a newer format version is Unimplemented.
//
// Thread-safety: plain values; the functions are pure.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "strata/base/dtype.h"
#include "strata/base/export.h"
#include "strata/checkpoint/checksum.h"
#include "strata/checkpoint/state.h"

namespace strata {

inline constexpr char kManifestFormat[] = "strata-checkpoint";
inline constexpr char kManifestFileName[] = "manifest.json";

struct STRATA_EXPORT ManifestFile {
  std::string name;  // relative to the step directory
  int rank = 0;      // the rank that wrote it
  uint64_t size = 0;
  std::string checksum;  // of the whole file, hex
};

struct STRATA_EXPORT ManifestShard {
  std::vector<int64_t> offset;  // the box in the global tensor
  std::vector<int64_t> shape;
  int file = 0;  // index into Manifest::files
  // Absolute byte range of the shard's data (row-major) in the file.
  uint64_t begin = 0;
  uint64_t end = 0;
  // Checksums of consecutive chunk_bytes pieces of [begin, end) (the last
  // piece may be shorter); none for an empty shard.
  std::vector<std::string> chunk_checksums;
};

struct STRATA_EXPORT ManifestTensor {
  std::string key;
  DataType dtype = DataType::kFloat32;
  std::vector<int64_t> shape;
  std::vector<ManifestShard> shards;
};

// What one rank saved of the per-rank state.
struct STRATA_EXPORT RankState {
  int rank = 0;
  std::map<std::string, std::string> rng_states;
  std::string data_loader;
};

struct STRATA_EXPORT Manifest {
  static constexpr int kVersion = 1;
  int version = kVersion;
  int64_t step = 0;
  std::string created;  // RFC 3339, UTC
  std::string library_version;
  ChecksumAlgorithm checksum = ChecksumAlgorithm::kXxh3_128;
  uint64_t chunk_bytes = uint64_t{16} << 20;
  int world_size = 1;  // ranks that took part in the save
  MeshSpec mesh;
  // The shared fields of the training state (its per-rank fields are empty
  // here; see ranks).
  TrainingState state;
  std::vector<RankState> ranks;  // sorted by rank
  std::vector<ManifestFile> files;
  std::vector<ManifestTensor> tensors;  // sorted by key

  const ManifestTensor* FindTensor(absl::string_view key) const;
  // The full training state as rank `rank` saved it.
  TrainingState StateForRank(int rank) const;
};

struct STRATA_EXPORT ManifestLimits {
  uint64_t max_bytes = uint64_t{1} << 30;
  // Shards of one tensor (the exact-cover check is quadratic in it).
  size_t max_shards_per_tensor = 65536;
};

inline constexpr uint64_t kMinChunkBytes = 4096;
inline constexpr uint64_t kMaxChunkBytes = uint64_t{1} << 40;
// Deepest JSON nesting of a manifest (the state's JSON text sits inside).
inline constexpr int kMaxManifestDepth = kMaxStateJsonDepth + 8;

// True for names a checkpoint may contain: [A-Za-z0-9._-], not starting
// with '.', at most 255 bytes. Keeps an edited manifest inside its directory.
STRATA_EXPORT bool IsSafeFileName(absl::string_view name);

STRATA_EXPORT absl::Status ValidateManifest(const Manifest& manifest,
                                            const ManifestLimits& limits = {});
// Validates, then serializes (indented, deterministic).
STRATA_EXPORT absl::StatusOr<std::string> SerializeManifest(const Manifest& manifest);
// `what` names the source in messages (e.g. the path).
STRATA_EXPORT absl::StatusOr<Manifest> ParseManifest(absl::string_view json,
                                                     absl::string_view what = "manifest",
                                                     const ManifestLimits& limits = {});

}  // namespace strata
