// NcclCommunicator: split, shrink, abort and revoke.
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "comm/nccl/nccl_communicator.h"
#include "strata/base/status.h"

namespace strata::nccl {

NcclConfig NcclCommunicator::ChildConfig(const CommOptions& options) const {
  ConfigOptions config;
  config.nonblocking = true;
  config.comm_name = options.name;
  config.runtime = api_.version;
  return BuildNcclConfig(family_->profile, config);
}

absl::StatusOr<std::unique_ptr<Communicator>> NcclCommunicator::AdoptChild(
    ncclResult_t started, ncclComm_t child, const CommOptions& options,
    const ResolvedOptions& resolved) {
  const absl::Time deadline = resolved.deadline;
  const std::string& what = resolved.description;
  absl::Status s;
  if (started != ncclSuccess && started != ncclInProgress) {
    s = NcclError(api_, started, what, comm_);
  } else if (child != nullptr) {
    // Both handles may be in progress: the child until it is built, the
    // parent until its part of the call is done.
    s = WaitNcclReady(api_, child, deadline, what);
    if (s.ok()) s = WaitNcclReady(api_, comm_, deadline, what);
  } else {
    // No child (a negative color): the parent finishes its part of the call.
    s = WaitNcclReady(api_, comm_, deadline, what);
  }
  if (!s.ok()) {
    // A child that did not come up in time is abandoned with abort, as is
    // its family (its peers may be stuck in the same call).
    if (child != nullptr) api_.CommAbort(child);
    if (s.code() != absl::StatusCode::kInvalidArgument) {
      family_->failed = true;
      tracker_->Fail(s);
    }
    return s;
  }
  if (child == nullptr) return std::unique_ptr<Communicator>();
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<NcclCommunicator> c,
                          NcclCommunicator::Wrap(family_, child, options));
  return std::unique_ptr<Communicator>(std::move(c));
}

absl::StatusOr<std::unique_ptr<Communicator>> NcclCommunicator::DoSplit(
    int color, int key, const CommOptions& options, const ResolvedOptions& resolved) {
  const std::string& what = resolved.description;
  STRATA_RETURN_IF_ERROR(tracker_->health().CheckUsable(what));
  std::lock_guard<std::mutex> lock(mu_);
  if (comm_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": the communicator was aborted"));
  }
  DeviceGuard device(family_->device);
  NcclConfig config = ChildConfig(options);
  ncclComm_t child = nullptr;
  const ncclResult_t rc =
      api_.CommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, config.get());
  return AdoptChild(rc, child, options, resolved);
}

absl::StatusOr<std::unique_ptr<Communicator>> NcclCommunicator::DoShrink(
    const ShrinkPlan& plan, const CommOptions& options, const ResolvedOptions& resolved) {
  const std::string& what = resolved.description;
  STRATA_RETURN_IF_ERROR_CTX(CheckFeature("ncclCommShrink", kShrinkSince, api_.version,
                                          api_.CommShrink != nullptr, api_.path),
                             what);
  std::lock_guard<std::mutex> lock(mu_);
  if (comm_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(what,
                     ": the communicator was aborted (its NCCL resources are gone); shrink before "
                     "aborting, or build a new communicator"));
  }
  DeviceGuard device(family_->device);
  // After a failure the parent's operations may never finish: NCCL must
  // abort them first (NCCL_SHRINK_ABORT), and the parent is then released
  // with abort.
  // A revoked communicator is quiescent (NCCL's revoke waits for that), so
  // the plain shrink applies to it.
  const bool failed = !revoked_.load() && (!tracker_->health().healthy() || family_->failed.load());
  std::vector<int> ranks = plan.excluded;  // NCCL takes a non-const list
  NcclConfig config = ChildConfig(options);
  ncclComm_t child = nullptr;
  const ncclResult_t rc =
      api_.CommShrink(comm_, ranks.data(), static_cast<int>(ranks.size()), &child, config.get(),
                      failed ? NCCL_SHRINK_ABORT : NCCL_SHRINK_DEFAULT);
  if (failed) family_->failed = true;
  return AdoptChild(rc, child, options, resolved);
}

absl::Status NcclCommunicator::DoAbort() {
  aborting_ = true;  // ends a launch that is waiting on NCCL
  tracker_->AbortPending();
  family_->failed = true;
  std::lock_guard<std::mutex> lock(mu_);
  if (comm_ == nullptr) return absl::OkStatus();  // aborted before
  DeviceGuard device(family_->device);
  const ncclResult_t rc = api_.CommAbort(comm_);
  comm_ = nullptr;
  return NcclError(api_, rc, absl::StrCat("ncclCommAbort on ", where()));
}

absl::Status NcclCommunicator::DoRevoke() {
  const std::string what = absl::StrCat("revoke of ", where());
  STRATA_RETURN_IF_ERROR_CTX(CheckFeature("ncclCommRevoke", kRevokeSince, api_.version,
                                          api_.CommRevoke != nullptr, api_.path),
                             what);
  aborting_ = true;  // a launch waiting on NCCL gives up
  std::lock_guard<std::mutex> lock(mu_);
  aborting_ = false;
  if (comm_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": the communicator was aborted"));
  }
  DeviceGuard device(family_->device);
  const absl::Status revoked = absl::AbortedError(absl::StrCat(where(), ": revoked by this rank"));
  tracker_->Fail(revoked);  // Aborted marks the communicator revoked
  family_->failed = true;   // released with abort (finalize after revoke is invalid)
  ncclResult_t rc = api_.CommRevoke(comm_, NCCL_REVOKE_DEFAULT);
  if (rc != ncclSuccess && rc != ncclInProgress) return NcclError(api_, rc, what, comm_);
  // Revoke stops in-flight operations; the communicator is quiescent (and
  // may be shrunk) once NCCL reports success.
  STRATA_RETURN_IF_ERROR(WaitNcclReady(api_, comm_, absl::Now() + timeout(), what));
  revoked_ = true;
  return absl::OkStatus();
}

}  // namespace strata::nccl
