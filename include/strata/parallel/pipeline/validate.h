// Validating a pipeline schedule before any rank runs it.
//
//   absl::Status st = strata::pipeline::ValidateSchedule(schedule);
//   // InvalidArgument: "schedule '1F1B p=2 m=2' is invalid (1 problem):
//   //   rank 1 action #2 1B0: backward of stage 1 microbatch 0 comes before
//   //   its forward (action #3 1F0)"
//
// The checks, in order (the later ones run only when the earlier pass, since
// they rely on them):
//
//  1. Every (stage, microbatch) has exactly one F and either exactly one B or
//     exactly one I and one W; on its rank, F comes before B (or I), and I
//     before W.
//  2. Dependencies between stages: F on stage s needs stage s-1's forward
//     output of the same microbatch, and B (or I) on stage s needs stage
//     s+1's input gradient. When both stages are on one rank, the producer
//     must come first in that rank's list; across ranks, a RECV_F (RECV_B)
//     from the producer's rank must come before the consumer.
//  3. Communication: each cross-rank transfer has exactly one send, after the
//     producer on the producer's rank, and exactly one receive, on the
//     consumer's rank; the peer is the neighbouring stage's rank; there is no
//     transfer between stages on the same rank. Between each ordered pair of
//     ranks, the k-th send and the k-th receive carry the same transfer
//     (transports match messages between two ranks in order; a different
//     order would hand one microbatch's tensor to another).
//  4. Memory: no rank holds more activations (forwards whose backward has not
//     finished) than ValidateOptions::max_in_flight, or the limit the
//     generator set (Schedule::activation_limit).
//  5. No deadlock: all ranks are simulated together (simulate.h) under the
//     comm model (by default kRendezvous, the strictest) and every rank must
//     reach the end of its list. A deadlock report names what each stuck
//     rank waits for and draws the rank x timestep grid before it.
//
// Problems are reported together, up to max_problems, each naming the rank,
// the action's index and token.
//
// Thread-safety: plain functions over values.
#pragma once

#include <vector>

#include "absl/status/status.h"
#include "strata/base/export.h"
#include "strata/parallel/pipeline/schedule.h"
#include "strata/parallel/pipeline/simulate.h"

namespace strata::pipeline {

// Whether the schedule's transfers are written as actions.
enum class CommActions : uint8_t {
  // Written if the schedule has any communication action, implied if none.
  kAuto,
  // Every cross-rank transfer must have its SEND and RECV (what the runner
  // executes).
  kRequired,
  // None may be written: a compute order, whose transfers happen when the
  // producer ends (what InsertCommunication takes).
  kImplied,
};

struct STRATA_EXPORT ValidateOptions {
  CommActions communication = CommActions::kAuto;
  // The transport model of the deadlock check.
  CommModel comm_model = CommModel::kRendezvous;
  // Costs of the deadlock check's simulation. They change the timestep grid
  // of a report, never whether a schedule deadlocks: in every model an
  // action waits only for other actions, never for a time.
  CostModel costs;
  // Per rank: the most activations the rank may hold; empty means
  // schedule.activation_limit() (no check when that is empty too).
  std::vector<int> max_in_flight;
  // How many problems one error lists.
  int max_problems = 10;
};

STRATA_EXPORT absl::Status ValidateSchedule(const Schedule& schedule,
                                            const ValidateOptions& options = {});

}  // namespace strata::pipeline
