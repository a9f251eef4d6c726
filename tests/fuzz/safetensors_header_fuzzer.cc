// The safetensors header parser on arbitrary file heads: never crashes,
// hangs or over-allocates (bounded by the runner's limits), and whatever it
// accepts tiles the data section and survives a rebuild: the header strata
// would write for the same tensors parses back to the same tensors.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "strata/checkpoint/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string file(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<strata::SafetensorsHeader> h = strata::ParseSafetensors(file, file.size());
  if (!h.ok()) return 0;
  uint64_t expect = 0;
  for (const strata::SafetensorsEntry& e : h->entries) {
    if (e.begin != expect || e.end < e.begin) std::abort();
    expect = e.end;
  }
  if (expect != file.size() - h->data_start) std::abort();
  absl::StatusOr<strata::SafetensorsLayout> again =
      strata::BuildSafetensorsHeader(h->entries, h->metadata);
  if (!again.ok()) {
    // Only names the writer refuses may fail (an empty name).
    for (const strata::SafetensorsEntry& e : h->entries) {
      if (e.name.empty()) return 0;
    }
    std::abort();
  }
  const std::string rebuilt = again->bytes + std::string(again->header.data_bytes, '\0');
  absl::StatusOr<strata::SafetensorsHeader> back =
      strata::ParseSafetensors(rebuilt, rebuilt.size());
  if (!back.ok() || back->entries.size() != h->entries.size() || back->metadata != h->metadata) {
    std::abort();
  }
  for (const strata::SafetensorsEntry& e : back->entries) {
    const strata::SafetensorsEntry* orig = h->Find(e.name);
    if (orig == nullptr || orig->dtype != e.dtype || orig->shape != e.shape) std::abort();
  }
  return 0;
}
