// StepCommit: before the optimizer applies a step, every rank of the world
// agrees that every rank's gradient reduction of that step completed, so a
// failed step is abandoned whole: no replica applies a partial update.
//
// Why every rank and not "my reductions completed": model-parallel ranks of
// one replica do not share their data-parallel reductions (the tp0 ranks'
// dp all-reduce can complete while tp1's fails), so a rank whose own
// reductions all completed may still belong to a step that another rank
// must abandon.
//
// The store protocol (StoreStepCommit): each rank adds 1 to the epoch's
// `done` counter; the rank that brings it to world size x k (k: the steps
// voted in this epoch) CompareSets step/<n> to "commit"; a rank whose step
// failed, or whose monitor saw the epoch's alarm, CompareSets it to
// "abort"; every rank waits for step/<n>. The first write wins, so every
// rank reads the same answer. Per rank and step: one Add, one blocking read
// (and one CompareSet for the last voter); the store keeps one small key
// per step.
//
// Joining: the last voter also reads the job's count of join requests (one
// more store read, on one rank per step); when some are unanswered it
// writes "commit+join", and every rank learns with the commit that
// joiners wait (joiners_waiting): the step is applied, then every rank
// admits them at the same step boundary (ElasticLoop::Admit).
//
// MPI jobs use the store protocol too (a file store on one host); a ULFM
// protocol (MPIX_Comm_iagree over an elastic control communicator, the AND
// of the votes returned uniformly to every survivor) is not implemented.
//
// Thread-safety: Vote from the loop's thread; Abort from any thread.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "strata/base/export.h"
#include "strata/comm/store.h"
#include "strata/elastic/membership.h"
#include "strata/elastic/options.h"

namespace strata::elastic {

class STRATA_EXPORT StepCommit {
 public:
  virtual ~StepCommit() = default;
  // The epoch whose members vote from now on (at the start and after every
  // regroup, on every member).
  virtual absl::Status Start(const Membership& membership) = 0;
  // Votes for `step` (`ok`: this rank's step, all its reductions included,
  // completed). True on every rank when every rank voted ok; false on every
  // rank otherwise. An error (the store unreachable, `commit_timeout`
  // passed) names what it waited for.
  virtual absl::StatusOr<bool> Vote(int64_t step, bool ok) = 0;
  // Makes the vote of `step` of `epoch` abort (the epoch's alarm came),
  // from any thread; nothing when `epoch` is over.
  virtual void Abort(uint64_t epoch, int64_t step) = 0;
  // Whether the last committed step said that processes wait to join.
  virtual bool joiners_waiting() const { return false; }
  virtual const char* name() const = 0;
};

STRATA_EXPORT std::unique_ptr<StepCommit> MakeStoreStepCommit(std::shared_ptr<Store> store,
                                                              const ElasticOptions& options);

}  // namespace strata::elastic
