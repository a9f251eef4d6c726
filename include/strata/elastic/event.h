// Recovery events: what failed, how it was found, how long each phase of
// the recovery took, and the mesh before and after, as a structured record
// (printed as one JSON line, returned to the caller, consumed later by the
// metrics layer as strata_recoveries_total and phase histograms).
//
// Phases (RecoveryEvent's durations; docs/elastic.md):
//   detect   from the failure (its first sign: the first error or alarm, or
//            for a rank found hung, the last heartbeat seen from it) to the
//            moment the last survivor knew;
//   agree    from then to this rank holding the decision (failed set, new
//            epoch, new mesh);
//   rebuild  from the decision to this rank's World rebuilt on the new
//            mesh and a first collective (a barrier over the new world)
//            completed;
//   restore  from then to the state being back at the last committed step
//            (filled in by whoever restores it: Python's State, a C++
//            trainer's callback).
//
// Thread-safety: values.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "strata/base/export.h"
#include "strata/parallel/mesh.h"

namespace strata::elastic {

// How a failure was found.
enum class DetectionSource : uint8_t {
  kBackend,    // an operation failed: a peer lost, a deadline, an abort
  kHeartbeat,  // a rank's heartbeat stopped changing (hung, stopped)
  kProbe,      // a rank's process is gone (found through /proc on its host)
  kCommit,     // the step commit was aborted by another rank
  kRequest,    // a planned membership change (ElasticLoop::RequestChange)
  kJoin,       // processes asked to join (ElasticLoop::Admit)
};

STRATA_EXPORT const char* DetectionSourceName(DetectionSource source);

// The first cause of a recovery (the epoch's alarm: the first one raised
// wins; later ones are only counted).
struct STRATA_EXPORT Detection {
  DetectionSource source = DetectionSource::kBackend;
  // The job rank that raised it, and the job rank it names as failed (-1:
  // the backend could not tell which).
  int reporter = -1;
  int suspect = -1;
  // For a planned change (kRequest): the job ranks it removes (alive; their
  // replicas leave with them). Empty: a regroup onto the same members.
  std::vector<int> evict;
  // The error's message, or what the monitor saw.
  std::string detail;
  // Whether every rank aborts its communicators as soon as it knows (so a
  // collective blocked on a failed peer returns). A planned change whose
  // ranks all stop at the same point (every rank took the same decision
  // from the same numbers, as the straggler policy does) sets false: their
  // operations in flight complete, and the abort comes only if the epoch
  // is still current `heartbeat_timeout` later (a rank stuck anyway).
  bool abort = true;
  // When the reporter found it, and when the failure is estimated to have
  // happened (the same, except for a heartbeat: the last change seen).
  absl::Time found_at = absl::InfinitePast();
  absl::Time failed_at = absl::InfinitePast();

  std::string ToString() const;
};

struct STRATA_EXPORT RecoveryEvent {
  uint64_t epoch_before = 0;
  uint64_t epoch_after = 0;
  Detection cause;
  // Job ranks: taken as failed, leaving with their dropped replicas, and
  // the members of the new epoch (in root-rank order).
  std::vector<int> failed;
  std::vector<int> leaving;
  std::vector<int> members;
  // (failed job rank, the spare that took its mesh position); the spares
  // still standing by after the change (job ranks; also the last of
  // `members`).
  std::vector<std::pair<int, int>> replaced;
  std::vector<int> spares;
  // Job ranks admitted (joiners), and those that formed new replicas as dp
  // grew back (joiners or spares placed into the mesh).
  std::vector<int> joined;
  std::vector<int> grown;
  // Why each failed rank was taken as failed ("process gone", "heartbeat
  // stale 3.1s", "no check-in within 2s"), in the order of `failed`.
  std::vector<std::string> failed_why;
  MeshSpec mesh_before;
  MeshSpec mesh_after;
  // This rank's job rank, whether it leaves (its replica was dropped), and
  // whether it was a spare placed into the mesh by this change (a grown
  // rank, a joiner placed at once, included).
  int rank = -1;
  bool leaves = false;
  bool placed = false;
  // Recovery attempts it took (> 1 when a rank failed during a recovery).
  int attempts = 1;
  // The next step to run (the failed step, redone) when known.
  int64_t step = -1;
  // Where the state came from: "memory" (a surviving replica's) or
  // "checkpoint"; set by whoever restores.
  std::string restored_from = "memory";

  // Wall-clock times (for comparing ranks of one host, and with an outside
  // killer's clock).
  absl::Time known_by_all_at = absl::InfinitePast();
  absl::Time decided_at = absl::InfinitePast();
  absl::Time rebuilt_at = absl::InfinitePast();
  absl::Time restored_at = absl::InfinitePast();
  absl::Duration detect = absl::ZeroDuration();
  absl::Duration agree = absl::ZeroDuration();
  absl::Duration rebuild = absl::ZeroDuration();
  absl::Duration restore = absl::ZeroDuration();
  // The barrier over the new world that ends the rebuild phase.
  absl::Duration first_collective = absl::ZeroDuration();

  // One JSON object: {"event": "recovery", "epoch", "failed", "detect_s",
  // "agree_s", "rebuild_s", "restore_s", "world", "dp", ...}.
  std::string ToJson() const;
};

}  // namespace strata::elastic
