// Error propagation helpers used across strata.
//
// Every fallible call in the C++ API returns absl::Status or absl::StatusOr<T>
// with a canonical code (see STYLE.md): invalid user input is
// kInvalidArgument, a lost peer or passed deadline kUnavailable /
// kDeadlineExceeded, a revoked or evicted communicator kAborted, a missing
// capability kUnimplemented. The macros below propagate an error and may add
// context, so a message reads from the outermost operation inwards:
//
//   absl::Status Save(...) {
//     STRATA_RETURN_IF_ERROR_CTX(WriteShard(f), "saving step ", step);
//     STRATA_ASSIGN_OR_RETURN(auto manifest, BuildManifest(...));
//   }
//
// A broken internal invariant is not a user error: STRATA_CHECK aborts the
// process with the file, line and message.
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "strata/base/export.h"

namespace strata {
namespace internal {

// Returns `status` with "context: " prepended to its message, same code and
// payloads. An OK status is returned unchanged.
STRATA_EXPORT absl::Status Annotate(const absl::Status& status, absl::string_view context);

[[noreturn]] STRATA_EXPORT void CheckFailed(const char* file, int line, const char* condition,
                                            absl::string_view message);

}  // namespace internal
}  // namespace strata

#define STRATA_INTERNAL_CONCAT_INNER(a, b) a##b
#define STRATA_INTERNAL_CONCAT(a, b) STRATA_INTERNAL_CONCAT_INNER(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define STRATA_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::absl::Status strata_status_ = (expr);          \
    if (!strata_status_.ok()) return strata_status_; \
  } while (0)

// As STRATA_RETURN_IF_ERROR, prefixing the message with StrCat(context...).
#define STRATA_RETURN_IF_ERROR_CTX(expr, ...)                                           \
  do {                                                                                  \
    ::absl::Status strata_status_ = (expr);                                             \
    if (!strata_status_.ok())                                                           \
      return ::strata::internal::Annotate(strata_status_, ::absl::StrCat(__VA_ARGS__)); \
  } while (0)

// Evaluates `rexpr` (an absl::StatusOr<T>); on error returns its status, else
// assigns the value to `lhs` (which may be a declaration: `auto x`).
#define STRATA_ASSIGN_OR_RETURN(lhs, rexpr) \
  STRATA_INTERNAL_ASSIGN_OR_RETURN(STRATA_INTERNAL_CONCAT(strata_statusor_, __LINE__), lhs, rexpr)
#define STRATA_INTERNAL_ASSIGN_OR_RETURN(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                                     \
  if (!tmp.ok()) return std::move(tmp).status();          \
  lhs = std::move(tmp).value()

// Aborts with a message when an internal invariant does not hold.
#define STRATA_CHECK(cond, ...)                                                                \
  do {                                                                                         \
    if (!(cond))                                                                               \
      ::strata::internal::CheckFailed(__FILE__, __LINE__, #cond, ::absl::StrCat(__VA_ARGS__)); \
  } while (0)
