// ValidateSchedule: the structural checks, the memory bound and the deadlock
// check (see validate.h).
#include "strata/parallel/pipeline/validate.h"

#include "absl/strings/str_cat.h"
#include "parallel/pipeline/internal/engine.h"
#include "strata/base/status.h"

namespace strata::pipeline {
namespace {

// Adds a problem for each rank whose activations exceed its limit, naming
// the action where the count first goes over.
void CheckMemory(const Schedule& s, const std::vector<int>& limit, internal::Problems* problems) {
  for (int r = 0; r < s.num_ranks(); ++r) {
    int held = 0;
    const std::vector<Action>& list = s.actions(r);
    for (size_t k = 0; k < list.size(); ++k) {
      const Action& a = list[k];
      if (a.type == ActionType::kForward) ++held;
      if (a.type == ActionType::kBackward || a.type == ActionType::kBackwardWeight) --held;
      if (held > limit[r]) {
        problems->Add(absl::StrCat(internal::Where(r, k, a), ": rank ", r, " would hold ", held,
                                   " activations at once, more than its limit of ", limit[r]));
        break;
      }
    }
  }
}

}  // namespace

absl::Status ValidateSchedule(const Schedule& schedule, const ValidateOptions& options) {
  STRATA_RETURN_IF_ERROR(CheckCostModel(options.costs, schedule.num_stages()));
  if (options.max_problems < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("ValidateOptions::max_problems is ", options.max_problems, "; want >= 1"));
  }
  const std::vector<int>& limit =
      options.max_in_flight.empty() ? schedule.activation_limit() : options.max_in_flight;
  if (!limit.empty() && static_cast<int>(limit.size()) != schedule.num_ranks()) {
    return absl::InvalidArgumentError(absl::StrCat("the activation limit has ", limit.size(),
                                                   " entries for a schedule of ",
                                                   schedule.num_ranks(), " ranks"));
  }
  bool explicit_comm = schedule.has_communication();
  if (options.communication == CommActions::kRequired) explicit_comm = true;
  if (options.communication == CommActions::kImplied) explicit_comm = false;

  internal::Problems problems(options.max_problems);
  internal::CheckStructure(schedule, explicit_comm, &problems);
  if (!problems.empty()) return absl::InvalidArgumentError(problems.Format(schedule));

  if (!limit.empty()) CheckMemory(schedule, limit, &problems);
  internal::Transfers transfers = internal::Transfers::kImplied;
  if (explicit_comm) {
    transfers = options.comm_model == CommModel::kRendezvous ? internal::Transfers::kRendezvous
                                                             : internal::Transfers::kAsync;
  }
  const internal::EngineRun run = internal::RunEngine(schedule, options.costs, transfers);
  if (!run.complete) {
    problems.Add(
        absl::StrCat(internal::DescribeDeadlock(schedule, run, options.costs), "(simulated with ",
                     explicit_comm ? CommModelName(options.comm_model) : "implied", " transfers)"));
  }
  if (!problems.empty()) return absl::InvalidArgumentError(problems.Format(schedule));
  return absl::OkStatus();
}

}  // namespace strata::pipeline
