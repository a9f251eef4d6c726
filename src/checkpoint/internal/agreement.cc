#include "checkpoint/internal/agreement.h"

#include <algorithm>
#include <limits>
#include <memory>

#include "absl/strings/str_cat.h"
#include "strata/base/status.h"

namespace strata::checkpoint_internal {

namespace {

OpOptions Until(absl::Time deadline) {
  OpOptions op;
  // A zero timeout would mean "the communicator's default": ask for at
  // least a millisecond, so a passed deadline fails promptly.
  op.timeout = std::max(absl::Milliseconds(1), deadline - absl::Now());
  return op;
}

absl::Status Run(absl::StatusOr<std::unique_ptr<Work>> work, absl::Time deadline,
                 absl::string_view what) {
  if (!work.ok()) return internal::Annotate(work.status(), what);
  return internal::Annotate((*work)->Wait(deadline), what);
}

// Codes that travel between ranks: anything outside the canonical range
// becomes kUnknown.
absl::StatusCode CodeFrom(int64_t v) {
  if (v <= 0 || v > static_cast<int64_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::StatusCode::kUnknown;
  }
  return static_cast<absl::StatusCode>(v);
}

}  // namespace

absl::StatusOr<Agreement> Agree(Communicator* comm, const absl::Status& local, absl::Time deadline,
                                absl::string_view phase) {
  Agreement out;
  if (comm == nullptr) {
    out.all_ok = local.ok();
    out.first_failed_rank = local.ok() ? -1 : 0;
    out.first_failure = local;
    return out;
  }
  const std::string what = absl::StrCat("checkpoint agreement (", phase, ")");
  // min over ranks of (ok ? INT32_MAX : rank): INT32_MAX iff all succeeded,
  // else the lowest failing rank.
  int32_t value = local.ok() ? std::numeric_limits<int32_t>::max() : comm->rank();
  STRATA_RETURN_IF_ERROR(Run(comm->AllReduce(Buffer::Of(&value, 1), Buffer::Of(&value, 1),
                                             ReduceOp::kMin, Until(deadline)),
                             deadline, what));
  if (value == std::numeric_limits<int32_t>::max()) return out;
  if (value < 0 || value >= comm->size()) {
    return absl::DataLossError(
        absl::StrCat(what, ": the failing rank ", value, " is not a rank of ", comm->size()));
  }
  out.all_ok = false;
  out.first_failed_rank = value;
  absl::Status failure = local;
  std::string unused;
  STRATA_RETURN_IF_ERROR(BroadcastStatusAndText(*comm, value, &failure, &unused, deadline, what));
  out.first_failure = comm->rank() == value ? local : failure;
  return out;
}

absl::Status AgreedFailure(const Agreement& a, int my_rank, absl::string_view doing) {
  if (a.all_ok) return absl::OkStatus();
  if (a.first_failed_rank == my_rank) return a.first_failure;
  return absl::Status(a.first_failure.code(), absl::StrCat("rank ", a.first_failed_rank, " ", doing,
                                                           ": ", a.first_failure.message()));
}

absl::Status BroadcastStatusAndText(Communicator& comm, int root, absl::Status* status,
                                    std::string* text, absl::Time deadline,
                                    absl::string_view what) {
  const bool me = comm.rank() == root;
  std::string payload;
  int64_t header[2] = {0, 0};  // status code, payload bytes
  if (me) {
    if (status->ok()) {
      payload = *text;
    } else {
      payload = std::string(status->message().substr(0, kMaxAgreedMessageBytes));
    }
    header[0] = static_cast<int64_t>(status->code());
    header[1] = static_cast<int64_t>(payload.size());
  }
  STRATA_RETURN_IF_ERROR(
      Run(comm.Broadcast(Buffer::Of(header, 2), root, Until(deadline)), deadline, what));
  if (header[1] < 0) {
    return absl::DataLossError(absl::StrCat(what, ": rank ", root, " sent a negative length"));
  }
  if (!me) payload.resize(static_cast<size_t>(header[1]));
  if (header[1] > 0) {
    Buffer b{payload.data(), payload.size(), DataType::kUInt8};
    STRATA_RETURN_IF_ERROR(Run(comm.Broadcast(b, root, Until(deadline)), deadline, what));
  }
  if (me) return absl::OkStatus();
  if (header[0] == 0) {
    *status = absl::OkStatus();
    *text = std::move(payload);
  } else {
    *status = absl::Status(CodeFrom(header[0]), payload);
    text->clear();
  }
  return absl::OkStatus();
}

absl::Status AllReduceMaxBytes(Communicator& comm, std::vector<uint8_t>* flags, absl::Time deadline,
                               absl::string_view what) {
  if (flags->empty()) return absl::OkStatus();
  Buffer b{flags->data(), flags->size(), DataType::kUInt8};
  return Run(comm.AllReduce(b, b, ReduceOp::kMax, Until(deadline)), deadline, what);
}

}  // namespace strata::checkpoint_internal
