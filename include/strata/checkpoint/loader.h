// Loading checkpoints: open a committed step, verify, and fill the shards
// this rank needs, in whatever layout it has now.
//
// CheckpointReader::Open reads `latest` (or the requested step) and the
// manifest. Load() takes the boxes this rank wants (TensorTarget: a
// ShardedTensor describing the box and a host buffer to fill), plans for
// each the byte ranges of the saved shards that overlap it (PlanReshard),
// reads only those (ranges closer than merge_gap_bytes are read as one),
// verifies the chunk checksums of what it read (on by default: a chunk is
// the unit of verification, so verified reads are rounded out to chunks) and
// assembles the boxes. Nothing is written to the targets before every target
// has been matched against the manifest.
//
// Errors, each naming what is wrong:
//   NotFound          no committed checkpoint ('latest' missing), the step
//                     asked for is absent, a data file is missing, a tensor
//                     is missing (strict mode)
//   InvalidArgument   a tensor's dtype or global shape differs from the saved
//                     one (naming the key and both), an unexpected tensor in
//                     the checkpoint (strict mode), a bad target box
//   DataLoss          checksum mismatch (naming the file, the byte range and
//                     the tensor), a truncated file or one of the wrong size,
//                     a corrupt manifest or `latest`
//   Unimplemented     a manifest from a newer strata
//
//   strata::LoadOptions opts;
//   opts.directory = "/ckpt/run1";
//   auto reader = strata::CheckpointReader::Open(opts);
//   std::vector<float> w(n);
//   strata::TensorTarget t{strata::ShardedTensor::Whole("w", strata::DataType::kFloat32, {n}),
//                          w.data()};
//   auto report = (*reader)->Load({t});
//
// Multi-rank: with LoadOptions::group, Open and Load are collective over it
// (every rank calls them, in the same order, from one thread each). Rank 0
// resolves `latest` and reads the manifest and sends it to the others (so
// every rank loads the same step, even while a save commits a newer one,
// and the file system sees one read of the manifest, not one per rank).
// Load checks strictness globally: a saved tensor is unexpected only when no
// rank asked for it, so each rank asks only for its own boxes. Every rank
// learns the outcome: when Open or Load fails on any rank, it fails on all,
// with the error of the lowest failing rank (same code; "rank <k> ...:"
// prepended on the others). Each rank still reads only the bytes its own
// targets need.
//
//   opts.group = world->Handle("world").value();   // nothing else may use it during the load
//
// The group is resolved at each Open and Load: a reader opened before a
// World rebuild loads over the group of the current generation; a handle
// that cannot be followed (its World destroyed, a pinned layout that
// changed) fails the call with the handle's error. A communicator without a
// World: GroupHandle::Fixed(comm), which must outlive the reader.
//
// Thread-safety: a CheckpointReader is immutable after Open; without a
// communicator Load may be called from several threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "strata/base/export.h"
#include "strata/checkpoint/manifest.h"
#include "strata/checkpoint/sharded_tensor.h"
#include "strata/comm/communicator.h"
#include "strata/parallel/group_handle.h"

namespace strata {

enum class ChecksumVerification : uint8_t { kVerify, kSkip };
// kStrict: every target must be in the checkpoint and every saved tensor
// must be a target. kLenient: missing targets are skipped and extra saved
// tensors ignored (both listed in the LoadReport).
enum class KeyMatching : uint8_t { kStrict, kLenient };

struct STRATA_EXPORT LoadOptions {
  // Version 2: `group` (a handle) replaced the Communicator pointer `comm`.
  static constexpr int kVersion = 2;
  int version = kVersion;
  // Root directory (holding `latest` and step-<N>/).
  std::string directory;
  // The step to load; -1: the one `latest` names.
  int64_t step = -1;
  ChecksumVerification verify = ChecksumVerification::kVerify;
  KeyMatching matching = KeyMatching::kStrict;
  // Scratch memory for reads that are not copied straight into a target.
  uint64_t read_buffer_bytes = uint64_t{64} << 20;
  // Needed ranges of a shard closer than this are read with one call.
  uint64_t merge_gap_bytes = uint64_t{256} << 10;
  // Multi-rank load: Open and Load are collective over the group (resolved
  // at each call), strictness is global. No other thread may issue
  // collectives on it meanwhile (a World's root between training steps is
  // fine; a checkpointer's own communicator is not). Empty: this process
  // alone.
  GroupHandle group;
  // Deadline of each collective of Open and Load.
  absl::Duration timeout = absl::Minutes(10);
};

// A box to fill: shard.key, dtype, global_shape, local_shape and
// global_offset say what is wanted (replica is ignored); data is host
// memory of shard.local_bytes() bytes, filled row-major.
struct STRATA_EXPORT TensorTarget {
  ShardedTensor shard;
  void* data = nullptr;
};

struct STRATA_EXPORT LoadReport {
  int64_t step = -1;
  std::vector<std::string> missing;  // this rank's targets not in the checkpoint (lenient)
  // Saved tensors no target asked for (lenient); with a communicator, those
  // no rank asked for.
  std::vector<std::string> unexpected;
  uint64_t bytes_read = 0;      // from data files
  uint64_t bytes_verified = 0;  // of those, checked against checksums
  int files_opened = 0;
};

class STRATA_EXPORT CheckpointReader {
 public:
  static absl::StatusOr<std::unique_ptr<CheckpointReader>> Open(const LoadOptions& options);

  const Manifest& manifest() const { return manifest_; }
  int64_t step() const { return manifest_.step; }
  // The step directory: <directory>/step-<N>.
  const std::string& step_directory() const { return step_dir_; }
  // The training state as rank `rank` saved it (per-rank fields empty when
  // that rank did not exist).
  TrainingState state(int rank = 0) const { return manifest_.StateForRank(rank); }

  absl::StatusOr<LoadReport> Load(absl::Span<const TensorTarget> targets) const;

 private:
  struct Job;
  CheckpointReader(LoadOptions options, std::string step_dir, Manifest manifest);
  // Load's phases: match the targets with the manifest (no data touched),
  // then read and assemble.
  absl::Status Match(absl::Span<const TensorTarget> targets, std::vector<Job>* jobs,
                     std::vector<uint8_t>* asked, LoadReport* report) const;
  absl::Status Read(const std::vector<Job>& jobs, LoadReport* report) const;
  LoadOptions options_;
  std::string step_dir_;
  Manifest manifest_;
};

// Everything wrong with a checkpoint, as found by VerifyCheckpoint.
struct STRATA_EXPORT VerifyReport {
  std::vector<absl::Status> problems;
  uint64_t bytes_checked = 0;
  int files_checked = 0;
  bool ok() const { return problems.empty(); }
};

// Checks every file of the step directory `step_dir` against `manifest`:
// present, of the recorded size, whole-file checksum, a safetensors header
// that agrees with the manifest's shards, and every shard chunk checksum.
// Reports all problems rather than stopping at the first.
STRATA_EXPORT VerifyReport VerifyCheckpoint(const std::string& step_dir, const Manifest& manifest);

// The steps of `directory` with a complete checkpoint, ascending, and the
// step `latest` names (NotFound when there is none).
STRATA_EXPORT absl::StatusOr<std::vector<int64_t>> ListCheckpointSteps(
    const std::string& directory);
STRATA_EXPORT absl::StatusOr<int64_t> LatestCheckpointStep(const std::string& directory);

}  // namespace strata
