#include "strata/base/status.h"

#include <cstdio>
#include <cstdlib>

namespace strata {
namespace internal {

absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok() || context.empty()) return status;
  absl::Status annotated(status.code(), absl::StrCat(context, ": ", status.message()));
  status.ForEachPayload([&](absl::string_view url, const absl::Cord& payload) {
    annotated.SetPayload(url, payload);
  });
  return annotated;
}

void CheckFailed(const char* file, int line, const char* condition, absl::string_view message) {
  std::fprintf(stderr, "strata: internal check failed at %s:%d: %s%s%.*s\n", file, line, condition,
               message.empty() ? "" : ": ", static_cast<int>(message.size()), message.data());
  std::fflush(stderr);
  std::abort();
}

}  // namespace internal
}  // namespace strata
