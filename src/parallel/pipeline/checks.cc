// The structural checks of a schedule (1-3 of validate.h): compute counts and
// order, dependencies between stages, and communication.
#include <array>
#include <map>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "parallel/pipeline/internal/engine.h"
#include "strata/base/status.h"

namespace strata::pipeline::internal {
namespace {

constexpr int kNumTypes = 8;

// A transfer's identity: direction, the sending stage, the microbatch.
using TransferKey = std::tuple<bool, int, int>;

TransferKey KeyOf(const Action& a) {
  const bool forward = a.type == ActionType::kSendForward || a.type == ActionType::kRecvForward;
  int sender = a.stage;
  if (a.type == ActionType::kRecvForward) sender = a.stage - 1;
  if (a.type == ActionType::kRecvBackward) sender = a.stage + 1;
  return {forward, sender, a.microbatch};
}

class Checker {
 public:
  Checker(const Schedule& s, bool explicit_comm, Problems* problems)
      : s_(s),
        explicit_comm_(explicit_comm),
        problems_(problems),
        num_stages_(s.num_stages()),
        m_(s.num_microbatches()) {
    for (auto& v : pos_) v.assign(static_cast<size_t>(num_stages_) * m_, -1);
  }

  void Run() {
    Index();
    CheckCompute();
    CheckDependencies();
    if (explicit_comm_) CheckCommunication();
  }

 private:
  int& Pos(ActionType t, int stage, int microbatch) {
    return pos_[static_cast<int>(t)][static_cast<size_t>(stage) * m_ + microbatch];
  }
  // Position of the backward that produces the input gradient: B, else I.
  int GradPos(int stage, int microbatch) {
    const int b = Pos(ActionType::kBackward, stage, microbatch);
    return b != -1 ? b : Pos(ActionType::kBackwardInput, stage, microbatch);
  }
  const Action& At(int rank, int index) const { return s_.actions(rank)[index]; }
  std::string Loc(int stage, int microbatch) const {
    return absl::StrCat("stage ", stage, " microbatch ", microbatch);
  }

  void Index() {
    for (int r = 0; r < s_.num_ranks(); ++r) {
      const std::vector<Action>& list = s_.actions(r);
      for (size_t k = 0; k < list.size(); ++k) {
        const Action& a = list[k];
        if (a.is_comm() && !explicit_comm_) {
          problems_->Add(absl::StrCat(Where(r, k, a),
                                      ": a compute order (transfers implied) has no "
                                      "communication actions"));
          continue;
        }
        int& pos = Pos(a.type, a.stage, a.microbatch);
        if (pos != -1) {
          problems_->Add(absl::StrCat(Where(r, k, a), ": a second ", ActionTypeName(a.type), " of ",
                                      Loc(a.stage, a.microbatch), " (the first is action #", pos,
                                      ")"));
          continue;
        }
        pos = static_cast<int>(k);
      }
    }
  }

  void CheckCompute() {
    for (int st = 0; st < num_stages_; ++st) {
      const int r = s_.rank_of_stage(st);
      for (int i = 0; i < m_; ++i) {
        const int f = Pos(ActionType::kForward, st, i);
        const int b = Pos(ActionType::kBackward, st, i);
        const int in = Pos(ActionType::kBackwardInput, st, i);
        const int w = Pos(ActionType::kBackwardWeight, st, i);
        if (f == -1) {
          problems_->Add(absl::StrCat(Loc(st, i), " has no forward (",
                                      Action::Forward(st, i).ToString(), ") on rank ", r));
        }
        if (b == -1 && in == -1 && w == -1) {
          problems_->Add(absl::StrCat(Loc(st, i), " has no backward (", st, "B", i, ", or ", st,
                                      "I", i, " and ", st, "W", i, ") on rank ", r));
        } else if (b != -1 && (in != -1 || w != -1)) {
          problems_->Add(absl::StrCat(Loc(st, i), " has both a full backward (action #", b,
                                      " on rank ", r, ") and a split one (I/W)"));
        } else if (b == -1 && in == -1) {
          problems_->Add(absl::StrCat(Where(r, w, At(r, w)), ": weight gradient of ", Loc(st, i),
                                      " without its input gradient ", st, "I", i));
        } else if (b == -1 && w == -1) {
          problems_->Add(absl::StrCat(Where(r, in, At(r, in)), ": input gradient of ", Loc(st, i),
                                      " without its weight gradient ", st, "W", i,
                                      " (the weight gradient would be lost)"));
        }
        const int g = b != -1 ? b : in;
        if (f != -1 && g != -1 && g < f) {
          problems_->Add(absl::StrCat(Where(r, g, At(r, g)), ": backward of ", Loc(st, i),
                                      " comes before its forward (action #", f, " ",
                                      At(r, f).ToString(), ")"));
        }
        if (in != -1 && w != -1 && w < in) {
          problems_->Add(absl::StrCat(Where(r, w, At(r, w)), ": weight gradient of ", Loc(st, i),
                                      " comes before its input gradient (action #", in, " ",
                                      At(r, in).ToString(), ")"));
        }
      }
    }
  }

  // The consumer at `pos` on rank r needs data of `from` (a neighbouring
  // stage): earlier on the same rank, or through `recv` before it.
  void CheckInput(int r, int pos, int from, int producer_pos, ActionType recv, const char* what) {
    const Action& a = At(r, pos);
    const int q = s_.rank_of_stage(from);
    if (q == r) {
      if (producer_pos != -1 && producer_pos > pos) {
        problems_->Add(absl::StrCat(Where(r, pos, a), ": needs the ", what, " of stage ", from,
                                    ", which comes later on the same rank (action #", producer_pos,
                                    " ", At(r, producer_pos).ToString(), ")"));
      }
      return;
    }
    if (!explicit_comm_) return;
    const Action want = Action::Comm(recv, a.stage, a.microbatch, q);
    const int rv = Pos(recv, a.stage, a.microbatch);
    if (rv == -1) {
      problems_->Add(absl::StrCat(Where(r, pos, a), ": needs the ", what, " of stage ", from,
                                  " from rank ", q, ", but rank ", r, " has no ", want.ToString(),
                                  " before it"));
    } else if (rv > pos) {
      problems_->Add(absl::StrCat(Where(r, pos, a), ": needs the ", what, " of stage ", from,
                                  " from rank ", q, ", but receives it later (action #", rv, " ",
                                  At(r, rv).ToString(), ")"));
    }
  }

  void CheckDependencies() {
    for (int st = 0; st < num_stages_; ++st) {
      const int r = s_.rank_of_stage(st);
      for (int i = 0; i < m_; ++i) {
        const int f = Pos(ActionType::kForward, st, i);
        if (f != -1 && st > 0) {
          CheckInput(r, f, st - 1, Pos(ActionType::kForward, st - 1, i), ActionType::kRecvForward,
                     "forward output");
        }
        const int g = GradPos(st, i);
        if (g != -1 && st < num_stages_ - 1) {
          CheckInput(r, g, st + 1, GradPos(st + 1, i), ActionType::kRecvBackward, "gradient");
        }
      }
    }
  }

  void CheckCommunication() {
    const int64_t before = problems_->total();
    for (int r = 0; r < s_.num_ranks(); ++r) {
      const std::vector<Action>& list = s_.actions(r);
      for (size_t k = 0; k < list.size(); ++k) {
        if (list[k].is_comm()) CheckCommAction(r, static_cast<int>(k));
      }
    }
    // Pairwise order only makes sense once every transfer has its two ends.
    if (problems_->total() == before) CheckChannelOrder();
  }

  void CheckCommAction(int r, int k) {
    const Action& a = At(r, k);
    const bool to_next = a.type == ActionType::kSendForward || a.type == ActionType::kRecvBackward;
    const int neighbour = to_next ? a.stage + 1 : a.stage - 1;
    if (neighbour < 0 || neighbour >= num_stages_) {
      const char* why = "";
      switch (a.type) {
        case ActionType::kSendForward:
          why = "the last stage has no next stage to send a forward output to";
          break;
        case ActionType::kRecvForward:
          why = "stage 0 has no previous stage to receive a forward input from";
          break;
        case ActionType::kSendBackward:
          why = "stage 0 has no previous stage to send a gradient to";
          break;
        default:
          why = "the last stage has no next stage to receive a gradient from";
          break;
      }
      problems_->Add(absl::StrCat(Where(r, k, a), ": ", why));
      return;
    }
    const int q = s_.rank_of_stage(neighbour);
    if (q == r) {
      problems_->Add(absl::StrCat(Where(r, k, a), ": stages ", a.stage, " and ", neighbour,
                                  " are both on rank ", r, "; no transfer between them"));
      return;
    }
    if (a.peer != q) {
      problems_->Add(absl::StrCat(Where(r, k, a), ": the peer is rank ", a.peer, ", but stage ",
                                  neighbour, " is on rank ", q));
      return;
    }
    if (a.is_send()) {
      const bool forward = a.type == ActionType::kSendForward;
      const int produced = forward ? Pos(ActionType::kForward, a.stage, a.microbatch)
                                   : GradPos(a.stage, a.microbatch);
      if (produced > k) {
        problems_->Add(absl::StrCat(Where(r, k, a), ": sends the ",
                                    forward ? "forward output" : "gradient", " of ",
                                    Loc(a.stage, a.microbatch), " before computing it (action #",
                                    produced, " ", At(r, produced).ToString(), ")"));
      }
    }
    const Action other = Counterpart(a, r);
    if (Pos(other.type, other.stage, other.microbatch) == -1) {
      problems_->Add(absl::StrCat(Where(r, k, a), ": no matching ",
                                  a.is_send() ? "receive " : "send ", other.ToString(), " on rank ",
                                  q));
    }
  }

  void CheckChannelOrder() {
    struct End {
      TransferKey key;
      int index;
    };
    std::map<std::pair<int, int>, std::vector<End>> sends, recvs;  // (from, to)
    for (int r = 0; r < s_.num_ranks(); ++r) {
      const std::vector<Action>& list = s_.actions(r);
      for (size_t k = 0; k < list.size(); ++k) {
        const Action& a = list[k];
        if (a.is_send()) sends[{r, a.peer}].push_back({KeyOf(a), static_cast<int>(k)});
        if (a.is_recv()) recvs[{a.peer, r}].push_back({KeyOf(a), static_cast<int>(k)});
      }
    }
    for (const auto& [channel, out] : sends) {
      const std::vector<End>& in = recvs[channel];
      const auto [from, to] = channel;
      for (size_t n = 0; n < out.size() && n < in.size(); ++n) {
        if (out[n].key == in[n].key) continue;
        problems_->Add(absl::StrCat(
            "transfer #", n, " from rank ", from, " to rank ", to, ": rank ", from, " sends ",
            At(from, out[n].index).ToString(), " (action #", out[n].index, ") while rank ", to,
            "'s receive #", n, " from rank ", from, " is ", At(to, in[n].index).ToString(),
            " (action #", in[n].index,
            "); transports match the messages between two ranks in order, so it would get the "
            "wrong tensor"));
        break;
      }
    }
  }

  const Schedule& s_;
  const bool explicit_comm_;
  Problems* problems_;
  const int num_stages_;
  const int m_;
  std::array<std::vector<int>, kNumTypes> pos_;
};

}  // namespace

std::string Where(int rank, int64_t index, const Action& action) {
  return absl::StrCat("rank ", rank, " action #", index, " ", action.ToString());
}

Action Counterpart(const Action& a, int rank) {
  switch (a.type) {
    case ActionType::kSendForward:
      return Action::Comm(ActionType::kRecvForward, a.stage + 1, a.microbatch, rank);
    case ActionType::kRecvForward:
      return Action::Comm(ActionType::kSendForward, a.stage - 1, a.microbatch, rank);
    case ActionType::kSendBackward:
      return Action::Comm(ActionType::kRecvBackward, a.stage - 1, a.microbatch, rank);
    case ActionType::kRecvBackward:
      return Action::Comm(ActionType::kSendBackward, a.stage + 1, a.microbatch, rank);
    default:
      break;
  }
  STRATA_CHECK(false, "Counterpart of compute action ", a.ToString());
  return a;
}

std::string Problems::Format(const Schedule& schedule) const {
  std::string out =
      schedule.name().empty() ? "schedule" : absl::StrCat("schedule '", schedule.name(), "'");
  absl::StrAppend(&out, " is invalid (", total_, total_ == 1 ? " problem" : " problems", "):");
  for (const std::string& item : items_) absl::StrAppend(&out, "\n  - ", item);
  if (total_ > static_cast<int64_t>(items_.size())) {
    absl::StrAppend(&out, "\n  ... and ", total_ - static_cast<int64_t>(items_.size()), " more");
  }
  return out;
}

void CheckStructure(const Schedule& schedule, bool explicit_comm, Problems* problems) {
  Checker(schedule, explicit_comm, problems).Run();
}

}  // namespace strata::pipeline::internal
