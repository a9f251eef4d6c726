// Agreements among the ranks of a checkpoint communicator: every rank
// contributes its outcome and all learn the same verdict, with the error of
// the lowest rank that failed, so that a save or a load fails on every rank
// at once and with the same explanation, never on one rank while the others
// wait.
//
// Each function issues the same sequence of collectives on every rank (the
// sequence depends only on values every rank knows after the previous
// collective), so ranks cannot drift apart. Without a communicator (one
// process) the functions are local and trivial.
//
// Thread-safety: free functions; the communicator's rules apply (one order
// of collectives on every rank).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "strata/comm/communicator.h"

namespace strata::checkpoint_internal {

// Longest error message carried from the failing rank to the others.
inline constexpr size_t kMaxAgreedMessageBytes = 4096;

// The verdict of an agreement.
struct Agreement {
  bool all_ok = true;
  // The lowest rank whose outcome was an error (-1 when all succeeded).
  int first_failed_rank = -1;
  // That rank's error: its own status on that rank; on the others the same
  // code and message (truncated to kMaxAgreedMessageBytes). OK when all_ok.
  absl::Status first_failure;
};

// Every rank contributes `local`; all learn whether every rank succeeded and,
// if not, the first failing rank and its error. One int32 min-allreduce when
// all succeed; two broadcasts more from the failing rank otherwise. An error
// return means the collectives themselves failed (deadline, lost peer):
// the ranks may then disagree on what happened, and the communicator should
// not be used for checkpoints again.
absl::StatusOr<Agreement> Agree(Communicator* comm, const absl::Status& local, absl::Time deadline,
                                absl::string_view phase);

// The status every rank reports after an agreement that failed: the failing
// rank its own error, the others the same code with "rank <k> <doing>: "
// prepended.
absl::Status AgreedFailure(const Agreement& a, int my_rank, absl::string_view doing);

// Sends `root`'s status and text to every rank (on the root they are inputs,
// elsewhere outputs): a header broadcast, then the bytes. `text` is sent
// only with an OK status; with an error, its message is.
absl::Status BroadcastStatusAndText(Communicator& comm, int root, absl::Status* status,
                                    std::string* text, absl::Time deadline, absl::string_view what);

// flags[i] = max over ranks of flags[i] (every rank passes the same length).
absl::Status AllReduceMaxBytes(Communicator& comm, std::vector<uint8_t>* flags, absl::Time deadline,
                               absl::string_view what);

}  // namespace strata::checkpoint_internal
