// Schedule and Action: the data, its structure checks and the text form.
#include "strata/parallel/pipeline/schedule.h"

#include <algorithm>
#include <cctype>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "strata/base/status.h"

namespace strata::pipeline {
namespace {

constexpr struct {
  ActionType type;
  const char* name;
} kTypeNames[] = {
    // Longer names first so that prefix matching finds SEND_F before F.
    {ActionType::kSendForward, "SEND_F"},  {ActionType::kRecvForward, "RECV_F"},
    {ActionType::kSendBackward, "SEND_B"}, {ActionType::kRecvBackward, "RECV_B"},
    {ActionType::kForward, "F"},           {ActionType::kBackward, "B"},
    {ActionType::kBackwardInput, "I"},     {ActionType::kBackwardWeight, "W"},
};

// Reads a run of decimal digits from the front of `s`. Returns false when
// there is none; `*value` saturates at `limit` + 1 so overflow is reported as
// "out of range" rather than wrapping.
bool ConsumeNumber(absl::string_view* s, int64_t limit, int64_t* value) {
  size_t n = 0;
  int64_t v = 0;
  while (n < s->size() && absl::ascii_isdigit(static_cast<unsigned char>((*s)[n]))) {
    if (v <= limit) v = v * 10 + ((*s)[n] - '0');
    ++n;
  }
  if (n == 0) return false;
  *value = std::min(v, limit + 1);
  s->remove_prefix(n);
  return true;
}

std::string Where(int rank, size_t index, const Action& a) {
  return absl::StrCat("rank ", rank, " action #", index, " ", a.ToString());
}

}  // namespace

const char* ActionTypeName(ActionType type) {
  for (const auto& t : kTypeNames) {
    if (t.type == type) return t.name;
  }
  return "?";
}

std::string Action::ToString() const {
  std::string s = absl::StrCat(stage, ActionTypeName(type), microbatch);
  if (is_send()) absl::StrAppend(&s, ">", peer);
  if (is_recv()) absl::StrAppend(&s, "<", peer);
  return s;
}

absl::StatusOr<Action> Action::Parse(absl::string_view token) {
  absl::string_view rest = token;
  auto error = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("'", token, "': ", what));
  };
  int64_t stage = 0, microbatch = 0, peer = -1;
  if (!ConsumeNumber(&rest, kMaxStages - 1, &stage)) {
    return error("expected <stage><action><microbatch>, like 0F1 or 1SEND_F0>2");
  }
  if (stage >= kMaxStages) {
    return error(absl::StrCat("stage number is out of range (at most ", kMaxStages - 1, ")"));
  }
  const auto* found = std::find_if(std::begin(kTypeNames), std::end(kTypeNames),
                                   [&](const auto& t) { return absl::StartsWith(rest, t.name); });
  if (found == std::end(kTypeNames)) {
    return error(absl::StrCat("unknown action '", rest,
                              "' (expected F, B, I, W, SEND_F, RECV_F, SEND_B or RECV_B)"));
  }
  rest.remove_prefix(std::char_traits<char>::length(found->name));
  if (!ConsumeNumber(&rest, kMaxMicrobatches - 1, &microbatch)) {
    return error(absl::StrCat("expected a microbatch number after ", found->name));
  }
  if (microbatch >= kMaxMicrobatches) {
    return error(
        absl::StrCat("microbatch number is out of range (at most ", kMaxMicrobatches - 1, ")"));
  }
  Action a{found->type, static_cast<int>(stage), static_cast<int>(microbatch), -1};
  if (a.is_comm()) {
    const char* want = a.is_send() ? ">" : "<";
    if (rest.empty()) {
      return error(absl::StrCat(found->name, " needs its peer rank, like ", stage, found->name,
                                microbatch, want, "1"));
    }
    if (rest[0] != want[0]) {
      return error(absl::StrCat(a.is_send() ? "a send names its peer as '>peer' (to)"
                                            : "a receive names its peer as '<peer' (from)",
                                ", not '", rest.substr(0, 1), "'"));
    }
    rest.remove_prefix(1);
    if (!ConsumeNumber(&rest, kMaxRanks - 1, &peer)) return error("expected a peer rank number");
    if (peer >= kMaxRanks) {
      return error(absl::StrCat("peer rank is out of range (at most ", kMaxRanks - 1, ")"));
    }
    a.peer = static_cast<int>(peer);
  } else if (!rest.empty() && (rest[0] == '>' || rest[0] == '<')) {
    return error("compute actions (F, B, I, W) take no peer");
  }
  if (!rest.empty()) return error(absl::StrCat("unexpected '", rest, "' after the action"));
  return a;
}

absl::StatusOr<Schedule> Schedule::Create(std::vector<std::vector<Action>> actions_per_rank) {
  const int p = static_cast<int>(actions_per_rank.size());
  if (p < 1) return absl::InvalidArgumentError("a schedule needs at least one rank");
  if (actions_per_rank.size() > static_cast<size_t>(kMaxRanks)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a schedule has at most ", kMaxRanks, " ranks, got ", p));
  }
  int max_stage = -1, max_microbatch = -1;
  for (int r = 0; r < p; ++r) {
    for (size_t i = 0; i < actions_per_rank[r].size(); ++i) {
      const Action& a = actions_per_rank[r][i];
      if (a.stage < 0 || a.stage >= kMaxStages) {
        return absl::InvalidArgumentError(absl::StrCat(Where(r, i, a), ": stage ", a.stage,
                                                       " is out of range [0, ", kMaxStages, ")"));
      }
      if (a.microbatch < 0 || a.microbatch >= kMaxMicrobatches) {
        return absl::InvalidArgumentError(absl::StrCat(Where(r, i, a), ": microbatch ",
                                                       a.microbatch, " is out of range [0, ",
                                                       kMaxMicrobatches, ")"));
      }
      if (a.is_compute() && a.peer != -1) {
        return absl::InvalidArgumentError(absl::StrCat(
            Where(r, i, a), ": compute actions take no peer (peer is ", a.peer, ", want -1)"));
      }
      if (a.is_comm() && (a.peer < 0 || a.peer >= p)) {
        return absl::InvalidArgumentError(absl::StrCat(
            Where(r, i, a), ": peer ", a.peer, " is not a rank of this ", p, "-rank schedule"));
      }
      if (a.is_comm() && a.peer == r) {
        return absl::InvalidArgumentError(
            absl::StrCat(Where(r, i, a), ": a rank does not send to or receive from itself"));
      }
      max_stage = std::max(max_stage, a.stage);
      max_microbatch = std::max(max_microbatch, a.microbatch);
    }
  }
  if (max_stage < 0) return absl::InvalidArgumentError("the schedule has no actions");
  const int num_stages = max_stage + 1;
  const int num_microbatches = max_microbatch + 1;
  if (int64_t{num_stages} * num_microbatches > kMaxStageMicrobatches) {
    return absl::InvalidArgumentError(absl::StrCat(num_stages, " stages x ", num_microbatches,
                                                   " microbatches is more than ",
                                                   kMaxStageMicrobatches,
                                                   " (stage, microbatch) "
                                                   "pairs"));
  }

  // Where each stage lives: the rank of its actions, all on one rank.
  struct Seen {
    int rank = -1;
    size_t index = 0;
    bool computed = false;
  };
  std::vector<Seen> seen(num_stages);
  for (int r = 0; r < p; ++r) {
    for (size_t i = 0; i < actions_per_rank[r].size(); ++i) {
      const Action& a = actions_per_rank[r][i];
      Seen& s = seen[a.stage];
      if (s.rank == -1) {
        s.rank = r;
        s.index = i;
      } else if (s.rank != r) {
        const Action& first = actions_per_rank[s.rank][s.index];
        return absl::InvalidArgumentError(absl::StrCat(
            "stage ", a.stage, " has actions on two ranks (", Where(s.rank, s.index, first), ", ",
            Where(r, i, a), "); a stage lives on one rank"));
      }
      s.computed |= a.is_compute();
    }
  }
  Schedule schedule;
  schedule.stage_rank_.resize(num_stages);
  for (int s = 0; s < num_stages; ++s) {
    if (seen[s].rank == -1) {
      return absl::InvalidArgumentError(absl::StrCat("stage ", s,
                                                     " does not appear on any rank (stages go "
                                                     "up to ",
                                                     max_stage, ")"));
    }
    if (!seen[s].computed) {
      const Action& a = actions_per_rank[seen[s].rank][seen[s].index];
      return absl::InvalidArgumentError(
          absl::StrCat("stage ", s, " appears only in communication actions (",
                       Where(seen[s].rank, seen[s].index, a), "); no rank computes it"));
    }
    schedule.stage_rank_[s] = seen[s].rank;
  }
  schedule.actions_ = std::move(actions_per_rank);
  schedule.num_microbatches_ = num_microbatches;
  return schedule;
}

absl::StatusOr<Schedule> Schedule::Parse(absl::string_view text) {
  std::vector<absl::string_view> lines = absl::StrSplit(text, '\n');
  // A final newline ends the last line; it does not start a new rank.
  if (!lines.empty() && lines.back().empty()) lines.pop_back();
  std::vector<std::vector<Action>> ranks;
  for (size_t l = 0; l < lines.size(); ++l) {
    absl::string_view line = absl::StripSuffix(lines[l], "\r");
    if (absl::StartsWith(absl::StripLeadingAsciiWhitespace(line), "#")) continue;
    std::vector<Action>& actions = ranks.emplace_back();
    size_t token_number = 0;
    for (absl::string_view token :
         absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty())) {
      ++token_number;
      absl::StatusOr<Action> a = Action::Parse(token);
      if (!a.ok()) {
        return internal::Annotate(
            a.status(),
            absl::StrCat("line ", l + 1, " (rank ", ranks.size() - 1, "), token ", token_number));
      }
      actions.push_back(*a);
    }
  }
  return Create(std::move(ranks));
}

std::string Schedule::ToText() const {
  std::string out;
  for (const std::vector<Action>& rank : actions_) {
    for (size_t i = 0; i < rank.size(); ++i) {
      if (i > 0) out.push_back(' ');
      out += rank[i].ToString();
    }
    out.push_back('\n');
  }
  return out;
}

std::vector<int> Schedule::stages_of_rank(int rank) const {
  std::vector<int> out;
  for (int s = 0; s < num_stages(); ++s) {
    if (stage_rank_[s] == rank) out.push_back(s);
  }
  return out;
}

bool Schedule::has_communication() const {
  for (const auto& rank : actions_) {
    for (const Action& a : rank) {
      if (a.is_comm()) return true;
    }
  }
  return false;
}

int64_t Schedule::size() const {
  int64_t n = 0;
  for (const auto& rank : actions_) n += static_cast<int64_t>(rank.size());
  return n;
}

}  // namespace strata::pipeline
