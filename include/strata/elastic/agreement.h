// Agreement: the survivors of an epoch agree on one decision (the failed
// set, the ranks leaving with their dropped replicas, the new epoch and its
// mesh), or every one of them fails with an error naming what it waited for.
//
// StoreAgreement (Gloo, NCCL, and MPI when a store exists). After the
// epoch's alarm, every live rank checks in (alive/<rank>, done by its
// monitor as soon as it sees the alarm). The first rank to CompareSet the
// epoch's leader key leads: it waits until every member of the epoch has
// either checked in or been shown failed (suspect/<rank> evidence written by
// monitors: a stale heartbeat, a process gone; the leader also probes
// members on its own host through /proc), or `settle_timeout` passes (the
// silent ones are then taken as failed, except those whose heartbeat still
// changes: they get until decision_timeout / 2); then it plans the regroup
// (PlanRegroup) and CompareSets the decision. The others wait for the
// decision; when the leader does not deliver within `decision_timeout`, the
// next rank takes the leadership over (CompareSet with the old leader's id),
// at most `max_leader_takeovers` times. Two leaders cannot write different
// decisions: the decision key is written once (CompareSet from empty).
//
// Members that check in but cannot reach each other (the store is
// reachable, the network between ranks is cut): a regroup that gave up on
// a peer after the rendezvous reports it with its next check-in
// (HeartbeatMonitor::ReportUnreachable). Every report is an edge between
// two members that checked in; the leader takes as failed, one at a time,
// the member with the most edges left (ties: the higher rank) until no
// edge is left among the others. One member cut off from all the others is
// the one taken (every report touches it); of two members that only cannot
// reach each other, the higher rank. The majority rule below then counts
// the members left.
//
// No split brain: the decision is "stop" unless more than half of the
// epoch's members checked in; every rank that reads a stop fails with
// FailedPrecondition naming the counts. A rank the decision takes as failed
// (it was silent, e.g. stopped, and resumed) gets Aborted saying so.
//
// Costs per recovery: the leader reads every member's check-in once (O(world)
// store reads) and then polls only the missing ones; every other rank does
// O(1) operations (check in, one CompareSet, one blocking read).
//
// Thread-safety: Agree is called by one thread per rank.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "strata/base/export.h"
#include "strata/comm/store.h"
#include "strata/elastic/event.h"
#include "strata/elastic/membership.h"
#include "strata/elastic/options.h"

namespace strata::elastic {

struct STRATA_EXPORT Decision {
  enum class Kind : uint8_t { kContinue, kStop };
  Kind kind = Kind::kContinue;
  // The epoch the decision is about, and the next one.
  uint64_t epoch = 0;
  uint64_t next_epoch = 0;
  // Job ranks, sorted.
  std::vector<int> failed;
  std::vector<std::string> failed_why;  // same order as `failed`
  std::vector<int> leaving;
  // (failed job rank, the spare that takes its mesh position) (membership.h
  // PlanChange).
  std::vector<std::pair<int, int>> replaced;
  // Job ranks admitted by this decision (processes that asked to join: they
  // stand by as spares unless placed), and the job ranks (joiners or
  // spares) that form the new replicas when dp grows back (PlanGrow).
  std::vector<int> joined;
  std::vector<int> grown;
  // Join requests refused: (request number, why).
  std::vector<std::pair<int64_t, std::string>> refused;
  // Carried into the next membership (membership.h).
  int full_dp = 0;
  int64_t joins_seen = 0;
  // The next epoch's members in root order, spares last, and mesh
  // (kContinue).
  std::vector<int> members;
  MeshSpec mesh;
  // Why the job stops (kStop).
  std::string stop_reason;
  Detection cause;
  int leader = -1;
  // When the last live member knew of the alarm (the check-ins' times).
  absl::Time known_by_all_at = absl::InfinitePast();
  absl::Time decided_at = absl::InfinitePast();

  // The next epoch's membership: `members` and `mesh` at `next_epoch`.
  Membership Next() const;
  // Fills leaving, replaced, members and mesh from PlanChange(current,
  // failed), then adds `joined` as spares and, with `grow`, grows dp back
  // (PlanGrow: fills `grown`); or makes the decision a stop naming why no
  // mesh is left.
  void Plan(const Membership& current, bool grow = false);
  // What it decided, into a rank's event: epoch_after, cause, failed (and
  // why), leaving, members, replaced, joined, grown, spares, mesh_after.
  void Describe(RecoveryEvent& event) const;
  std::string Encode() const;
  static absl::StatusOr<Decision> Decode(absl::string_view text);
};

class STRATA_EXPORT Agreement {
 public:
  virtual ~Agreement() = default;
  // Collective over the live members of `current` (after its alarm):
  // returns the same decision on every rank. `suspects`: job ranks this
  // rank's backend reported failed.
  virtual absl::StatusOr<Decision> Agree(const Membership& current, int rank,
                                         const std::vector<int>& suspects) = 0;
  virtual const char* name() const = 0;
};

// The store path (see the header comment). Members check in through their
// HeartbeatMonitor (or CheckInForTest); Agree reads the epoch's alarm.
STRATA_EXPORT std::unique_ptr<Agreement> MakeStoreAgreement(std::shared_ptr<Store> store,
                                                            const ElasticOptions& options);

// The ULFM path (AgreementKind::kUlfm; src/elastic/ulfm_agreement.cc): the
// members agree with MPIX_Comm_iagree on a mask of the members alive (31
// per agreement), over a control communicator duplicated from
// MPI_COMM_WORLD and remade among the next epoch's members after each
// decision (MPI_Comm_create_from_group). Every member decides alike; no
// leader. `store` only gives the alarm's cause (and a planned change's
// evictions) to the event. Collective over the MPI job (MPI_Comm_dup).
// FailedPrecondition outside `mpirun --with-ft ulfm` or when the World is
// not the whole MPI job; Unimplemented in a build without ULFM. A member
// that hangs (not failed for ULFM) keeps the agreement from completing:
// DeadlineExceeded after `decision_timeout` on every member.
STRATA_EXPORT absl::StatusOr<std::unique_ptr<Agreement>> MakeUlfmAgreement(
    std::shared_ptr<Store> store, const ElasticOptions& options, const Membership& initial);

// Checks `rank` in for `epoch` without a monitor (tests, and ranks whose
// monitor could not): what HeartbeatMonitor::CheckIn writes.
STRATA_EXPORT absl::Status CheckInForTest(Store& store, const ElasticOptions& options,
                                          uint64_t epoch, int rank,
                                          const std::vector<int>& unreachable = {});

}  // namespace strata::elastic
