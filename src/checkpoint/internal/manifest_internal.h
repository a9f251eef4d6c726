// Manifest validation with a caller-chosen error code: a stored manifest
// that fails is corrupt (DataLoss); shards handed in by ranks at commit time
// that fail are the trainer's mistake (InvalidArgument).
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "strata/checkpoint/manifest.h"

namespace strata::checkpoint_internal {

// Serialization and parsing without the semantic checks, for the per-rank
// fragments a commit merges (a fragment covers only this rank's shards).
absl::StatusOr<std::string> SerializeManifestUnvalidated(const Manifest& manifest);
absl::StatusOr<Manifest> ParseManifestUnvalidated(absl::string_view text, absl::string_view what,
                                                  const ManifestLimits& limits);

absl::Status ValidateManifestWithCode(const Manifest& manifest, const ManifestLimits& limits,
                                      absl::StatusCode code);

}  // namespace strata::checkpoint_internal
