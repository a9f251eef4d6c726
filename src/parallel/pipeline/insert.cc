// InsertCommunication: SEND and RECV actions in a deadlock-free order (the
// argument is in generate.h and docs/pipeline.md).
#include <algorithm>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "parallel/pipeline/internal/engine.h"
#include "strata/base/status.h"
#include "strata/parallel/pipeline/generate.h"

namespace strata::pipeline {
namespace {

// One communication action to insert on a rank.
struct Pending {
  double t;          // when the producer ends
  int sender_stage;  // with microbatch and direction: the transfer's identity
  int microbatch;
  bool backward;
  size_t position;  // goes before the rank's compute action of this index
  Action action;

  auto Key() const { return std::make_tuple(t, sender_stage, microbatch, backward); }
};

}  // namespace

absl::StatusOr<Schedule> InsertCommunication(const Schedule& order, const InsertOptions& options) {
  STRATA_RETURN_IF_ERROR(CheckCostModel(options.costs, order.num_stages()));
  if (order.has_communication()) {
    return absl::InvalidArgumentError(
        "the schedule already has communication actions; InsertCommunication takes a compute "
        "order (F, B, I, W only)");
  }
  internal::Problems problems(10);
  internal::CheckStructure(order, /*explicit_comm=*/false, &problems);
  if (!problems.empty()) return absl::InvalidArgumentError(problems.Format(order));
  const internal::EngineRun run =
      internal::RunEngine(order, options.costs, internal::Transfers::kImplied);
  if (!run.complete) {
    return absl::InvalidArgumentError(
        absl::StrCat("the compute order deadlocks even with implied transfers: ",
                     internal::DescribeDeadlock(order, run, options.costs)));
  }

  const int p = order.num_ranks(), num_stages = order.num_stages(), m = order.num_microbatches();
  // Start times per rank (increasing), and where each producer is.
  std::vector<std::vector<double>> starts(p);
  std::vector<int> forward_at(static_cast<size_t>(num_stages) * m, -1);
  std::vector<int> grad_at(static_cast<size_t>(num_stages) * m, -1);  // B or I
  for (int r = 0; r < p; ++r) {
    const std::vector<Action>& list = order.actions(r);
    for (size_t k = 0; k < list.size(); ++k) {
      const ActionTiming& t = run.timeline[r][k];
      // The ordering argument needs every compute to take time; costs too far
      // apart in magnitude can round a duration away.
      if (!(t.end > t.start)) {
        return absl::InvalidArgumentError(absl::StrCat(
            internal::Where(r, k, list[k]), " takes no time in double precision (starts at ",
            t.start, ", costs ", options.costs.Cost(list[k]), "); use costs of closer magnitude"));
      }
      starts[r].push_back(t.start);
      const size_t cell = static_cast<size_t>(list[k].stage) * m + list[k].microbatch;
      if (list[k].type == ActionType::kForward) forward_at[cell] = static_cast<int>(k);
      if (list[k].type == ActionType::kBackward || list[k].type == ActionType::kBackwardInput) {
        grad_at[cell] = static_cast<int>(k);
      }
    }
  }
  // Receives go after the computes that start before the data exists.
  auto recv_position = [&](int rank, double t) {
    return static_cast<size_t>(std::lower_bound(starts[rank].begin(), starts[rank].end(), t) -
                               starts[rank].begin());
  };

  std::vector<std::vector<Pending>> pending(p);
  for (int st = 0; st < num_stages; ++st) {
    const int r = order.rank_of_stage(st);
    for (int i = 0; i < m; ++i) {
      const size_t cell = static_cast<size_t>(st) * m + i;
      if (st + 1 < num_stages && order.rank_of_stage(st + 1) != r) {
        const int q = order.rank_of_stage(st + 1);
        const int k = forward_at[cell];
        const double t = run.timeline[r][k].end;
        pending[r].push_back({t, st, i, false, static_cast<size_t>(k) + 1,
                              Action::Comm(ActionType::kSendForward, st, i, q)});
        pending[q].push_back({t, st, i, false, recv_position(q, t),
                              Action::Comm(ActionType::kRecvForward, st + 1, i, r)});
      }
      if (st > 0 && order.rank_of_stage(st - 1) != r) {
        const int q = order.rank_of_stage(st - 1);
        const int k = grad_at[cell];
        const double t = run.timeline[r][k].end;
        pending[r].push_back({t, st, i, true, static_cast<size_t>(k) + 1,
                              Action::Comm(ActionType::kSendBackward, st, i, q)});
        pending[q].push_back({t, st, i, true, recv_position(q, t),
                              Action::Comm(ActionType::kRecvBackward, st - 1, i, r)});
      }
    }
  }

  std::vector<std::vector<Action>> ranks(p);
  for (int r = 0; r < p; ++r) {
    std::vector<Pending>& ops = pending[r];
    std::sort(ops.begin(), ops.end(),
              [](const Pending& a, const Pending& b) { return a.Key() < b.Key(); });
    const std::vector<Action>& computes = order.actions(r);
    std::vector<Action>& out = ranks[r];
    out.reserve(computes.size() + ops.size());
    size_t next = 0;
    for (const Pending& op : ops) {
      // Positions are monotone in the key (see generate.h); a violation is a
      // bug in this function, not in the input.
      STRATA_CHECK(op.position >= next, "communication order is not monotone on rank ", r, " at ",
                   op.action.ToString());
      while (next < op.position) out.push_back(computes[next++]);
      out.push_back(op.action);
    }
    while (next < computes.size()) out.push_back(computes[next++]);
  }
  STRATA_ASSIGN_OR_RETURN(Schedule schedule, Schedule::Create(std::move(ranks)));
  schedule.set_name(order.name());
  schedule.set_activation_limit(order.activation_limit());
  return schedule;
}

}  // namespace strata::pipeline
