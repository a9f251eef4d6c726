// Schedule::Parse on arbitrary text: never crashes; whatever parses prints
// back to text that parses to an equal schedule and prints the same; and the
// validator and simulator handle it (an answer, never a crash or a hang).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "strata/parallel/pipeline/schedule.h"
#include "strata/parallel/pipeline/simulate.h"
#include "strata/parallel/pipeline/validate.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using strata::pipeline::Schedule;
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<Schedule> s = Schedule::Parse(text);
  if (!s.ok()) return 0;
  const std::string printed = s->ToText();
  absl::StatusOr<Schedule> again = Schedule::Parse(printed);
  if (!again.ok() || !(*again == *s) || again->ToText() != printed) std::abort();
  // Keep the per-(stage, microbatch) tables small enough for quick runs.
  if (static_cast<int64_t>(s->num_stages()) * s->num_microbatches() > (1 << 16)) return 0;
  const absl::Status valid = strata::pipeline::ValidateSchedule(*s);
  absl::StatusOr<strata::pipeline::SimulationResult> r = strata::pipeline::SimulateSchedule(*s);
  if (r.ok()) {
    (void)strata::pipeline::RenderGrid(*s, *r);
  } else if (valid.ok()) {  // what passes rendezvous must pass async
    std::abort();
  }
  return 0;
}
