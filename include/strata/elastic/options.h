// ElasticOptions: every interval, deadline and policy of in-process
// recovery, in one struct (the Python strata.elastic.Options mirrors it).
//
// The defaults detect a dead rank in well under a second on one host (the
// backend's error, or a probe of the process), a hung one (SIGSTOP) within
// `heartbeat_timeout`, and bound every phase of a recovery. Validate()
// rejects a bad value by name; nothing is silently replaced.
//
// Thread-safety: a value.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "strata/base/export.h"

namespace strata::elastic {

// What the live ranks of a dropped replica do.
enum class LeavePolicy : uint8_t {
  // Leave the job: Recover prints why and ends the process with status 0
  // (std::_Exit: no MPI_Finalize, which would wait for the ranks that go
  // on, and the survivors' shrink waits for the excluded ranks to be gone).
  // Python's run() does the same after closing its store.
  kExit,
  // Return Outcome::kLeave to the caller, who decides (a spare, issue 25).
  kReturn,
};

// How the survivors agree on a membership change.
enum class AgreementKind : uint8_t {
  // Through the store (MPI jobs use a file store on one host or
  // STRATA_STORE across hosts): it also decides without a hung rank.
  kAuto,
  // Through the store (keys carry the epoch).
  kStore,
  // MPIX_Comm_iagree over an elastic control communicator (under mpirun
  // --with-ft ulfm; agreement.h MakeUlfmAgreement). ElasticLoop::Create
  // fails with FailedPrecondition outside such a job, Unimplemented in a
  // build without ULFM. A hung (stopped) rank is not handled: use kStore.
  kUlfm,
};

STRATA_EXPORT const char* AgreementKindName(AgreementKind kind);

struct STRATA_EXPORT ElasticOptions {
  // Version 2 added config, grow and join_timeout.
  static constexpr int kVersion = 2;
  int version = kVersion;

  // A name that separates jobs sharing one store: every key is under
  // "strata/elastic/<job>/<epoch>/".
  std::string job = "default";

  // Each rank's monitor probes its ring successor's process this often,
  // and looks at the epoch's alarm key this often where the store does not
  // serve waits (where it does, the monitor waits for the key: see
  // heartbeat.h); it bumps its heartbeat key and reads its successor's
  // every max(heartbeat_interval, heartbeat_timeout / 10).
  absl::Duration heartbeat_interval = absl::Milliseconds(100);
  // A successor whose heartbeat has not changed for this long is reported
  // hung (SIGSTOP, a deadlock outside strata): the alarm is raised.
  absl::Duration heartbeat_timeout = absl::Seconds(3);
  // Whether monitors also look at a successor on their own host through
  // /proc (gone, or a zombie): a dead rank is found within one interval
  // even when nobody is waiting on it in a collective.
  bool probe_processes = true;
  // The leader waits at most this long after the alarm for every member to
  // check in or be shown failed (heartbeat, process probe, backend report);
  // members still silent then are taken as failed, except those whose
  // heartbeat still changes (alive, on a loaded host): they get until half
  // of `decision_timeout` after the alarm.
  absl::Duration settle_timeout = absl::Seconds(2);
  // How long a rank waits for the leader's decision before it takes the
  // leadership over (the leader may have died), and how many times.
  absl::Duration decision_timeout = absl::Seconds(10);
  int max_leader_takeovers = 3;
  // Shrinking the root and rebuilding the World's groups (every rank).
  absl::Duration rebuild_timeout = absl::Seconds(60);
  // The per-step commit: how long a rank waits for every rank's vote. It
  // only ends a wait nothing else ends (a hung rank is caught by the
  // heartbeat first), so it is long.
  absl::Duration commit_timeout = absl::Minutes(10);
  // A failure during a recovery restarts it with the larger failed set, at
  // most this many times in a row.
  int max_attempts = 5;

  AgreementKind agreement = AgreementKind::kAuto;
  LeavePolicy leave = LeavePolicy::kExit;
  // Kill (SIGKILL) a rank on this host that was taken as failed while its
  // process still exists (hung or stopped), so that it cannot resume with
  // a stale state and the launcher can finish; it would stop by itself on
  // resuming (it is no member of the new epoch), but a stopped process
  // never resumes.
  bool fence_unresponsive = true;

  // Growing back (ElasticLoop::Join). `config`: what a process must match
  // to join this job (a digest of the model's configuration, the code's
  // version); a joiner with another is refused, naming both. `grow`:
  // whether spares and joiners form new replicas while dp is below the
  // job's first dp (else they stand by). `join_timeout`: how long a joiner
  // waits to be admitted (the members admit at their next step boundary).
  std::string config;
  bool grow = true;
  absl::Duration join_timeout = absl::Minutes(5);

  // InvalidArgument naming the first bad field and its value.
  absl::Status Validate() const;
};

}  // namespace strata::elastic
