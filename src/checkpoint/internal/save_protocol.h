// The writer's side of a save: the commit protocol of commit.h run across
// the ranks of the checkpoint communicator, with an agreement after each
// phase (agreement.h). Called by the Checkpointer's writer thread.
//
//   prepare   rank 0 creates step-<N>.tmp/                          agree
//   write     every rank writes and syncs its files and fragment    agree
//   commit    rank 0 merges the manifest, renames, replaces latest  agree
//   retention rank 0 (problems are warnings)
//
// A rank that cannot take part in a save (its Save() failed before the
// writer got the job: bad request, busy, an unreported earlier failure)
// still casts its vote in the prepare agreement (CastFailureVote), so the
// other ranks abandon the save at once instead of waiting for the
// agreement's deadline.
//
// Thread-safety: free functions; one call at a time per checkpointer.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "checkpoint/internal/rank_writer.h"
#include "strata/checkpoint/checkpointer.h"
#include "strata/comm/communicator.h"

namespace strata::checkpoint_internal {

struct ProtocolContext {
  std::string root;              // the checkpoint root directory
  Communicator* comm = nullptr;  // null: one process
  int rank = 0;
  int world_size = 1;
  int keep_last = 0;
  absl::Duration commit_timeout = absl::Minutes(10);
  // Called at the named points of a save; a non-OK return fails it there.
  std::function<absl::Status(absl::string_view point)> hook;
  const std::atomic<bool>* cancel = nullptr;
  std::function<void(const absl::Status&)> warn;  // retention problems
};

// Outcome of one protocol run.
struct ProtocolResult {
  absl::Status status;
  // An agreement itself failed (deadline, lost peer): the ranks may no
  // longer agree on the order of collectives.
  bool comm_failed = false;
};

// Runs a save whose files are staged in `arena` (laid out by `plan`).
ProtocolResult RunSaveProtocol(const ProtocolContext& ctx, const SavePlan& plan,
                               const uint8_t* arena, SaveStats* stats);

// This rank's part in a save of `step` it could not start: a failing vote
// (carrying `reason`) in the prepare agreement. No-op without a
// communicator.
ProtocolResult CastFailureVote(const ProtocolContext& ctx, int64_t step,
                               const absl::Status& reason);

}  // namespace strata::checkpoint_internal
