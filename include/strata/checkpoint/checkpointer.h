// Checkpointer: asynchronous, atomic, checksummed saves of sharded tensors.
//
// Save() copies this rank's tensors into staging memory and returns; a
// background writer thread (owned by the Checkpointer, at low I/O priority)
// writes them as safetensors files into <directory>/step-<N>.tmp/, fsyncs,
// agrees with the other ranks that every write succeeded, and then one rank
// (rank 0 of the communicator) writes manifest.json, renames the directory
// to step-<N> and atomically replaces the `latest` pointer. A checkpoint is
// committed whole or not at all: a crash at any point leaves `latest`
// naming the previous checkpoint. Retention keeps the newest `keep_last`
// checkpoints and never removes the one `latest` names.
//
// One save is in flight at a time; a Save() while one is in flight waits
// (up to busy_timeout) or is refused, by option. A background failure never
// kills the process: it is reported by the next call (Save returns it, or
// the warn callback gets it, by option) and by Wait().
//
//   strata::CheckpointOptions opts;
//   opts.directory = "/ckpt/run1";
//   opts.keep_last = 3;
//   auto ckpt = strata::Checkpointer::Create(opts);
//   strata::SaveRequest req;
//   req.step = step;
//   req.tensors.push_back({strata::ShardedTensor::Whole("w", strata::DataType::kFloat32, {n}),
//                          w.data()});
//   STRATA_RETURN_IF_ERROR((*ckpt)->Save(req));   // returns once w is staged
//   ... training continues and may change w ...
//   STRATA_RETURN_IF_ERROR((*ckpt)->Wait(absl::Now() + absl::Minutes(5)));
//
// Multi-rank: every rank creates a Checkpointer and calls Save() with the
// same step and its own shards. The checkpointer needs a communicator of its
// own, so the writer's agreements cannot interleave with training's
// collectives: set split_from to a group handle (usually
// world->Handle("world")) and Create() splits one off (collectively) and
// owns it, or pass a dedicated one in `group` (GroupHandle::Fixed).
// Every Save() call, even one that fails on this rank, takes part in the
// save's first agreement, so a rank that cannot save makes the others
// abandon the save at once (with its reason) rather than wait for
// commit_timeout.
//
//   opts.split_from = world->Handle("world").value();   // all ranks
//   auto ckpt = strata::Checkpointer::Create(opts);
//
// World rebuilds: with split_from a World's handle, the checkpointer
// follows the World (world.h, "Generations"). The first Save() or Abandon()
// after a Rebuild -- collective over the new generation, as every Save is --
// splits a new communicator off the rebuilt group and drops the old one; a
// save of the old generation still in flight then is abandoned (its
// communicator aborted) and reported as that save's failure, naming both
// generations. A handle that cannot be followed (its World destroyed, a
// pinned layout that changed) fails Save() with the handle's error.
//
// Thread-safety: thread-safe; Save, Wait, status and Close may be called
// from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "strata/base/export.h"
#include "strata/checkpoint/checksum.h"
#include "strata/checkpoint/sharded_tensor.h"
#include "strata/checkpoint/state.h"
#include "strata/comm/communicator.h"
#include "strata/parallel/group_handle.h"

namespace strata {

// What Save() does when a save is already in flight.
enum class BusyPolicy : uint8_t { kWait, kRefuse };
// How a failed background save is reported by the next Save().
enum class FailurePolicy : uint8_t { kReturnError, kWarn };
// I/O priority of the writer thread.
enum class IoPriority : uint8_t { kLow, kNormal };

struct STRATA_EXPORT CheckpointOptions {
  // Version 2: `group` and `split_from` are group handles (version 1 had
  // Communicator pointers `comm` and `split_from`).
  static constexpr int kVersion = 2;
  int version = kVersion;
  // Root directory: holds step-<N>/ directories and the `latest` pointer.
  std::string directory;
  // The checkpoint's own communicator (not the training one, nor one used
  // by anything else): GroupHandle::Fixed(comm), borrowed, so `comm` must
  // outlive the Checkpointer. A World's group is refused (training uses
  // it; set split_from to it instead). Empty (with split_from empty) means
  // a single process.
  GroupHandle group;
  // Instead of group: Create() splits a communicator named "checkpoint"
  // with the same ranks off this group's communicator (collective over it,
  // like any Split) and owns it; a World's handle is followed across
  // rebuilds (see the file comment). A fixed handle's communicator must
  // outlive the Checkpointer.
  GroupHandle split_from;
  // Committed checkpoints to keep (0 keeps all).
  int keep_last = 0;
  ChecksumAlgorithm checksum = ChecksumAlgorithm::kXxh3_128;
  // Shards are checksummed in chunks of this size, so a load that needs part
  // of a shard verifies (and reads) only the chunks it touches.
  uint64_t chunk_bytes = uint64_t{16} << 20;
  // A rank's data is split into files of at most about this size (a single
  // shard larger than it gets a file of its own); 0: one file per rank.
  uint64_t max_file_bytes = 0;
  BusyPolicy on_busy = BusyPolicy::kWait;
  // How long Save() waits for the previous save under kWait.
  absl::Duration busy_timeout = absl::Minutes(30);
  FailurePolicy on_failure = FailurePolicy::kReturnError;
  // Receives failures under kWarn, and retention problems; default: stderr.
  std::function<void(const absl::Status&)> warn;
  // Deadline of each agreement among ranks.
  absl::Duration commit_timeout = absl::Minutes(10);
  // Threads copying into staging (the caller's included); 0: up to 4.
  int staging_threads = 0;
  IoPriority io_priority = IoPriority::kLow;
  // For tests: called by the writer at named points of a save ("prepared",
  // "file_partial", "files_written", "agreed", "manifest_written",
  // "renamed", "latest_written"); a non-OK return fails the save there.
  std::function<absl::Status(absl::string_view point)> test_hook;
};

// One shard to save: contiguous row-major data of shard.local_shape.
struct STRATA_EXPORT TensorData {
  ShardedTensor shard;
  const void* data = nullptr;
  // kCuda: device memory, copied through page-locked staging.
  MemoryKind memory = MemoryKind::kHost;
};

struct STRATA_EXPORT SaveRequest {
  int64_t step = 0;
  std::vector<TensorData> tensors;
  // Plain objects; state.step is set from `step`.
  TrainingState state;
  // The CUDA stream (cudaStream_t) that produced device tensors; the copies
  // are ordered on it. Null: the default stream.
  void* cuda_stream = nullptr;
};

// Timings and sizes of the most recent save.
struct STRATA_EXPORT SaveStats {
  int64_t step = -1;
  double staging_seconds = 0;  // time Save() blocked
  double write_seconds = 0;    // background: files written and synced
  double commit_seconds = 0;   // background: agreement, manifest, rename, latest
  uint64_t bytes_written = 0;  // this rank's data files
  int files_written = 0;
};

struct STRATA_EXPORT SaveStatus {
  enum class State : uint8_t { kIdle, kStaging, kWriting };
  State state = State::kIdle;
  int64_t step_in_flight = -1;
  int64_t last_committed_step = -1;
  // The failure of the last background save, until it is reported.
  absl::Status pending_error;
  SaveStats last;
  uint64_t staging_capacity = 0;
  int staging_allocations = 0;
};

class STRATA_EXPORT Checkpointer {
 public:
  // InvalidArgument for bad options (empty directory, chunk_bytes out of
  // range, negative keep_last, both group and split_from, a World's group
  // as `group`, ...); the handle's error when it cannot be resolved; the
  // split's error when split_from is set and the split fails.
  static absl::StatusOr<std::unique_ptr<Checkpointer>> Create(const CheckpointOptions& options);
  // Waits for a save in flight (up to commit_timeout), then stops the
  // writer; a save still running then is cancelled (it never commits).
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Stages the tensors and starts writing them in the background. Returns
  // once the data is copied: the caller may then change or free it. Errors:
  // InvalidArgument (bad shards or state, duplicate keys), AlreadyExists
  // (step committed already), FailedPrecondition (closed, or busy under
  // kRefuse), DeadlineExceeded (busy past busy_timeout), the failure of
  // the previous background save under kReturnError (this save is then not
  // started), or, with split_from, the handle's error when the group cannot
  // be resolved and the split's error when following a rebuild fails. With a communicator, a save
  // that fails here still votes "failed" in the save's first agreement (in the background, after
  // the save in flight), so the other ranks' save of this step fails promptly.
  absl::Status Save(const SaveRequest& request);
  // For a rank that cannot even build its request for `step` (its trainer
  // failed to collect the state): with a communicator, votes "failed" with
  // `reason` in the save's first agreement, as a failing Save() does, so
  // the other ranks abandon the save promptly. Returns `reason` (or
  // FailedPrecondition when closed).
  absl::Status Abandon(int64_t step, const absl::Status& reason);
  // Waits until no save is in flight; returns the failure of the last save
  // (once) or OK. DeadlineExceeded if a save is still in flight at
  // `deadline`.
  absl::Status Wait(absl::Time deadline);
  SaveStatus status() const;
  // Wait(deadline), then stops the writer thread. Later Saves fail.
  absl::Status Close(absl::Time deadline);

 private:
  class Impl;
  explicit Checkpointer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The name of a step's directory: "step-<N>".
STRATA_EXPORT std::string StepDirectoryName(int64_t step);

}  // namespace strata
