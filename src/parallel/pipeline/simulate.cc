// SimulateSchedule and the cost model (see simulate.h).
#include "strata/parallel/pipeline/simulate.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "parallel/pipeline/internal/engine.h"
#include "strata/base/status.h"

namespace strata::pipeline {

double CostModel::Cost(const Action& a) const {
  double base = 0;
  switch (a.type) {
    case ActionType::kForward:
      base = forward;
      break;
    case ActionType::kBackward:
      base = backward;
      break;
    case ActionType::kBackwardInput:
      base = backward_input;
      break;
    case ActionType::kBackwardWeight:
      base = backward_weight;
      break;
    default:
      return 0;
  }
  if (stage_scale.empty()) return base;
  return base * stage_scale[a.stage];
}

absl::Status CheckCostModel(const CostModel& c, int num_stages) {
  const std::pair<const char*, double> costs[] = {{"forward", c.forward},
                                                  {"backward", c.backward},
                                                  {"backward_input", c.backward_input},
                                                  {"backward_weight", c.backward_weight}};
  for (const auto& [name, value] : costs) {
    if (!std::isfinite(value) || value <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("cost of ", name, " is ", value, "; compute costs must be finite and > 0"));
    }
  }
  if (!std::isfinite(c.transfer) || c.transfer < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("transfer cost is ", c.transfer, "; it must be finite and >= 0"));
  }
  if (!c.stage_scale.empty() && static_cast<int>(c.stage_scale.size()) != num_stages) {
    return absl::InvalidArgumentError(absl::StrCat("stage_scale has ", c.stage_scale.size(),
                                                   " entries for ", num_stages, " stages"));
  }
  for (size_t s = 0; s < c.stage_scale.size(); ++s) {
    if (!std::isfinite(c.stage_scale[s]) || c.stage_scale[s] <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("stage_scale[", s, "] is ", c.stage_scale[s],
                                                     "; scales must be finite and > 0"));
    }
  }
  return absl::OkStatus();
}

const char* CommModelName(CommModel model) {
  return model == CommModel::kRendezvous ? "rendezvous" : "async";
}

absl::StatusOr<CommModel> ParseCommModel(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower == "rendezvous") return CommModel::kRendezvous;
  if (lower == "async") return CommModel::kAsync;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown comm model '", name, "' (expected rendezvous or async)"));
}

double SimulationResult::mean_bubble_fraction() const {
  if (bubble_fraction.empty()) return 0;
  double sum = 0;
  for (double b : bubble_fraction) sum += b;
  return sum / static_cast<double>(bubble_fraction.size());
}

std::vector<int> PeakInFlight(const Schedule& schedule) {
  std::vector<int> peak(schedule.num_ranks(), 0);
  for (int r = 0; r < schedule.num_ranks(); ++r) {
    int held = 0;
    for (const Action& a : schedule.actions(r)) {
      if (a.type == ActionType::kForward) ++held;
      if (a.type == ActionType::kBackward || a.type == ActionType::kBackwardWeight) --held;
      peak[r] = std::max(peak[r], held);
    }
  }
  return peak;
}

absl::StatusOr<SimulationResult> SimulateSchedule(const Schedule& schedule,
                                                  const SimulateOptions& options) {
  STRATA_RETURN_IF_ERROR(CheckCostModel(options.costs, schedule.num_stages()));
  const bool explicit_comm = schedule.has_communication();
  internal::Problems problems(10);
  internal::CheckStructure(schedule, explicit_comm, &problems);
  if (!problems.empty()) return absl::InvalidArgumentError(problems.Format(schedule));

  internal::Transfers transfers = internal::Transfers::kImplied;
  if (explicit_comm) {
    transfers = options.comm_model == CommModel::kRendezvous ? internal::Transfers::kRendezvous
                                                             : internal::Transfers::kAsync;
  }
  internal::EngineRun run = internal::RunEngine(schedule, options.costs, transfers);
  if (!run.complete) {
    return absl::InvalidArgumentError(
        absl::StrCat(schedule.name().empty() ? "schedule" : "schedule '" + schedule.name() + "'",
                     ": ", internal::DescribeDeadlock(schedule, run, options.costs)));
  }
  SimulationResult result;
  const int p = schedule.num_ranks();
  result.makespan = run.end_time;
  result.busy.assign(p, 0.0);
  result.bubble_fraction.assign(p, 0.0);
  for (int r = 0; r < p; ++r) {
    const std::vector<Action>& list = schedule.actions(r);
    for (size_t k = 0; k < list.size(); ++k) {
      if (list[k].is_compute()) result.busy[r] += run.timeline[r][k].end - run.timeline[r][k].start;
    }
    if (result.makespan > 0) result.bubble_fraction[r] = 1.0 - result.busy[r] / result.makespan;
  }
  result.peak_in_flight = PeakInFlight(schedule);
  result.timeline = std::move(run.timeline);
  return result;
}

}  // namespace strata::pipeline
