// The validator: deliberately broken schedules are rejected with the right
// message, and the options are checked.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_replace.h"
#include "strata/parallel/pipeline/generate.h"
#include "strata/parallel/pipeline/validate.h"

namespace strata::pipeline {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// GenerateSchedule's 1F1B for p=2, m=2 and p=3, m=3 (checked below).
constexpr const char* kP2 =
    "0F0 0SEND_F0>1 0F1 0SEND_F1>1 0RECV_B0<1 0B0 0RECV_B1<1 0B1\n"
    "1RECV_F0<0 1F0 1RECV_F1<0 1B0 1SEND_B0>0 1F1 1B1 1SEND_B1>0\n";
constexpr const char* kP3 =
    "0F0 0SEND_F0>1 0F1 0SEND_F1>1 0F2 0SEND_F2>1 0RECV_B0<1 0B0 0RECV_B1<1 0B1 0RECV_B2<1 0B2\n"
    "1RECV_F0<0 1F0 1RECV_F1<0 1SEND_F0>2 1F1 1RECV_F2<0 1SEND_F1>2 1RECV_B0<2 1B0 1SEND_B0>0 "
    "1F2 1SEND_F2>2 1RECV_B1<2 1B1 1SEND_B1>0 1RECV_B2<2 1B2 1SEND_B2>0\n"
    "2RECV_F0<1 2F0 2RECV_F1<1 2B0 2SEND_B0>1 2F1 2B1 2RECV_F2<1 2SEND_B1>1 2F2 2B2 2SEND_B2>1\n";

Schedule Parse(const std::string& text) {
  absl::StatusOr<Schedule> s = Schedule::Parse(text);
  EXPECT_TRUE(s.ok()) << s.status() << "\n" << text;
  return s.ok() ? *s : *Schedule::Parse("0F0 0B0\n");
}

// `base` with `from` replaced by `to` (which must occur exactly once).
std::string Edit(const std::string& base, const std::string& from, const std::string& to) {
  size_t at = base.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  EXPECT_EQ(base.find(from, at + 1), std::string::npos) << from << " occurs twice";
  return absl::StrReplaceAll(base, {{from, to}});
}

std::string Invalid(const Schedule& s, const ValidateOptions& options = {}) {
  absl::Status st = ValidateSchedule(s, options);
  EXPECT_FALSE(st.ok()) << s.ToText();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  return std::string(st.message());
}

TEST(ValidateTest, TheBaseSchedulesAreTheGeneratedOnesAndValid) {
  for (int p : {2, 3}) {
    ScheduleOptions o;
    o.num_ranks = p;
    o.num_microbatches = p;
    absl::StatusOr<Schedule> s = GenerateSchedule(o);
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(s->ToText(), p == 2 ? kP2 : kP3);
    EXPECT_TRUE(ValidateSchedule(*s).ok());
    EXPECT_TRUE(ValidateSchedule(Parse(p == 2 ? kP2 : kP3)).ok());
  }
}

TEST(ValidateTest, SwappedSendAndReceiveDeadlocks) {
  // Rank 2 sends its first gradient before receiving microbatch 1, while
  // rank 1 sends microbatch 1 before receiving that gradient: under a
  // rendezvous transport both wait forever.
  const Schedule s = Parse(Edit(kP3, "2RECV_F1<1 2B0 2SEND_B0>1", "2B0 2SEND_B0>1 2RECV_F1<1"));
  const std::string message = Invalid(s);
  EXPECT_THAT(message, HasSubstr("deadlock: no rank can proceed after time 4"));
  EXPECT_THAT(message, HasSubstr("rank 1 action #6 1SEND_F1>2 waits for rank 2 to reach "
                                 "2RECV_F1<1 (rank 2 waits at action #3 2SEND_B0>1)"));
  EXPECT_THAT(message, HasSubstr("rank 2 action #3 2SEND_B0>1 waits for rank 1 to reach "
                                 "1RECV_B0<2 (rank 1 waits at action #6 1SEND_F1>2)"));
  EXPECT_THAT(message, HasSubstr("rank 0 action #6 0RECV_B0<1 waits for rank 1"));
  // The grid of the timesteps before the deadlock.
  EXPECT_THAT(message, HasSubstr("the last timesteps:\ntime   0   1   2   3   4\n"));
  EXPECT_THAT(message, HasSubstr("rank 2 .   .   2F0 2B0"));
  EXPECT_THAT(message, HasSubstr("(simulated with rendezvous transfers)"));
  // A transport whose sends never block runs it.
  ValidateOptions async;
  async.comm_model = CommModel::kAsync;
  EXPECT_TRUE(ValidateSchedule(s, async).ok());
}

TEST(ValidateTest, SendWrittenAsReceive) {
  const std::string message = Invalid(Parse(Edit(kP2, "0SEND_F0>1", "0RECV_F0<1")));
  EXPECT_THAT(message, HasSubstr("rank 0 action #1 0RECV_F0<1: stage 0 has no previous stage to "
                                 "receive a forward input from"));
  EXPECT_THAT(message, HasSubstr("rank 1 action #0 1RECV_F0<0: no matching send 0SEND_F0>1 on "
                                 "rank 0"));
}

TEST(ValidateTest, MissingReceive) {
  const std::string message = Invalid(Parse(Edit(kP2, "1RECV_F1<0 ", "")));
  EXPECT_THAT(message, HasSubstr("rank 1 action #4 1F1: needs the forward output of stage 0 from "
                                 "rank 0, but rank 1 has no 1RECV_F1<0 before it"));
  EXPECT_THAT(message, HasSubstr("rank 0 action #3 0SEND_F1>1: no matching receive 1RECV_F1<0 "
                                 "on rank 1"));
}

TEST(ValidateTest, MissingSend) {
  const std::string message = Invalid(Parse(Edit(kP2, "1SEND_B0>0 ", "")));
  EXPECT_THAT(message,
              HasSubstr("rank 0 action #4 0RECV_B0<1: no matching send 1SEND_B0>0 on rank 1"));
}

TEST(ValidateTest, BackwardBeforeForward) {
  const std::string message = Invalid(Parse(Edit(kP2, "1F1 1B1", "1B1 1F1")));
  EXPECT_THAT(message, HasSubstr("schedule is invalid (1 problem):\n  - rank 1 action #5 1B1: "
                                 "backward of stage 1 microbatch 1 comes before its forward "
                                 "(action #6 1F1)"));
}

TEST(ValidateTest, ReceiveAfterItsConsumer) {
  const std::string message = Invalid(Parse(Edit(kP2, "1RECV_F0<0 1F0", "1F0 1RECV_F0<0")));
  EXPECT_THAT(message, HasSubstr("rank 1 action #0 1F0: needs the forward output of stage 0 from "
                                 "rank 0, but receives it later (action #1 1RECV_F0<0)"));
}

TEST(ValidateTest, SendBeforeItsProducer) {
  const std::string message = Invalid(Parse(Edit(kP2, "0F0 0SEND_F0>1", "0SEND_F0>1 0F0")));
  EXPECT_THAT(message, HasSubstr("rank 0 action #0 0SEND_F0>1: sends the forward output of stage "
                                 "0 microbatch 0 before computing it (action #1 0F0)"));
}

TEST(ValidateTest, SendsOutOfOrderBetweenTwoRanks) {
  // Each send has its receive, but rank 0 sends microbatch 1 first while
  // rank 1 receives microbatch 0 first: the transport would swap the data.
  const std::string message =
      Invalid(Parse(Edit(kP2, "0F0 0SEND_F0>1 0F1 0SEND_F1>1", "0F0 0F1 0SEND_F1>1 0SEND_F0>1")));
  EXPECT_THAT(message, HasSubstr("transfer #0 from rank 0 to rank 1: rank 0 sends 0SEND_F1>1 "
                                 "(action #2) while rank 1's receive #0 from rank 0 is "
                                 "1RECV_F0<0 (action #0); transports match the messages between "
                                 "two ranks in order"));
}

TEST(ValidateTest, WrongPeer) {
  const std::string message = Invalid(Parse(Edit(kP3, "0SEND_F0>1", "0SEND_F0>2")));
  EXPECT_THAT(
      message,
      HasSubstr("rank 0 action #1 0SEND_F0>2: the peer is rank 2, but stage 1 is on rank 1"));
}

TEST(ValidateTest, TransfersThatDoNotExist) {
  std::string message =
      Invalid(Parse("0F0 0SEND_F0>1 1F0 1SEND_F0>1 1RECV_B0<1 1B0 0B0\n"
                    "2RECV_F0<0 2F0 2B0 2SEND_B0>0\n"));
  EXPECT_THAT(message, HasSubstr("rank 0 action #1 0SEND_F0>1: stages 0 and 1 are both on rank 0; "
                                 "no transfer between them"));
  EXPECT_THAT(message, HasSubstr("(1 problem)"));  // 1SEND_F0>1 crosses to rank 1: fine
  message =
      Invalid(Parse("0F0 0SEND_F0>1 0RECV_B0<1 0B0\n"
                    "1RECV_F0<0 1F0 1SEND_F0>0 1RECV_B0<0 1B0 1SEND_B0>0\n"));
  EXPECT_THAT(message, HasSubstr("rank 1 action #2 1SEND_F0>0: the last stage has no next stage to "
                                 "send a forward output to"));
  EXPECT_THAT(message, HasSubstr("rank 1 action #3 1RECV_B0<0: the last stage has no next stage "
                                 "to receive a gradient from"));
  message =
      Invalid(Parse("0F0 0SEND_F0>1 0RECV_B0<1 0B0 0SEND_B0>1\n"
                    "1RECV_F0<0 1F0 1B0 1SEND_B0>0\n"));
  EXPECT_THAT(message, HasSubstr("rank 0 action #4 0SEND_B0>1: stage 0 has no previous stage to "
                                 "send a gradient to"));
}

TEST(ValidateTest, ComputeCountsAndOrder) {
  std::string message = Invalid(Parse("0F0 0F0 0B0\n"));
  EXPECT_THAT(message, HasSubstr("rank 0 action #1 0F0: a second F of stage 0 microbatch 0 (the "
                                 "first is action #0)"));
  message = Invalid(Parse("0F0 0B0 0F1\n"));
  EXPECT_THAT(message,
              HasSubstr("stage 0 microbatch 1 has no backward (0B1, or 0I1 and 0W1) on rank 0"));
  message = Invalid(Parse("0F0 0B0 0B1\n"));
  EXPECT_THAT(message, HasSubstr("stage 0 microbatch 1 has no forward (0F1) on rank 0"));
  message = Invalid(Parse("0F0 0I0\n"));
  EXPECT_THAT(message, HasSubstr("rank 0 action #1 0I0: input gradient of stage 0 microbatch 0 "
                                 "without its weight gradient 0W0"));
  message = Invalid(Parse("0F0 0W0\n"));
  EXPECT_THAT(message, HasSubstr("rank 0 action #1 0W0: weight gradient of stage 0 microbatch 0 "
                                 "without its input gradient 0I0"));
  message = Invalid(Parse("0F0 0W0 0I0\n"));
  EXPECT_THAT(message, HasSubstr("rank 0 action #1 0W0: weight gradient of stage 0 microbatch 0 "
                                 "comes before its input gradient (action #2 0I0)"));
  message = Invalid(Parse("0F0 0B0 0I0 0W0\n"));
  EXPECT_THAT(message, HasSubstr("stage 0 microbatch 0 has both a full backward (action #1 on rank "
                                 "0) and a split one (I/W)"));
  EXPECT_TRUE(ValidateSchedule(Parse("0F0 0F1 0I1 0I0 0W0 0W1\n")).ok());
}

TEST(ValidateTest, StagesOnOneRankInTheWrongOrder) {
  std::string message = Invalid(Parse("1F0 0F0 0B0 1B0\n"));
  EXPECT_THAT(message, HasSubstr("rank 0 action #0 1F0: needs the forward output of stage 0, "
                                 "which comes later on the same rank (action #1 0F0)"));
  message = Invalid(Parse("0F0 1F0 0B0 1B0\n"));
  EXPECT_THAT(message, HasSubstr("rank 0 action #2 0B0: needs the gradient of stage 1, which comes "
                                 "later on the same rank (action #3 1B0)"));
}

TEST(ValidateTest, MemoryBound) {
  ValidateOptions tight;
  tight.max_in_flight = {1, 1};
  std::string message = Invalid(Parse(kP2), tight);
  EXPECT_THAT(message, HasSubstr("rank 0 action #2 0F1: rank 0 would hold 2 activations at once, "
                                 "more than its limit of 1"));
  EXPECT_THAT(message, Not(HasSubstr("rank 1 action")));  // rank 1 holds one at a time

  // A GPipe order does not keep 1F1B's promise of p - r activations.
  ScheduleOptions o;
  o.kind = ScheduleKind::kGPipe;
  o.num_ranks = 3;
  o.num_microbatches = 6;
  absl::StatusOr<Schedule> gpipe = GenerateSchedule(o);
  ASSERT_TRUE(gpipe.ok());
  EXPECT_TRUE(ValidateSchedule(*gpipe).ok());
  gpipe->set_activation_limit({3, 2, 1});
  message = Invalid(*gpipe);
  EXPECT_THAT(message, HasSubstr("schedule 'GPipe p=3 m=6' is invalid (3 problems)"));
  EXPECT_THAT(message, HasSubstr("rank 2 would hold 2 activations at once, more than its limit of "
                                 "1"));
}

// 1F1B with each send right after its producer and each receive right
// before its consumer: the order many hand-written runners use.
Schedule NaiveOneForwardOneBackward(int p, int m) {
  ScheduleOptions o;
  o.num_ranks = p;
  o.num_microbatches = m;
  absl::StatusOr<Schedule> order = GenerateComputeOrder(o);
  EXPECT_TRUE(order.ok());
  std::vector<std::vector<Action>> ranks(p);
  for (int r = 0; r < p; ++r) {
    for (const Action& a : order->actions(r)) {
      const bool forward = a.type == ActionType::kForward;
      if (forward && r > 0)
        ranks[r].push_back(Action::Comm(ActionType::kRecvForward, r, a.microbatch, r - 1));
      if (!forward && r < p - 1)
        ranks[r].push_back(Action::Comm(ActionType::kRecvBackward, r, a.microbatch, r + 1));
      ranks[r].push_back(a);
      if (forward && r < p - 1)
        ranks[r].push_back(Action::Comm(ActionType::kSendForward, r, a.microbatch, r + 1));
      if (!forward && r > 0)
        ranks[r].push_back(Action::Comm(ActionType::kSendBackward, r, a.microbatch, r - 1));
    }
  }
  absl::StatusOr<Schedule> s = Schedule::Create(ranks);
  EXPECT_TRUE(s.ok());
  return *s;
}

TEST(ValidateTest, NaiveCommunicationDeadlocksUnderRendezvous) {
  const Schedule s = NaiveOneForwardOneBackward(4, 8);
  const std::string message = Invalid(s);
  EXPECT_THAT(message, HasSubstr("deadlock"));
  ValidateOptions async;
  async.comm_model = CommModel::kAsync;
  EXPECT_TRUE(ValidateSchedule(s, async).ok());
}

TEST(ValidateTest, ComputeOrderCycle) {
  const std::string message =
      Invalid(Parse("0F0 0B0 0F1 0B1\n"
                    "1F1 1B1 1F0 1B0\n"));
  EXPECT_THAT(message, HasSubstr("rank 0 action #1 0B0 waits for the gradient of stage 1 "
                                 "microbatch 0 (its B or I) on rank 1 (rank 1 waits at action #0 "
                                 "1F1)"));
  EXPECT_THAT(message, HasSubstr("(simulated with implied transfers)"));
  EXPECT_THAT(message, HasSubstr("rank 0 0F0"));
}

TEST(ValidateTest, CommunicationRequiredOrForbidden) {
  ScheduleOptions o;
  o.num_ranks = 2;
  o.num_microbatches = 2;
  absl::StatusOr<Schedule> order = GenerateComputeOrder(o);
  ASSERT_TRUE(order.ok());
  EXPECT_TRUE(ValidateSchedule(*order).ok());  // kAuto: transfers implied
  ValidateOptions required;
  required.communication = CommActions::kRequired;
  std::string message = Invalid(*order, required);
  EXPECT_THAT(message, HasSubstr("rank 1 action #0 1F0: needs the forward output of stage 0 from "
                                 "rank 0, but rank 1 has no 1RECV_F0<0 before it"));
  ValidateOptions implied;
  implied.communication = CommActions::kImplied;
  message = Invalid(Parse(kP2), implied);
  EXPECT_THAT(message, HasSubstr("rank 0 action #1 0SEND_F0>1: a compute order (transfers "
                                 "implied) has no communication actions"));
}

TEST(ValidateTest, ProblemsAreCapped) {
  ScheduleOptions o;
  o.num_ranks = 4;
  o.num_microbatches = 8;
  absl::StatusOr<Schedule> order = GenerateComputeOrder(o);
  ASSERT_TRUE(order.ok());
  ValidateOptions options;
  options.communication = CommActions::kRequired;
  options.max_problems = 3;
  const std::string message = Invalid(*order, options);
  // 3 boundaries x 8 microbatches x (forward + gradient) missing receives.
  EXPECT_THAT(message, HasSubstr("is invalid (48 problems)"));
  EXPECT_THAT(message, HasSubstr("\n  ... and 45 more"));
}

TEST(ValidateTest, RefusesBadOptions) {
  const Schedule s = Parse(kP2);
  ValidateOptions o;
  o.max_problems = 0;
  EXPECT_THAT(Invalid(s, o), HasSubstr("ValidateOptions::max_problems is 0; want >= 1"));
  o = {};
  o.max_in_flight = {1, 2, 3};
  EXPECT_THAT(Invalid(s, o), HasSubstr("the activation limit has 3 entries for a schedule of 2 "
                                       "ranks"));
  o = {};
  o.costs.transfer = -1;
  EXPECT_THAT(Invalid(s, o), HasSubstr("transfer cost is -1; it must be finite and >= 0"));
  o = {};
  o.costs.stage_scale = {1};
  EXPECT_THAT(Invalid(s, o), HasSubstr("stage_scale has 1 entries for 2 stages"));
  o.costs.stage_scale = {1, 0};
  EXPECT_THAT(Invalid(s, o), HasSubstr("stage_scale[1] is 0; scales must be finite and > 0"));
}

}  // namespace
}  // namespace strata::pipeline
