// InsertCommunication: the inserted order is deadlock-free for any valid
// compute order, any placement of stages on ranks and any costs; checked on
// random compute orders under the strictest (rendezvous) transport.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "strata/parallel/pipeline/generate.h"
#include "strata/parallel/pipeline/validate.h"

namespace strata::pipeline {
namespace {

using ::testing::HasSubstr;

struct Task {
  Action action;
  std::vector<int> deps;  // indices of tasks that must run first
};

// A random compute order: stages placed on random ranks, some backwards
// split into I and W, and each rank's list taken from one random
// topological order of all tasks (so the order itself cannot deadlock).
Schedule RandomComputeOrder(std::mt19937& rng, int p, int num_stages, int m) {
  std::vector<int> rank_of(num_stages);
  for (int s = 0; s < num_stages; ++s) rank_of[s] = static_cast<int>(rng() % p);
  std::vector<Task> tasks;
  std::vector<int> fwd(num_stages * m), grad(num_stages * m);
  for (int s = 0; s < num_stages; ++s) {
    for (int i = 0; i < m; ++i) {
      fwd[s * m + i] = static_cast<int>(tasks.size());
      tasks.push_back({Action::Forward(s, i), {}});
      if (s > 0) tasks.back().deps.push_back(fwd[(s - 1) * m + i]);
    }
  }
  for (int s = num_stages - 1; s >= 0; --s) {
    for (int i = 0; i < m; ++i) {
      const bool split = rng() % 3 == 0;
      grad[s * m + i] = static_cast<int>(tasks.size());
      tasks.push_back(
          {split ? Action::BackwardInput(s, i) : Action::Backward(s, i), {fwd[s * m + i]}});
      if (s + 1 < num_stages) tasks.back().deps.push_back(grad[(s + 1) * m + i]);
      if (split) tasks.push_back({Action::BackwardWeight(s, i), {grad[s * m + i]}});
    }
  }
  std::vector<bool> done(tasks.size(), false);
  std::vector<std::vector<Action>> ranks(p);
  for (size_t emitted = 0; emitted < tasks.size(); ++emitted) {
    std::vector<int> ready;
    for (size_t t = 0; t < tasks.size(); ++t) {
      if (done[t]) continue;
      bool ok = true;
      for (int d : tasks[t].deps) ok &= done[d];
      if (ok) ready.push_back(static_cast<int>(t));
    }
    const int t = ready[rng() % ready.size()];
    done[t] = true;
    ranks[rank_of[tasks[t].action.stage]].push_back(tasks[t].action);
  }
  absl::StatusOr<Schedule> s = Schedule::Create(ranks);
  EXPECT_TRUE(s.ok()) << s.status();
  return *s;
}

std::vector<std::vector<Action>> ComputeOnly(const Schedule& s) {
  std::vector<std::vector<Action>> out(s.num_ranks());
  for (int r = 0; r < s.num_ranks(); ++r) {
    for (const Action& a : s.actions(r)) {
      if (a.is_compute()) out[r].push_back(a);
    }
  }
  return out;
}

TEST(InsertCommunicationTest, RandomComputeOrdersBecomeDeadlockFreeSchedules) {
  std::mt19937 rng(20240611);
  std::uniform_real_distribution<double> cost(0.25, 4.0);
  for (int trial = 0; trial < 300; ++trial) {
    const int p = 1 + static_cast<int>(rng() % 5);
    const int num_stages = 1 + static_cast<int>(rng() % 8);
    const int m = 1 + static_cast<int>(rng() % 6);
    const Schedule order = RandomComputeOrder(rng, p, num_stages, m);
    ASSERT_TRUE(ValidateSchedule(order).ok()) << order.ToText();

    InsertOptions insert;
    insert.costs.forward = cost(rng);
    insert.costs.backward = cost(rng);
    insert.costs.backward_input = cost(rng);
    insert.costs.backward_weight = cost(rng);
    insert.costs.transfer = rng() % 2 ? 0.0 : cost(rng);
    absl::StatusOr<Schedule> s = InsertCommunication(order, insert);
    ASSERT_TRUE(s.ok()) << s.status() << "\n" << order.ToText();
    // The compute order is kept; only communication is added.
    EXPECT_EQ(ComputeOnly(*s), order.all_actions());

    ValidateOptions strict;
    strict.communication = CommActions::kRequired;
    strict.comm_model = CommModel::kRendezvous;
    strict.costs.forward = cost(rng);  // deadlock-freedom does not depend on costs
    absl::Status st = ValidateSchedule(*s, strict);
    ASSERT_TRUE(st.ok()) << st << "\ncompute order:\n" << order.ToText();
    SimulateOptions async;
    async.comm_model = CommModel::kAsync;
    EXPECT_TRUE(SimulateSchedule(*s, async).ok());
  }
}

TEST(InsertCommunicationTest, SendsFollowTheirProducerImmediately) {
  absl::StatusOr<Schedule> s = GenerateSchedule([] {
    ScheduleOptions o;
    o.num_ranks = 3;
    o.num_microbatches = 5;
    return o;
  }());
  ASSERT_TRUE(s.ok());
  for (int r = 0; r < s->num_ranks(); ++r) {
    const std::vector<Action>& list = s->actions(r);
    for (size_t k = 0; k < list.size(); ++k) {
      if (!list[k].is_send()) continue;
      // Walk back over other communication to the producing compute.
      size_t j = k;
      while (j > 0 && list[j - 1].is_comm()) --j;
      ASSERT_GT(j, 0u);
      const Action& producer = list[j - 1];
      EXPECT_EQ(producer.stage, list[k].stage) << list[k].ToString();
      EXPECT_EQ(producer.microbatch, list[k].microbatch) << list[k].ToString();
    }
  }
}

TEST(InsertCommunicationTest, RefusesWhatIsNotAValidComputeOrder) {
  ScheduleOptions two;
  two.num_ranks = 2;
  absl::StatusOr<Schedule> full = GenerateSchedule(two);
  ASSERT_TRUE(full.ok());
  absl::StatusOr<Schedule> again = InsertCommunication(*full);
  ASSERT_FALSE(again.ok());
  EXPECT_THAT(again.status().message(),
              HasSubstr("already has communication actions; InsertCommunication takes a compute "
                        "order"));

  absl::StatusOr<Schedule> backwards = Schedule::Parse("0B0 0F0\n");
  ASSERT_TRUE(backwards.ok());
  absl::StatusOr<Schedule> r = InsertCommunication(*backwards);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(),
              HasSubstr("rank 0 action #0 0B0: backward of stage 0 microbatch 0 comes before its "
                        "forward (action #1 0F0)"));

  // Each rank waits for the other's first microbatch.
  absl::StatusOr<Schedule> cycle = Schedule::Parse(
      "0F0 0B0 0F1 0B1\n"
      "1F1 1B1 1F0 1B0\n");
  ASSERT_TRUE(cycle.ok());
  r = InsertCommunication(*cycle);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("the compute order deadlocks even with implied "
                                              "transfers: deadlock"));
  EXPECT_THAT(r.status().message(),
              HasSubstr("rank 1 action #0 1F1 waits for the forward output of 0F1 on rank 0 "
                        "(rank 0 waits at action #1 0B0)"));

  InsertOptions extreme;
  extreme.costs.forward = 1e-20;
  extreme.costs.backward = 1e20;
  absl::StatusOr<Schedule> order = Schedule::Parse("0F0 0B0 0F1 0B1\n1F0 1B0 1F1 1B1\n");
  ASSERT_TRUE(order.ok());
  r = InsertCommunication(*order, extreme);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("takes no time in double precision"));

  InsertOptions negative;
  negative.costs.backward = -1;
  r = InsertCommunication(*order, negative);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(),
              HasSubstr("cost of backward is -1; compute costs must be finite and > 0"));
}

}  // namespace
}  // namespace strata::pipeline
