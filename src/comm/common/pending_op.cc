#include "comm/common/pending_op.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace strata::comm_internal {

bool PendingOp::Complete(const absl::Status& status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return false;
    done_ = true;
    status_ = status;
    // Under the lock: whoever sees the operation done sees it recorded.
    if (trace_ != nullptr) trace_->Completed(status);
  }
  cv_.notify_all();
  return true;
}

bool PendingOp::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

absl::Status PendingOp::Wait(absl::Time deadline) {
  const absl::Time start = absl::Now();
  std::unique_lock<std::mutex> lock(mu_);
  // In slices: the deadline may be infinitely far away.
  while (!done_) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) break;
    cv_.wait_for(lock, absl::ToChronoNanoseconds(std::min(left, absl::Hours(1))));
  }
  if (done_) return status_;
  return absl::DeadlineExceededError(
      absl::StrCat(description_, ": not complete when the wait's deadline passed (waited ",
                   absl::FormatDuration(absl::Trunc(absl::Now() - start, absl::Milliseconds(1))),
                   "); the operation is still in flight and may be waited for again"));
}

absl::StatusOr<bool> PendingOp::Test() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!done_) return false;
  if (!status_.ok()) return status_;
  return true;
}

absl::Status PendingWork::DoWait(absl::Time deadline) {
  if (!poke_) return op_->Wait(deadline);
  // Ask the backend between short waits, so that completion is seen soon
  // after it happens.
  const absl::Time start = absl::Now();
  while (true) {
    poke_();
    const absl::Time slice = std::min(deadline, absl::Now() + absl::Microseconds(200));
    absl::Status s = op_->Wait(slice);
    if (op_->done() || s.code() != absl::StatusCode::kDeadlineExceeded) return s;
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          op_->description(), ": not complete when the wait's deadline passed (waited ",
          absl::FormatDuration(absl::Trunc(absl::Now() - start, absl::Milliseconds(1))),
          "); the operation is still in flight and may be waited for again"));
    }
  }
}

absl::StatusOr<bool> PendingWork::Test() {
  if (poke_) poke_();
  return op_->Test();
}

}  // namespace strata::comm_internal
