// Simulating a pipeline schedule: every rank runs its action list against a
// cost model, and the simulator reports the makespan, each rank's bubble
// (idle share of the makespan), the peak number of activations each rank
// holds, and a rank x timestep grid for humans.
//
//   strata::pipeline::SimulateOptions options;
//   options.costs.backward = 2.0;                    // B costs twice F
//   absl::StatusOr<strata::pipeline::SimulationResult> r =
//       strata::pipeline::SimulateSchedule(schedule, options);
//   r->makespan;                // 33 for 1F1B with p=4, m=8
//   r->bubble_fraction[0];      // 3/11 = (p-1)/(m+p-1)
//   std::puts(strata::pipeline::RenderGrid(schedule, *r).c_str());
//
// The model. Compute actions (F, B, I, W) take their cost on their rank; a
// rank runs one action at a time, in its list's order. A transfer is:
//   * in a schedule without communication actions (a compute order), implied:
//     the consumer may start `transfer` after the producer ends;
//   * with communication actions, per CommModel: kAsync (what the runner
//     does: a send is posted and the rank moves on, a receive is posted, and
//     the compute that needs the data waits for it), or kRendezvous (the
//     strictest: a send and its receive complete together once both ranks
//     have reached them, and both ranks wait; MPI_Ssend, or NCCL without
//     groups). A schedule that runs under kRendezvous runs under any
//     transport that is at least as permissive.
// A schedule where some rank can never proceed is a deadlock: an
// InvalidArgument error that says which rank waits for what, with the grid
// of the last timesteps before it.
//
// SimulateSchedule first checks the schedule as the validator does
// (validate.h) without the deadlock and memory checks it performs itself.
//
// Thread-safety: plain functions over values.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "strata/base/export.h"
#include "strata/parallel/pipeline/schedule.h"

namespace strata::pipeline {

// Costs of the actions, in any time unit.
struct STRATA_EXPORT CostModel {
  double forward = 1.0;
  double backward = 1.0;         // B
  double backward_input = 0.5;   // I
  double backward_weight = 0.5;  // W
  // From a send to the data's arrival (kAsync, implied), or the time a
  // matched send/receive pair takes (kRendezvous). >= 0.
  double transfer = 0.0;
  // Optional multiplier of the compute costs of each stage (size
  // num_stages), e.g. from StageLayout::StageWeights for uneven layouts;
  // empty: 1 for every stage.
  std::vector<double> stage_scale;

  // The cost of a compute action under this model (0 for communication).
  double Cost(const Action& action) const;
};

// InvalidArgument unless every compute cost and scale is finite and > 0,
// transfer is finite and >= 0, and stage_scale is empty or has
// `num_stages` entries.
STRATA_EXPORT absl::Status CheckCostModel(const CostModel& costs, int num_stages);

enum class CommModel : uint8_t { kRendezvous, kAsync };

// "rendezvous", "async".
STRATA_EXPORT const char* CommModelName(CommModel model);
STRATA_EXPORT absl::StatusOr<CommModel> ParseCommModel(absl::string_view name);

struct STRATA_EXPORT SimulateOptions {
  CostModel costs;
  CommModel comm_model = CommModel::kAsync;
};

// When one action of a rank ran.
struct STRATA_EXPORT ActionTiming {
  double start = 0;
  double end = 0;
};

struct STRATA_EXPORT SimulationResult {
  // When the last action ends (the first starts at 0).
  double makespan = 0;
  // Per rank: time spent in compute actions.
  std::vector<double> busy;
  // Per rank: 1 - busy / makespan (0 for an empty schedule).
  std::vector<double> bubble_fraction;
  // Per rank: the most activations held at once (a forward adds one, its
  // backward, or its weight-gradient W, releases it).
  std::vector<int> peak_in_flight;
  // Per rank, per action (same indices as Schedule::actions(rank)).
  std::vector<std::vector<ActionTiming>> timeline;

  // The mean of bubble_fraction over ranks.
  double mean_bubble_fraction() const;
};

STRATA_EXPORT absl::StatusOr<SimulationResult> SimulateSchedule(
    const Schedule& schedule, const SimulateOptions& options = {});

// Per rank: the most activations held at once when the rank runs its list
// (the same count as SimulationResult::peak_in_flight; it does not depend on
// timing).
STRATA_EXPORT std::vector<int> PeakInFlight(const Schedule& schedule);

struct STRATA_EXPORT GridOptions {
  // Width of one column in time units; 0: the smallest compute cost that
  // occurs (with unit costs, one column per action).
  double unit = 0;
  // The time window to draw; end < 0 means up to the makespan.
  double begin = 0;
  double end = -1;
};

// The rank x timestep grid: one row per rank, one column per `unit` of time;
// a compute action shows its token in the column where it starts and '~'
// while it continues, idle time shows '.'. Communication takes no column.
//
//   time    0   1   2   3   4   5   6   7   8   9
//   rank 0  0F0 0F1 .   .   0B0 0B1 ...
STRATA_EXPORT std::string RenderGrid(const Schedule& schedule, const SimulationResult& result,
                                     const GridOptions& options = {});

}  // namespace strata::pipeline
