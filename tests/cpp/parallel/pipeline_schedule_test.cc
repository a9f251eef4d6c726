// Schedule and Action: tokens, the text form and the structure checks.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "strata/parallel/pipeline/schedule.h"

namespace strata::pipeline {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr ActionType kAllTypes[] = {ActionType::kForward,       ActionType::kBackward,
                                    ActionType::kBackwardInput, ActionType::kBackwardWeight,
                                    ActionType::kSendForward,   ActionType::kRecvForward,
                                    ActionType::kSendBackward,  ActionType::kRecvBackward};

TEST(ActionTest, TokensOfEveryType) {
  EXPECT_EQ(Action::Forward(0, 1).ToString(), "0F1");
  EXPECT_EQ(Action::Backward(12, 345).ToString(), "12B345");
  EXPECT_EQ(Action::BackwardInput(2, 0).ToString(), "2I0");
  EXPECT_EQ(Action::BackwardWeight(2, 0).ToString(), "2W0");
  EXPECT_EQ(Action::Comm(ActionType::kSendForward, 1, 0, 2).ToString(), "1SEND_F0>2");
  EXPECT_EQ(Action::Comm(ActionType::kRecvForward, 1, 0, 0).ToString(), "1RECV_F0<0");
  EXPECT_EQ(Action::Comm(ActionType::kSendBackward, 1, 3, 0).ToString(), "1SEND_B3>0");
  EXPECT_EQ(Action::Comm(ActionType::kRecvBackward, 0, 3, 1).ToString(), "0RECV_B3<1");
}

TEST(ActionTest, EveryTokenParsesBack) {
  for (ActionType t : kAllTypes) {
    for (int stage : {0, 7, kMaxStages - 1}) {
      for (int mb : {0, 10, kMaxMicrobatches - 1}) {
        Action a{t, stage, mb, -1};
        if (a.is_comm()) a.peer = 123;
        absl::StatusOr<Action> back = Action::Parse(a.ToString());
        ASSERT_TRUE(back.ok()) << a.ToString() << ": " << back.status();
        EXPECT_EQ(*back, a) << a.ToString();
      }
    }
  }
}

TEST(ActionTest, Predicates) {
  for (ActionType t : kAllTypes) {
    const Action a{t, 0, 0, 0};
    const bool compute = t == ActionType::kForward || t == ActionType::kBackward ||
                         t == ActionType::kBackwardInput || t == ActionType::kBackwardWeight;
    EXPECT_EQ(a.is_compute(), compute) << ActionTypeName(t);
    EXPECT_EQ(a.is_comm(), !compute);
    EXPECT_EQ(a.is_send(), t == ActionType::kSendForward || t == ActionType::kSendBackward);
    EXPECT_EQ(a.is_recv(), t == ActionType::kRecvForward || t == ActionType::kRecvBackward);
  }
}

struct BadToken {
  const char* token;
  const char* message;
};

TEST(ActionTest, ParseErrorsSayWhatIsWrong) {
  const BadToken cases[] = {
      {"", "expected <stage><action><microbatch>"},
      {"F0", "expected <stage><action><microbatch>"},
      {"0X1", "unknown action 'X1'"},
      {"0F", "expected a microbatch number after F"},
      {"0SEND_F", "expected a microbatch number after SEND_F"},
      {"0SEND_F1", "SEND_F needs its peer rank, like 0SEND_F1>1"},
      {"1RECV_B2", "RECV_B needs its peer rank, like 1RECV_B2<1"},
      {"0SEND_F1<2", "a send names its peer as '>peer' (to), not '<'"},
      {"1RECV_F1>0", "a receive names its peer as '<peer' (from), not '>'"},
      {"0SEND_F1>", "expected a peer rank number"},
      {"0F1>2", "compute actions (F, B, I, W) take no peer"},
      {"0F1x", "unexpected 'x' after the action"},
      {"0SEND_F1>2x", "unexpected 'x' after the action"},
      {"99999999999999999999F0", "stage number is out of range"},
      {"4096F0", "stage number is out of range (at most 4095)"},
      {"0F1048576", "microbatch number is out of range (at most 1048575)"},
      {"0SEND_F0>65536", "peer rank is out of range (at most 65535)"},
      {"0f0", "unknown action 'f0'"},
  };
  for (const BadToken& c : cases) {
    absl::StatusOr<Action> a = Action::Parse(c.token);
    ASSERT_FALSE(a.ok()) << c.token;
    EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(a.status().message(), HasSubstr(c.message)) << c.token;
    EXPECT_THAT(a.status().message(), HasSubstr(absl::StrCat("'", c.token, "'")));
  }
}

constexpr const char* kTwoRanks =
    "0F0 0SEND_F0>1 0F1 0SEND_F1>1 0RECV_B0<1 0B0 0RECV_B1<1 0B1\n"
    "1RECV_F0<0 1F0 1B0 1SEND_B0>0 1RECV_F1<0 1F1 1B1 1SEND_B1>0\n";

TEST(ScheduleTest, ParsesTheTextForm) {
  absl::StatusOr<Schedule> s = Schedule::Parse(kTwoRanks);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->num_ranks(), 2);
  EXPECT_EQ(s->num_stages(), 2);
  EXPECT_EQ(s->num_microbatches(), 2);
  EXPECT_THAT(s->stage_ranks(), ElementsAre(0, 1));
  EXPECT_EQ(s->actions(0).size(), 8u);
  EXPECT_EQ(s->actions(1)[0], Action::Comm(ActionType::kRecvForward, 1, 0, 0));
  EXPECT_TRUE(s->has_communication());
  EXPECT_EQ(s->size(), 16);
  EXPECT_EQ(s->ToText(), kTwoRanks);
}

TEST(ScheduleTest, TextRoundTripsExactly) {
  // Uneven spacing, tabs, comments and CRLF parse to the same schedule; the
  // printed form is canonical and parses back to an equal schedule.
  const std::string messy =
      "# a comment line\r\n"
      "  0F0\t0SEND_F0>1   0F1 0SEND_F1>1 0RECV_B0<1 0B0 0RECV_B1<1 0B1  \r\n"
      "   # indented comment\n"
      "1RECV_F0<0 1F0 1B0 1SEND_B0>0 1RECV_F1<0 1F1 1B1 1SEND_B1>0";
  absl::StatusOr<Schedule> a = Schedule::Parse(messy);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->ToText(), kTwoRanks);
  absl::StatusOr<Schedule> b = Schedule::Parse(a->ToText());
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*a, *b);
}

TEST(ScheduleTest, InfersStagesAndTheirRanks) {
  // Interleaved placement: stages 0 and 2 on rank 0, 1 and 3 on rank 1.
  absl::StatusOr<Schedule> s = Schedule::Parse(
      "0F0 2F0 2B0 0B0\n"
      "1F0 3F0 3B0 1B0\n");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->num_stages(), 4);
  EXPECT_THAT(s->stage_ranks(), ElementsAre(0, 1, 0, 1));
  EXPECT_THAT(s->stages_of_rank(0), ElementsAre(0, 2));
  EXPECT_THAT(s->stages_of_rank(1), ElementsAre(1, 3));
  EXPECT_FALSE(s->has_communication());
}

TEST(ScheduleTest, AnEmptyLineIsARankWithNoActions) {
  absl::StatusOr<Schedule> s = Schedule::Parse("0F0 0B0\n\n");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->num_ranks(), 2);
  EXPECT_TRUE(s->actions(1).empty());
  EXPECT_EQ(s->ToText(), "0F0 0B0\n\n");
}

TEST(ScheduleTest, ParseErrorsNameLineAndToken) {
  absl::StatusOr<Schedule> s = Schedule::Parse("# header\n0F0 0B0\n1F0 1Q0 1B0\n");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("line 3 (rank 1), token 2: '1Q0': unknown action"));
}

TEST(ScheduleTest, EqualityIgnoresNameAndLimit) {
  absl::StatusOr<Schedule> a = Schedule::Parse("0F0 0B0\n");
  absl::StatusOr<Schedule> b = Schedule::Parse("0F0 0B0\n");
  absl::StatusOr<Schedule> c = Schedule::Parse("0F0 0B0 0F1 0B1\n");
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  b->set_name("other");
  b->set_activation_limit({1});
  EXPECT_EQ(*a, *b);
  EXPECT_NE(*a, *c);
  EXPECT_EQ(b->name(), "other");
  EXPECT_THAT(b->activation_limit(), ElementsAre(1));
}

struct BadSchedule {
  std::vector<std::vector<Action>> actions;
  const char* message;
};

TEST(ScheduleTest, CreateChecksTheStructure) {
  const Action f00 = Action::Forward(0, 0);
  const BadSchedule cases[] = {
      {{}, "a schedule needs at least one rank"},
      {{{}, {}}, "the schedule has no actions"},
      {{{Action::Forward(-1, 0)}}, "rank 0 action #0 -1F0: stage -1 is out of range"},
      {{{Action::Forward(0, -2)}}, "microbatch -2 is out of range"},
      {{{Action::Forward(kMaxStages, 0)}}, "stage 4096 is out of range [0, 4096)"},
      {{{{ActionType::kForward, 0, 0, 1}}, {}}, "compute actions take no peer (peer is 1"},
      {{{f00, Action::Comm(ActionType::kSendForward, 0, 0, 5)}, {}},
       "rank 0 action #1 0SEND_F0>5: peer 5 is not a rank of this 2-rank schedule"},
      {{{f00, Action::Comm(ActionType::kSendForward, 0, 0, 0)}, {}},
       "a rank does not send to or receive from itself"},
      {{{f00}, {Action::Backward(0, 0)}},
       "stage 0 has actions on two ranks (rank 0 action #0 0F0, rank 1 action #0 0B0)"},
      {{{f00, Action::Forward(2, 0)}}, "stage 1 does not appear on any rank (stages go up to 2)"},
      {{{f00}, {Action::Comm(ActionType::kRecvForward, 1, 0, 0)}},
       "stage 1 appears only in communication actions (rank 1 action #0 1RECV_F0<0); no rank "
       "computes it"},
      {{{Action::Forward(1023, 0), Action::Forward(0, 4096)}},
       "1024 stages x 4097 microbatches is more than 4194304"},
  };
  std::vector<std::vector<Action>> too_many(kMaxRanks + 1);
  too_many[0].push_back(f00);
  EXPECT_THAT(Schedule::Create(too_many).status().message(),
              HasSubstr("a schedule has at most 65536 ranks, got 65537"));
  for (const BadSchedule& c : cases) {
    absl::StatusOr<Schedule> s = Schedule::Create(c.actions);
    ASSERT_FALSE(s.ok()) << c.message;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.status().message(), HasSubstr(c.message));
  }
}

}  // namespace
}  // namespace strata::pipeline
