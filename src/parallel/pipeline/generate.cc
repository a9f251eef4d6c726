// The schedule generators: GPipe, 1F1B, interleaved 1F1B (see generate.h).
#include "strata/parallel/pipeline/generate.h"

#include <algorithm>
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

}  // namespace

const char* ScheduleKindName(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGPipe:
      return "gpipe";
    case ScheduleKind::k1F1B:
      return "1f1b";
    case ScheduleKind::kInterleaved1F1B:
      return "interleaved-1f1b";
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
  return absl::InvalidArgumentError(absl::StrCat("unknown schedule kind '", name,
                                                 "' (expected gpipe, 1f1b or interleaved-1f1b)"));
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
  for (int r = 0; r < p; ++r) {
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
