// The health of one communicator, shared by its operations: healthy,
// failed (a deadline passed, a peer was lost), aborted by this rank, or
// revoked. Backend-neutral: every backend's communicators use it (the MPI
// backend through its CommState).
//
//   CommHealth health("group tp (rank 1 of 2, world rank 3)");
//   STRATA_RETURN_IF_ERROR(health.CheckUsable("allreduce(sum, 4 x fp32) on ..."));
//   health.SetFailed(absl::DeadlineExceededError("..."));   // first failure wins
//
// Thread-safety: thread-safe.
#pragma once

#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace strata::comm_internal {

class CommHealth {
 public:
  explicit CommHealth(std::string where) : where_(std::move(where)) {}

  // "group tp (rank 1 of 2, world rank 3)".
  const std::string& where() const { return where_; }

  // OK while usable; otherwise the status a new operation fails with:
  // FailedPrecondition after an abort or a failure, Aborted after a
  // revocation. `op` names the operation and the group.
  absl::Status CheckUsable(absl::string_view op) const;
  // OK while healthy; else the error that broke the communicator.
  absl::Status Health() const;
  bool healthy() const;
  // Records the first failure (an Aborted status counts as a revocation).
  void SetFailed(const absl::Status& status);
  void SetAborted();
  void SetRevoked(const absl::Status& status);

 private:
  enum class State { kHealthy, kFailed, kAborted, kRevoked };

  const std::string where_;
  mutable std::mutex mu_;
  State state_ = State::kHealthy;
  absl::Status failure_;
};

}  // namespace strata::comm_internal
