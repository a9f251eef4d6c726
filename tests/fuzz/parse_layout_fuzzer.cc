// StageLayout::Parse on arbitrary text: never crashes, and whatever parses
// prints to a canonical text that parses to an equal layout.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "strata/parallel/pipeline/layout.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using strata::pipeline::StageLayout;
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<StageLayout> l = StageLayout::Parse(text);
  if (!l.ok()) return 0;
  absl::StatusOr<StageLayout> again = StageLayout::Parse(l->ToText());
  if (!again.ok() || !(*again == *l) || again->ToText() != l->ToText()) std::abort();
  (void)l->Describe(3);
  (void)l->StageWeights();
  return 0;
}
