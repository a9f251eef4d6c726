// The manifest reader on arbitrary text: never crashes, hangs or
// over-allocates, and whatever it accepts serializes and parses back to the
// same text (the checks are not weaker on the second pass).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "strata/checkpoint/manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  strata::ManifestLimits limits;
  limits.max_shards_per_tensor = 1024;
  absl::StatusOr<strata::Manifest> m = strata::ParseManifest(text, "fuzz", limits);
  if (!m.ok()) return 0;
  absl::StatusOr<std::string> out = strata::SerializeManifest(*m);
  if (!out.ok()) std::abort();
  absl::StatusOr<strata::Manifest> back = strata::ParseManifest(*out, "fuzz", limits);
  if (!back.ok()) std::abort();
  absl::StatusOr<std::string> again = strata::SerializeManifest(*back);
  if (!again.ok() || *again != *out) std::abort();
  return 0;
}
