#include "comm/common/health.h"

#include "absl/strings/str_cat.h"

namespace strata::comm_internal {

absl::Status CommHealth::CheckUsable(absl::string_view op) const {
  std::lock_guard<std::mutex> lock(mu_);
  absl::Status s;
  switch (state_) {
    case State::kHealthy:
      return absl::OkStatus();
    case State::kAborted:
      return absl::FailedPreconditionError(
          absl::StrCat(op, ": the communicator was aborted; shrink it or build a new one"));
    case State::kRevoked:
      s = absl::AbortedError(absl::StrCat(op, ": the communicator was revoked (",
                                          failure_.message(), "); shrink it or build a new one"));
      break;
    case State::kFailed:
      s = absl::FailedPreconditionError(absl::StrCat(
          op, ": the communicator failed earlier and cannot be used (", failure_.message(),
          "); revoke or abort it, then shrink it or build a new one"));
      break;
  }
  failure_.ForEachPayload(
      [&](absl::string_view url, const absl::Cord& payload) { s.SetPayload(url, payload); });
  return s;
}

absl::Status CommHealth::Health() const {
  std::lock_guard<std::mutex> lock(mu_);
  switch (state_) {
    case State::kHealthy:
      return absl::OkStatus();
    case State::kAborted:
      return absl::AbortedError(absl::StrCat(where_, ": the communicator was aborted"));
    case State::kRevoked:
    case State::kFailed:
      return failure_;
  }
  return absl::OkStatus();
}

bool CommHealth::healthy() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_ == State::kHealthy;
}

void CommHealth::SetFailed(const absl::Status& status) {
  std::lock_guard<std::mutex> lock(mu_);
  if (state_ != State::kHealthy) return;
  state_ = status.code() == absl::StatusCode::kAborted ? State::kRevoked : State::kFailed;
  failure_ = status;
}

void CommHealth::SetAborted() {
  std::lock_guard<std::mutex> lock(mu_);
  if (state_ == State::kHealthy || state_ == State::kFailed) {
    if (failure_.ok()) failure_ = absl::AbortedError(absl::StrCat(where_, ": aborted"));
    state_ = State::kAborted;
  }
}

void CommHealth::SetRevoked(const absl::Status& status) {
  std::lock_guard<std::mutex> lock(mu_);
  if (state_ == State::kRevoked) return;
  state_ = State::kRevoked;
  failure_ = status;
}

}  // namespace strata::comm_internal
