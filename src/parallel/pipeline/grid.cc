// RenderGrid: the rank x timestep picture of a simulated schedule.
#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "strata/parallel/pipeline/simulate.h"

namespace strata::pipeline {
namespace {

// Beyond this the grid stops being readable; the caller can draw a window.
constexpr int64_t kMaxColumns = 2048;

void Pad(std::string* s, size_t width) {
  if (s->size() < width) s->append(width - s->size(), ' ');
}

}  // namespace

std::string RenderGrid(const Schedule& schedule, const SimulationResult& result,
                       const GridOptions& options) {
  const int p = std::min(schedule.num_ranks(), static_cast<int>(result.timeline.size()));
  auto visible = [&](int r) {
    return std::min(schedule.actions(r).size(), result.timeline[r].size());
  };
  double unit = options.unit;
  if (!(unit > 0) || !std::isfinite(unit)) {
    unit = std::numeric_limits<double>::infinity();
    for (int r = 0; r < p; ++r) {
      for (size_t k = 0; k < visible(r); ++k) {
        const double d = result.timeline[r][k].end - result.timeline[r][k].start;
        if (schedule.actions(r)[k].is_compute() && d > 0) unit = std::min(unit, d);
      }
    }
    if (!std::isfinite(unit)) unit = 1;
  }
  const double begin = std::max(0.0, options.begin);
  const double end = options.end < 0 ? result.makespan : options.end;
  int64_t columns = std::max<int64_t>(0, std::ceil((end - begin) / unit - 1e-9));
  const bool cut = columns > kMaxColumns;
  columns = std::min(columns, kMaxColumns);

  size_t width = 3;
  std::vector<std::string> times(columns);
  for (int64_t c = 0; c < columns; ++c) {
    times[c] = absl::StrFormat("%g", begin + static_cast<double>(c) * unit);
    width = std::max(width, times[c].size());
  }
  std::vector<std::vector<std::string>> cells(p, std::vector<std::string>(columns, "."));
  for (int r = 0; r < p; ++r) {
    for (size_t k = 0; k < visible(r); ++k) {
      const Action& a = schedule.actions(r)[k];
      const ActionTiming& t = result.timeline[r][k];
      if (!a.is_compute() || t.end <= begin || t.start >= end) continue;
      const int64_t c0 = static_cast<int64_t>(std::floor((t.start - begin) / unit + 1e-9));
      const int64_t c1 =
          std::max(c0 + 1, static_cast<int64_t>(std::ceil((t.end - begin) / unit - 1e-9)));
      const std::string token = a.ToString();
      width = std::max(width, token.size());
      for (int64_t c = std::max<int64_t>(c0, 0); c < std::min(c1, columns); ++c) {
        cells[r][c] = c == c0 ? token : "~";
      }
    }
  }
  const size_t label = absl::StrCat("rank ", std::max(0, p - 1)).size();
  std::string out = "time";
  Pad(&out, label);
  for (int64_t c = 0; c < columns; ++c) {
    out.push_back(' ');
    std::string cell = times[c];
    Pad(&cell, width);
    out += cell;
  }
  out = std::string(absl::StripTrailingAsciiWhitespace(out));
  out.push_back('\n');
  for (int r = 0; r < p; ++r) {
    std::string line = absl::StrCat("rank ", r);
    Pad(&line, label);
    for (int64_t c = 0; c < columns; ++c) {
      line.push_back(' ');
      std::string cell = cells[r][c];
      Pad(&cell, width);
      line += cell;
    }
    absl::StrAppend(&out, absl::StripTrailingAsciiWhitespace(line));
    out.push_back('\n');
  }
  if (cut)
    absl::StrAppend(&out, "(cut at ", kMaxColumns, " columns; draw a window with GridOptions)\n");
  return out;
}

}  // namespace strata::pipeline
