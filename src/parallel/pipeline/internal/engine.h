// The machinery shared by the validator, the simulator and communication
// insertion: the structural checks and the simulation engine.
//
// Thread-safety: plain functions over values; Problems is not thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strata/parallel/pipeline/schedule.h"
#include "strata/parallel/pipeline/simulate.h"

namespace strata::pipeline::internal {

// How transfers between ranks happen in a run.
enum class Transfers : uint8_t {
  kImplied,     // no communication actions: the consumer waits for the producer
  kRendezvous,  // CommModel::kRendezvous
  kAsync,       // CommModel::kAsync
};

// Problems found by a check, kept up to a limit and counted beyond it.
class Problems {
 public:
  explicit Problems(int max) : max_(max) {}
  void Add(std::string problem) {
    if (static_cast<int64_t>(items_.size()) < max_) items_.push_back(std::move(problem));
    ++total_;
  }
  bool empty() const { return total_ == 0; }
  int64_t total() const { return total_; }
  const std::vector<std::string>& items() const { return items_; }
  // "schedule 'x' is invalid (3 problems):\n  - ...\n  - ..."
  std::string Format(const Schedule& schedule) const;

 private:
  int64_t max_;
  int64_t total_ = 0;
  std::vector<std::string> items_;
};

// "rank 1 action #3 1B0".
std::string Where(int rank, int64_t index, const Action& action);

// The action on the other end of a transfer: SEND_F(s, i) on rank r pairs
// with RECV_F(s + 1, i) from r, SEND_B(s, i) with RECV_B(s - 1, i), and the
// reverse. Only for communication actions.
Action Counterpart(const Action& action, int rank);

// Checks 1-3 of validate.h (compute counts and order, dependencies,
// communication). With `explicit_comm` false the schedule must have no
// communication actions.
void CheckStructure(const Schedule& schedule, bool explicit_comm, Problems* problems);

struct EngineRun {
  // Every rank reached the end of its list.
  bool complete = false;
  // Per rank, the timings of the actions that ran (a prefix of the list).
  std::vector<std::vector<ActionTiming>> timeline;
  // The time of the last event.
  double end_time = 0;
  // When incomplete: one line per stuck rank saying what it waits for.
  std::vector<std::string> stuck;
};

// Runs every rank's list under `costs` (checked) and `transfers`. Assumes
// CheckStructure found no problem. An action waits only for other actions,
// so whether the run completes does not depend on the costs.
EngineRun RunEngine(const Schedule& schedule, const CostModel& costs, Transfers transfers);

// The deadlock error for an incomplete run: the stuck ranks and the grid of
// the timesteps before the deadlock.
std::string DescribeDeadlock(const Schedule& schedule, const EngineRun& run,
                             const CostModel& costs);

}  // namespace strata::pipeline::internal
