// Checks for the multi-rank programs in which a rank dies on purpose (not
// GoogleTest binaries: there is no common end-of-test vote, so each survivor
// counts its own failures and exits non-zero when there are any).
//
//   g_rank = env.rank;
//   CHECK_TRUE(s.ok(), "allreduce after the kill: ", s.ToString());
//   auto comm = Must(CreateRootCommunicator(env, options), "root communicator");
//   ...
//   std::_Exit(g_failures == 0 ? 0 : 1);
#pragma once

#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace strata::testing {

// This process's rank, for messages (set by main); failed checks so far.
inline int g_rank = -1;
inline int g_failures = 0;

// Reports a failed condition (with the rank, place and a message built by
// StrCat from the remaining arguments) and counts it; execution goes on.
#define CHECK_TRUE(cond, ...)                                                                      \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      std::fprintf(stderr, "[rank %d] FAILED %s:%d: %s %s\n", ::strata::testing::g_rank, __FILE__, \
                   __LINE__, #cond, absl::StrCat(__VA_ARGS__).c_str());                            \
      ++::strata::testing::g_failures;                                                             \
    }                                                                                              \
  } while (0)

// The value, or the process ends at once (no exit handlers, which could
// wait on a dead peer) naming `what` and the error.
template <typename T>
T Must(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) {
    std::fprintf(stderr, "[rank %d] FATAL %s: %s\n", g_rank, what, v.status().ToString().c_str());
    std::_Exit(1);
  }
  return std::move(v).value();
}

// The deadline of one step of these programs.
inline absl::Time Deadline() { return absl::Now() + absl::Seconds(60); }

}  // namespace strata::testing
