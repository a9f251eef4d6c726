// Pipeline schedules as data: for each pipeline rank, the ordered list of
// actions it performs in one training step.
//
// A model is cut into `num_stages` stages (0 is the first, holding the
// embedding; the last holds the loss). Each stage lives on one rank of the
// pipeline group; with interleaving (virtual stages) a rank holds several.
// An action names a stage and a microbatch:
//
//   F       forward of (stage, microbatch)
//   B       backward: input and weight gradients together
//   I, W    the same backward split in two (input gradient, then weight
//           gradient), for zero-bubble schedules; W must follow I
//   SEND_F  send the stage's forward output to the next stage's rank (peer)
//   RECV_F  receive the stage's forward input from the previous stage's rank
//   SEND_B  send the stage's input gradient to the previous stage's rank
//   RECV_B  receive the stage's output gradient from the next stage's rank
//
// The text form has one line per rank, actions separated by spaces. A token
// is <stage><action><microbatch>, and a communication action adds its peer:
// ">peer" for a send (to), "<peer" for a receive (from):
//
//   0F0 0SEND_F0>1 0F1 0SEND_F1>1 0RECV_B0<1 0B0 0RECV_B1<1 0B1
//   1RECV_F0<0 1F0 1B0 1SEND_B0>0 1RECV_F1<0 1F1 1B1 1SEND_B1>0
//
// Lines starting with '#' are comments; every other line is a rank (so an
// empty line is a rank with no actions). ToText() prints exactly this form
// and Parse(ToText(s)) == s.
//
// Schedule::Create checks the structure only (ranges, and that every action
// of a stage is on that stage's rank); whether the schedule can run is the
// validator's question (validate.h), how long it takes the simulator's
// (simulate.h). Generators for GPipe, 1F1B and interleaved 1F1B are in
// generate.h.
//
//   absl::StatusOr<strata::pipeline::Schedule> s =
//       strata::pipeline::Schedule::Parse("0F0 0F1 1F0 1F1 1B0 1B1 0B0 0B1\n");
//   s->num_ranks();        // 1
//   s->num_stages();       // 2 (both on rank 0)
//   s->ToText();           // the same line
//
// Thread-safety: Action and Schedule are values; const methods may be called
// concurrently.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "strata/base/export.h"

namespace strata::pipeline {

enum class ActionType : uint8_t {
  kForward,         // F
  kBackward,        // B
  kBackwardInput,   // I
  kBackwardWeight,  // W
  kSendForward,     // SEND_F
  kRecvForward,     // RECV_F
  kSendBackward,    // SEND_B
  kRecvBackward,    // RECV_B
};

// "F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B".
STRATA_EXPORT const char* ActionTypeName(ActionType type);

// Limits that keep every per-(stage, microbatch) table of a schedule small;
// Create and Parse reject larger numbers.
inline constexpr int kMaxStages = 4096;
inline constexpr int kMaxMicrobatches = 1 << 20;
inline constexpr int kMaxRanks = 1 << 16;
inline constexpr int64_t kMaxStageMicrobatches = int64_t{1} << 22;  // stages * microbatches

struct STRATA_EXPORT Action {
  ActionType type = ActionType::kForward;
  int stage = 0;
  int microbatch = 0;
  // Communication actions: the pipeline rank sent to or received from.
  // Compute actions: -1.
  int peer = -1;

  static Action Forward(int stage, int microbatch) {
    return {ActionType::kForward, stage, microbatch, -1};
  }
  static Action Backward(int stage, int microbatch) {
    return {ActionType::kBackward, stage, microbatch, -1};
  }
  static Action BackwardInput(int stage, int microbatch) {
    return {ActionType::kBackwardInput, stage, microbatch, -1};
  }
  static Action BackwardWeight(int stage, int microbatch) {
    return {ActionType::kBackwardWeight, stage, microbatch, -1};
  }
  static Action Comm(ActionType type, int stage, int microbatch, int peer) {
    return {type, stage, microbatch, peer};
  }

  // F, B, I, W.
  bool is_compute() const { return type <= ActionType::kBackwardWeight; }
  bool is_comm() const { return !is_compute(); }
  bool is_send() const {
    return type == ActionType::kSendForward || type == ActionType::kSendBackward;
  }
  bool is_recv() const {
    return type == ActionType::kRecvForward || type == ActionType::kRecvBackward;
  }

  // The token of the text form: "0F1", "1SEND_F0>2", "2RECV_B3<3".
  std::string ToString() const;
  // Parses one token. InvalidArgument says what is wrong with it.
  static absl::StatusOr<Action> Parse(absl::string_view token);

  friend bool operator==(const Action& a, const Action& b) {
    return a.type == b.type && a.stage == b.stage && a.microbatch == b.microbatch &&
           a.peer == b.peer;
  }
  friend bool operator!=(const Action& a, const Action& b) { return !(a == b); }
};

class STRATA_EXPORT Schedule {
 public:
  // A schedule from per-rank action lists. The number of stages and of
  // microbatches are one more than the largest seen; the rank of a stage is
  // where its actions are. InvalidArgument when a stage's actions are on two
  // ranks, a stage number is skipped, a stage appears only in communication
  // actions, a peer is out of range or the rank itself, a compute action has
  // a peer, or a number is out of range (see the limits above).
  static absl::StatusOr<Schedule> Create(std::vector<std::vector<Action>> actions_per_rank);
  // Parses the text form. Errors name the line and token.
  static absl::StatusOr<Schedule> Parse(absl::string_view text);

  // One line per rank, each ending in '\n'.
  std::string ToText() const;

  int num_ranks() const { return static_cast<int>(actions_.size()); }
  int num_stages() const { return static_cast<int>(stage_rank_.size()); }
  int num_microbatches() const { return num_microbatches_; }
  // The rank that holds `stage` (0 <= stage < num_stages()).
  int rank_of_stage(int stage) const { return stage_rank_[stage]; }
  const std::vector<int>& stage_ranks() const { return stage_rank_; }
  // The stages `rank` holds, ascending.
  std::vector<int> stages_of_rank(int rank) const;
  const std::vector<Action>& actions(int rank) const { return actions_[rank]; }
  const std::vector<std::vector<Action>>& all_actions() const { return actions_; }
  // True when any rank has a communication action.
  bool has_communication() const;
  // Total number of actions over all ranks.
  int64_t size() const;

  // A short description for messages ("1F1B p=4 m=8"); generators set it.
  const std::string& name() const { return name_; }
  void set_name(std::string name) { name_ = std::move(name); }

  // The most activations each rank may hold at once, as promised by the
  // generator (1F1B: p - rank); empty when unknown (parsed schedules). The
  // validator checks it. Not part of the text form or of equality.
  const std::vector<int>& activation_limit() const { return activation_limit_; }
  void set_activation_limit(std::vector<int> limit) { activation_limit_ = std::move(limit); }

  // Same actions on the same ranks (the name and limit are not compared).
  friend bool operator==(const Schedule& a, const Schedule& b) { return a.actions_ == b.actions_; }
  friend bool operator!=(const Schedule& a, const Schedule& b) { return !(a == b); }

 private:
  Schedule() = default;

  std::vector<std::vector<Action>> actions_;
  std::vector<int> stage_rank_;
  int num_microbatches_ = 0;
  std::string name_;
  std::vector<int> activation_limit_;
};

}  // namespace strata::pipeline
