// The schedule generators: GPipe, 1F1B, interleaved 1F1B, zero-bubble H1
// (see generate.h).
#include "strata/parallel/pipeline/generate.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <queue>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "strata/base/status.h"

namespace strata::pipeline {
namespace {

int GroupSize(const ScheduleOptions& o) {
  return o.microbatch_group_size == 0 ? o.num_ranks : o.microbatch_group_size;
}

// Group sizes N in [p, m] that interleaving accepts for m microbatches, at
// most `limit` of them, for error messages.
std::vector<int> AcceptedGroupSizes(int p, int m, size_t limit) {
  std::vector<int> out;
  for (int n = p; n <= m && out.size() < limit; ++n) {
    if (m % n == 0 || m % n >= p) out.push_back(n);
  }
  return out;
}

absl::Status CheckInterleaving(const ScheduleOptions& o) {
  const int p = o.num_ranks, m = o.num_microbatches, v = o.virtual_stages;
  if (v == 1) {
    if (o.microbatch_group_size != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "microbatch_group_size ", o.microbatch_group_size,
          " has no effect with virtual_stages 1 (the schedule is plain 1F1B); leave it 0"));
    }
    return absl::OkStatus();
  }
  if (o.microbatch_group_size < 0) {
    return absl::InvalidArgumentError(absl::StrCat("microbatch_group_size is ",
                                                   o.microbatch_group_size,
                                                   "; want 0 (meaning p) or a size >= p"));
  }
  const int n = GroupSize(o);
  const std::string why_p = absl::StrCat(
      "a microbatch takes p = ", p, " forwards to cross the ", p,
      " ranks and come back to rank 0 for its next chunk, so with fewer than p microbatches "
      "per group rank 0 runs out of work and waits (a dependency bubble)");
  if (m < p && o.microbatch_group_size == 0) {
    return absl::InvalidArgumentError(absl::StrCat("interleaved 1F1B needs at least p = ", p,
                                                   " microbatches, got m = ", m, ": ", why_p,
                                                   "; use 1F1B, or m >= ", p));
  }
  if (n < p) {
    return absl::InvalidArgumentError(
        absl::StrCat("microbatch_group_size N = ", n, " is smaller than p = ", p, ": ", why_p));
  }
  if (n > m) {
    return absl::InvalidArgumentError(absl::StrCat(
        "microbatch_group_size N = ", n, " is larger than the number of microbatches m = ", m,
        "; a group has at most m microbatches"));
  }
  const int last = m % n;
  if (last != 0 && last < p) {
    std::string hint;
    const std::vector<int> sizes = AcceptedGroupSizes(p, m, 6);
    if (!sizes.empty()) {
      hint = absl::StrCat("; microbatch_group_size ", absl::StrJoin(sizes, ", "),
                          sizes.size() == 6 ? ", ..." : "", " would work for m = ", m);
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "interleaved 1F1B with m = ", m, " microbatches in groups of N = ", n,
        " leaves a last group of ", last, " microbatches, fewer than p = ", p, ": ", why_p,
        "; make m a multiple of N, or choose N with m mod N = 0 or >= p", hint));
  }
  return absl::OkStatus();
}

std::string Name(const ScheduleOptions& o) {
  const int p = o.num_ranks, m = o.num_microbatches;
  switch (o.kind) {
    case ScheduleKind::kGPipe:
      return absl::StrCat("GPipe p=", p, " m=", m);
    case ScheduleKind::k1F1B:
      return absl::StrCat("1F1B p=", p, " m=", m);
    case ScheduleKind::kZeroBubbleH1:
      return absl::StrCat("ZB-H1 p=", p, " m=", m);
    case ScheduleKind::kInterleaved1F1B:
      if (o.virtual_stages == 1) return absl::StrCat("interleaved 1F1B p=", p, " m=", m, " v=1");
      return absl::StrCat("interleaved 1F1B p=", p, " m=", m, " v=", o.virtual_stages,
                          " N=", GroupSize(o));
  }
  return "?";
}

// Forward and backward orders of one rank, merged as warmup forwards, then
// one forward / one backward, then the remaining backwards.
std::vector<Action> OneForwardOneBackward(const std::vector<Action>& forwards,
                                          const std::vector<Action>& backwards, size_t warmup) {
  std::vector<Action> out;
  out.reserve(forwards.size() + backwards.size());
  warmup = std::min(warmup, forwards.size());
  for (size_t k = 0; k < warmup; ++k) out.push_back(forwards[k]);
  size_t b = 0;
  for (size_t k = warmup; k < forwards.size(); ++k) {
    out.push_back(forwards[k]);
    out.push_back(backwards[b++]);
  }
  while (b < backwards.size()) out.push_back(backwards[b++]);
  return out;
}

// Zero-bubble H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): the
// backward split into I (input gradient) and W (weight gradient). Each rank
// takes its forwards and input gradients in 1F1B's order, and runs a pending
// W only when its next F or I cannot start yet (its input has not arrived),
// or when one more forward would hold more than `limit` activations (an
// activation lives from its F to its W). The order is found by simulating
// every rank under `costs` with free transfers, list-scheduling style: the
// rank that is free first decides next (a rank whose input no rank has
// scheduled yet waits for the next F or I to be scheduled). O(p m log p).
std::vector<std::vector<Action>> ZeroBubbleH1(int p, int m, int limit, const CostModel& costs) {
  constexpr double kNever = std::numeric_limits<double>::infinity();
  struct Rank {
    std::vector<Action> main;                   // F and I in 1F1B order
    size_t next = 0;                            // into main
    int forwards = 0, inputs = 0, weights = 0;  // done
    double free = 0;                            // when the rank can start its next action
    std::vector<Action> out;
  };
  std::vector<Rank> ranks(p);
  for (int r = 0; r < p; ++r) {
    std::vector<Action> f, b;
    for (int i = 0; i < m; ++i) {
      f.push_back(Action::Forward(r, i));
      b.push_back(Action::BackwardInput(r, i));
    }
    ranks[r].main = OneForwardOneBackward(f, b, std::min(p - r - 1, m));
  }
  // End times of F (stage * m + i) and I, kNever until scheduled.
  std::vector<double> f_end(static_cast<size_t>(p) * m, kNever), i_end(f_end);
  auto ready = [&](int r, const Action& a) {  // when a's inputs are there
    const size_t cell = static_cast<size_t>(r) * m + a.microbatch;
    if (a.type == ActionType::kForward) return r == 0 ? 0.0 : f_end[cell - m];
    return r == p - 1 ? f_end[cell] : std::max(f_end[cell], i_end[cell + m]);
  };
  // Ranks by when they are free (then by index); ranks waiting for an
  // input their neighbour has not scheduled yet, taken back when it
  // schedules its next F (for rank r + 1) or I (for rank r - 1).
  using Entry = std::pair<double, int>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> free;
  for (int r = 0; r < p; ++r) free.emplace(0.0, r);
  std::vector<bool> blocked(p, false);
  int num_blocked = 0;
  while (!free.empty()) {
    const auto [t, r] = free.top();
    free.pop();
    Rank& rk = ranks[r];
    const Action* next = rk.next < rk.main.size() ? &rk.main[rk.next] : nullptr;
    const bool full =
        next != nullptr && next->type == ActionType::kForward && rk.forwards - rk.weights >= limit;
    const double at = next == nullptr ? kNever : ready(r, *next);
    Action chosen;
    if (next != nullptr && !full && at <= t) {
      chosen = *next;
      ++rk.next;
      const size_t cell = static_cast<size_t>(r) * m + chosen.microbatch;
      (chosen.type == ActionType::kForward ? f_end : i_end)[cell] = t + costs.Cost(chosen);
      ++(chosen.type == ActionType::kForward ? rk.forwards : rk.inputs);
      // The neighbour that may wait for it: F feeds rank r + 1, I rank r - 1.
      const int waiter = chosen.type == ActionType::kForward ? r + 1 : r - 1;
      if (waiter >= 0 && waiter < p && blocked[waiter]) {
        blocked[waiter] = false;
        --num_blocked;
        free.emplace(ranks[waiter].free, waiter);
      }
    } else if (rk.weights < rk.inputs) {
      chosen = Action::BackwardWeight(r, rk.weights++);
    } else {
      STRATA_CHECK(!full, "zero-bubble generation: rank ", r, " is full with no W to run");
      if (at < kNever) {
        rk.free = at;  // idle until the input arrives
        free.emplace(at, r);
      } else {
        blocked[r] = true;  // until its neighbour schedules the input
        ++num_blocked;
      }
      continue;
    }
    rk.out.push_back(chosen);
    rk.free = t + costs.Cost(chosen);
    if (rk.next < rk.main.size() || rk.weights < m) free.emplace(rk.free, r);
  }
  STRATA_CHECK(num_blocked == 0, "zero-bubble generation stalled: ", num_blocked,
               " ranks wait for inputs no rank produces");
  std::vector<std::vector<Action>> out;
  for (Rank& c : ranks) out.push_back(std::move(c.out));
  return out;
}

}  // namespace

const char* ScheduleKindName(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGPipe:
      return "gpipe";
    case ScheduleKind::k1F1B:
      return "1f1b";
    case ScheduleKind::kInterleaved1F1B:
      return "interleaved-1f1b";
    case ScheduleKind::kZeroBubbleH1:
      return "zb-h1";
  }
  return "?";
}

absl::StatusOr<ScheduleKind> ParseScheduleKind(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower == "gpipe") return ScheduleKind::kGPipe;
  if (lower == "1f1b") return ScheduleKind::k1F1B;
  if (lower == "interleaved-1f1b" || lower == "interleaved1f1b" || lower == "interleaved") {
    return ScheduleKind::kInterleaved1F1B;
  }
  if (lower == "zb-h1" || lower == "zbh1" || lower == "zero-bubble" || lower == "zerobubble") {
    return ScheduleKind::kZeroBubbleH1;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown schedule kind '", name, "' (expected gpipe, 1f1b, interleaved-1f1b or zb-h1)"));
}

absl::Status CheckScheduleOptions(const ScheduleOptions& o) {
  if (o.version != ScheduleOptions::kVersion) {
    return absl::InvalidArgumentError(absl::StrCat("ScheduleOptions version ", o.version,
                                                   " is not supported (this build reads version ",
                                                   ScheduleOptions::kVersion, ")"));
  }
  if (o.num_ranks < 1 || o.num_ranks > kMaxRanks) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_ranks is ", o.num_ranks, "; want 1..", kMaxRanks));
  }
  if (o.num_microbatches < 1 || o.num_microbatches > kMaxMicrobatches) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_microbatches is ", o.num_microbatches, "; want 1..", kMaxMicrobatches));
  }
  if (o.virtual_stages < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("virtual_stages is ", o.virtual_stages, "; want >= 1"));
  }
  const int64_t stages = int64_t{o.num_ranks} * o.virtual_stages;
  if (stages > kMaxStages || stages * o.num_microbatches > kMaxStageMicrobatches) {
    return absl::InvalidArgumentError(
        absl::StrCat(o.num_ranks, " ranks x ", o.virtual_stages, " virtual stages x ",
                     o.num_microbatches, " microbatches is too large (at most ", kMaxStages,
                     " stages and ", kMaxStageMicrobatches, " (stage, microbatch) pairs)"));
  }
  if (o.kind != ScheduleKind::kInterleaved1F1B) {
    if (o.virtual_stages != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("virtual_stages ", o.virtual_stages, " needs kind interleaved-1f1b (",
                       ScheduleKindName(o.kind), " has one stage per rank)"));
    }
    if (o.microbatch_group_size != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("microbatch_group_size applies to interleaved-1f1b only (kind is ",
                       ScheduleKindName(o.kind), ")"));
    }
    return absl::OkStatus();
  }
  return CheckInterleaving(o);
}

absl::StatusOr<Schedule> GenerateComputeOrder(const ScheduleOptions& o) {
  STRATA_RETURN_IF_ERROR(CheckScheduleOptions(o));
  const int p = o.num_ranks, m = o.num_microbatches, v = o.virtual_stages;
  std::vector<std::vector<Action>> ranks(p);
  std::vector<int> limit(p);
  if (o.kind == ScheduleKind::kZeroBubbleH1) {
    STRATA_RETURN_IF_ERROR(CheckCostModel(o.costs, p));
    // At most 1F1B's peak (rank 0's) on every rank; the limit is what each
    // rank's order holds (an activation lives from its F to its W).
    ranks = ZeroBubbleH1(p, m, std::min(p, m), o.costs);
    for (int r = 0; r < p; ++r) {
      int held = 0;
      for (const Action& a : ranks[r]) {
        held += a.type == ActionType::kForward ? 1 : a.type == ActionType::kBackwardWeight ? -1 : 0;
        limit[r] = std::max(limit[r], held);
      }
    }
  }
  for (int r = 0; r < p && o.kind != ScheduleKind::kZeroBubbleH1; ++r) {
    std::vector<Action> forwards, backwards;
    size_t warmup = 0;
    if (o.kind == ScheduleKind::kInterleaved1F1B && v > 1) {
      // Megatron-Core's table: groups of N microbatches, each run over every
      // chunk before the next group; the last group takes the rest.
      const int n = GroupSize(o);
      std::vector<std::pair<int, int>> table;  // (microbatch, chunk)
      for (int g = 0; g < m; g += n) {
        const int end = g + n >= m ? m : g + n;
        for (int c = 0; c < v; ++c) {
          for (int i = g; i < end; ++i) table.emplace_back(i, c);
        }
      }
      for (const auto& [i, c] : table) {
        forwards.push_back(Action::Forward(c * p + r, i));
        backwards.push_back(Action::Backward((v - 1 - c) * p + r, i));
      }
      warmup = std::min<size_t>(2 * (p - r - 1) + static_cast<size_t>(v - 1) * n, table.size());
    } else {
      for (int i = 0; i < m; ++i) {
        forwards.push_back(Action::Forward(r, i));
        backwards.push_back(Action::Backward(r, i));
      }
      warmup = o.kind == ScheduleKind::kGPipe ? m : std::min(p - r - 1, m);
    }
    limit[r] = static_cast<int>(std::min(warmup + 1, forwards.size()));
    ranks[r] = OneForwardOneBackward(forwards, backwards, warmup);
  }
  STRATA_ASSIGN_OR_RETURN(Schedule schedule, Schedule::Create(std::move(ranks)));
  schedule.set_name(Name(o));
  schedule.set_activation_limit(std::move(limit));
  return schedule;
}

absl::StatusOr<Schedule> GenerateSchedule(const ScheduleOptions& options) {
  STRATA_ASSIGN_OR_RETURN(Schedule order, GenerateComputeOrder(options));
  InsertOptions insert;
  insert.costs = options.costs;
  return InsertCommunication(order, insert);
}

}  // namespace strata::pipeline
