// The simulation engine: every rank runs its list; an action runs as soon as
// what it waits for has happened, and its times follow from the costs.
//
// The engine sweeps over the ranks, running each as far as it can. Times are
// computed from the times of the actions waited for (a longest-path
// computation over the schedule's dependency graph), so the sweep order does
// not change them. A sweep in which no rank moves while some have actions
// left is a deadlock.
#include "parallel/pipeline/internal/engine.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "strata/base/status.h"

namespace strata::pipeline::internal {
namespace {

constexpr double kNotYet = std::numeric_limits<double>::quiet_NaN();

class Engine {
 public:
  Engine(const Schedule& schedule, const CostModel& costs, Transfers transfers)
      : s_(schedule),
        costs_(costs),
        transfers_(transfers),
        p_(schedule.num_ranks()),
        num_stages_(schedule.num_stages()),
        m_(schedule.num_microbatches()),
        forward_end_(Cells(), kNotYet),
        input_grad_end_(Cells(), kNotYet),
        forward_arrival_(Cells(), kNotYet),
        grad_arrival_(Cells(), kNotYet),
        pc_(p_, 0),
        clock_(p_, 0.0) {
    run_.timeline.resize(p_);
    for (int r = 0; r < p_; ++r) run_.timeline[r].reserve(s_.actions(r).size());
  }

  EngineRun Run() {
    for (;;) {
      bool moved = false;
      bool done = true;
      for (int r = 0; r < p_; ++r) {
        while (pc_[r] < s_.actions(r).size() && Step(r)) moved = true;
        done &= pc_[r] == s_.actions(r).size();
      }
      if (done) {
        run_.complete = true;
        break;
      }
      if (!moved) {
        DescribeStuck();
        break;
      }
    }
    run_.end_time = *std::max_element(clock_.begin(), clock_.end());
    return std::move(run_);
  }

 private:
  size_t Cells() const { return static_cast<size_t>(num_stages_) * m_; }
  size_t Cell(int stage, int microbatch) const {
    return static_cast<size_t>(stage) * m_ + microbatch;
  }

  // When the input of compute action `a` on rank `r` is available, or NaN
  // while it is not. Inputs from a stage on the same rank come earlier in
  // the list (CheckStructure), so they are ready by the rank's clock.
  double InputReady(int r, const Action& a) const {
    const double now = clock_[r];
    if (a.type == ActionType::kForward) {
      if (a.stage == 0 || s_.rank_of_stage(a.stage - 1) == r) return now;
      if (transfers_ == Transfers::kImplied) {
        return forward_end_[Cell(a.stage - 1, a.microbatch)] + costs_.transfer;
      }
      return forward_arrival_[Cell(a.stage, a.microbatch)];
    }
    if (a.type == ActionType::kBackwardWeight) return now;
    // B or I: the output gradient from the next stage.
    if (a.stage == num_stages_ - 1 || s_.rank_of_stage(a.stage + 1) == r) return now;
    if (transfers_ == Transfers::kImplied) {
      return input_grad_end_[Cell(a.stage + 1, a.microbatch)] + costs_.transfer;
    }
    return grad_arrival_[Cell(a.stage, a.microbatch)];
  }

  void Record(int r, double start, double end) {
    run_.timeline[r].push_back({start, end});
    clock_[r] = end;
    ++pc_[r];
  }

  // Where a transfer's data lands: the consumer stage's arrival cell.
  double& Arrival(const Action& send) {
    return send.type == ActionType::kSendForward
               ? forward_arrival_[Cell(send.stage + 1, send.microbatch)]
               : grad_arrival_[Cell(send.stage - 1, send.microbatch)];
  }

  // Runs the next action of rank r if it can; returns whether it did.
  bool Step(int r) {
    const Action& a = s_.actions(r)[pc_[r]];
    if (a.is_compute()) {
      const double ready = InputReady(r, a);
      if (std::isnan(ready)) return false;
      const double start = std::max(clock_[r], ready);
      const double end = start + costs_.Cost(a);
      if (a.type == ActionType::kForward) forward_end_[Cell(a.stage, a.microbatch)] = end;
      if (a.type == ActionType::kBackward || a.type == ActionType::kBackwardInput) {
        input_grad_end_[Cell(a.stage, a.microbatch)] = end;
      }
      Record(r, start, end);
      return true;
    }
    if (transfers_ == Transfers::kAsync) {
      if (a.is_send()) Arrival(a) = clock_[r] + costs_.transfer;
      Record(r, clock_[r], clock_[r]);
      return true;
    }
    STRATA_CHECK(transfers_ == Transfers::kRendezvous, "communication action ", a.ToString(),
                 " in a schedule simulated with implied transfers");
    // Both ends must be at the head of their lists.
    const int q = a.peer;
    if (pc_[q] >= s_.actions(q).size() || s_.actions(q)[pc_[q]] != Counterpart(a, r)) return false;
    const double start = std::max(clock_[r], clock_[q]);
    const double end = start + costs_.transfer;
    Arrival(a.is_send() ? a : s_.actions(q)[pc_[q]]) = end;
    Record(q, clock_[q], end);
    Record(r, clock_[r], end);
    return true;
  }

  std::string At(int q) const {
    if (pc_[q] >= s_.actions(q).size()) return absl::StrCat("rank ", q, " has finished");
    return absl::StrCat("rank ", q, " waits at action #", pc_[q], " ",
                        s_.actions(q)[pc_[q]].ToString());
  }

  void DescribeStuck() {
    for (int r = 0; r < p_; ++r) {
      if (pc_[r] >= s_.actions(r).size()) continue;
      const Action& a = s_.actions(r)[pc_[r]];
      std::string line = absl::StrCat(Where(r, pc_[r], a), " waits ");
      if (a.is_comm()) {
        absl::StrAppend(&line, "for rank ", a.peer, " to reach ", Counterpart(a, r).ToString(),
                        " (", At(a.peer), ")");
      } else {
        const bool forward = a.type == ActionType::kForward;
        const int from = forward ? a.stage - 1 : a.stage + 1;
        const int q = s_.rank_of_stage(from);
        std::string producer =
            forward ? Action::Forward(from, a.microbatch).ToString()
                    : absl::StrCat("stage ", from, " microbatch ", a.microbatch, " (its B or I)");
        if (transfers_ != Transfers::kImplied) {
          producer = Action::Comm(forward ? ActionType::kSendForward : ActionType::kSendBackward,
                                  from, a.microbatch, r)
                         .ToString();
        }
        absl::StrAppend(&line, "for ", forward ? "the forward output" : "the gradient", " of ",
                        producer, " on rank ", q, " (", At(q), ")");
      }
      run_.stuck.push_back(std::move(line));
    }
  }

  const Schedule& s_;
  const CostModel& costs_;
  const Transfers transfers_;
  const int p_;
  const int num_stages_;
  const int m_;
  std::vector<double> forward_end_;      // F(stage, mb) ended
  std::vector<double> input_grad_end_;   // B or I (stage, mb) ended
  std::vector<double> forward_arrival_;  // stage's forward input arrived
  std::vector<double> grad_arrival_;     // stage's output gradient arrived
  std::vector<size_t> pc_;
  std::vector<double> clock_;
  EngineRun run_;
};

}  // namespace

EngineRun RunEngine(const Schedule& schedule, const CostModel& costs, Transfers transfers) {
  return Engine(schedule, costs, transfers).Run();
}

std::string DescribeDeadlock(const Schedule& schedule, const EngineRun& run,
                             const CostModel& costs) {
  SimulationResult partial;
  partial.timeline = run.timeline;
  partial.makespan = run.end_time;
  GridOptions grid;
  // The grid's unit is the smallest compute cost; show the last 12 columns.
  double unit = std::numeric_limits<double>::infinity();
  for (int r = 0; r < schedule.num_ranks(); ++r) {
    for (const Action& a : schedule.actions(r)) {
      if (a.is_compute()) unit = std::min(unit, costs.Cost(a));
    }
  }
  if (!std::isfinite(unit)) unit = 1;
  grid.unit = unit;
  grid.begin = std::max(0.0, std::floor(run.end_time / unit) * unit - 11 * unit);
  grid.end = run.end_time + unit;
  return absl::StrCat("deadlock: no rank can proceed after time ", run.end_time, ":\n  ",
                      absl::StrJoin(run.stuck, "\n  "), "\nthe last timesteps:\n",
                      RenderGrid(schedule, partial, grid));
}

}  // namespace strata::pipeline::internal
