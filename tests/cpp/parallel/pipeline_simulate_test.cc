// The simulator: makespan and bubble against closed forms, peak in-flight
// activations, the grid, and its errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "strata/parallel/pipeline/generate.h"
#include "strata/parallel/pipeline/simulate.h"

namespace strata::pipeline {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

Schedule Generate(ScheduleKind kind, int p, int m, int v = 1) {
  ScheduleOptions o;
  o.kind = kind;
  o.num_ranks = p;
  o.num_microbatches = m;
  o.virtual_stages = v;
  absl::StatusOr<Schedule> s = GenerateSchedule(o);
  EXPECT_TRUE(s.ok()) << s.status();
  return *s;
}

SimulationResult Simulate(const Schedule& s, const SimulateOptions& o = {}) {
  absl::StatusOr<SimulationResult> r = SimulateSchedule(s, o);
  EXPECT_TRUE(r.ok()) << r.status();
  return *r;
}

TEST(SimulateTest, OneForwardOneBackwardBubbleForAnyBackwardCost) {
  // With transfers free, 1F1B (and GPipe) take (m + p - 1)(F + B): the last
  // rank starts after p - 1 forwards and then never waits, and the last
  // gradient needs p - 1 backwards to get back to rank 0. Every rank is busy
  // m (F + B), so each has the bubble (p - 1) / (m + p - 1).
  for (ScheduleKind kind : {ScheduleKind::k1F1B, ScheduleKind::kGPipe}) {
    for (double backward : {0.5, 1.0, 2.0, 3.0}) {
      const int p = 4, m = 8;
      SimulateOptions o;
      o.costs.backward = backward;
      const SimulationResult r = Simulate(Generate(kind, p, m), o);
      EXPECT_DOUBLE_EQ(r.makespan, (m + p - 1) * (1 + backward));
      for (int rank = 0; rank < p; ++rank) {
        EXPECT_DOUBLE_EQ(r.busy[rank], m * (1 + backward));
        EXPECT_NEAR(r.bubble_fraction[rank], double(p - 1) / (m + p - 1), 1e-12);
      }
      EXPECT_NEAR(r.mean_bubble_fraction(), double(p - 1) / (m + p - 1), 1e-12);
    }
  }
}

TEST(SimulateTest, InterleavingDividesTheBubbleTime) {
  // Each virtual stage holds 1/v of a rank's layers, so F and B of one cost
  // f and b: busy time m v (f + b), bubble time still (p - 1)(f + b), i.e.
  // 1/v of 1F1B's bubble time for the same model: fraction
  // (p - 1) / (v m + p - 1).
  const int p = 4, m = 8;
  const double one_f_one_b = double(p - 1) / (m + p - 1);
  for (int v : {1, 2, 3, 4}) {
    const SimulationResult r = Simulate(Generate(ScheduleKind::kInterleaved1F1B, p, m, v));
    EXPECT_DOUBLE_EQ(r.makespan, 2.0 * (v * m + p - 1)) << "v=" << v;
    EXPECT_NEAR(r.mean_bubble_fraction(), double(p - 1) / (v * m + p - 1), 1e-12) << "v=" << v;
    if (v > 1) EXPECT_LT(r.mean_bubble_fraction(), one_f_one_b);
  }
}

TEST(SimulateTest, TransfersAddToTheCriticalPath) {
  // GPipe with transfer time c: the forward wave crosses p - 1 links and so
  // does the backward wave.
  const int p = 3, m = 5;
  SimulateOptions o;
  o.costs.transfer = 0.25;
  const SimulationResult r = Simulate(Generate(ScheduleKind::kGPipe, p, m), o);
  EXPECT_DOUBLE_EQ(r.makespan, 2.0 * (m + p - 1) + 2 * (p - 1) * 0.25);
}

TEST(SimulateTest, UnevenStagesFollowTheFlowShopFormula) {
  // GPipe with stage s costing scale_s (F) and 2 scale_s (B): the forward
  // wave of identical microbatches takes sum f + (m - 1) max f, and the
  // backward wave sum b + (m - 1) max b after it.
  const int p = 4, m = 6;
  const std::vector<double> scale = {1.5, 1.0, 1.0, 2.25};
  SimulateOptions o;
  o.costs.backward = 2;
  o.costs.stage_scale = scale;
  const SimulationResult r = Simulate(Generate(ScheduleKind::kGPipe, p, m), o);
  const double sum = std::accumulate(scale.begin(), scale.end(), 0.0);
  const double max = *std::max_element(scale.begin(), scale.end());
  EXPECT_DOUBLE_EQ(r.makespan, (sum + (m - 1) * max) * (1 + 2));
  EXPECT_DOUBLE_EQ(r.busy[3], m * 2.25 * 3);
}

TEST(SimulateTest, PeakInFlight) {
  EXPECT_THAT(Simulate(Generate(ScheduleKind::k1F1B, 4, 8)).peak_in_flight,
              ElementsAre(4, 3, 2, 1));
  EXPECT_THAT(Simulate(Generate(ScheduleKind::kGPipe, 3, 5)).peak_in_flight, ElementsAre(5, 5, 5));
  // I does not release the activation; W does.
  EXPECT_THAT(PeakInFlight(*Schedule::Parse("0F0 0F1 0I0 0F2 0W0 0B1 0B2\n")), ElementsAre(3));
}

TEST(SimulateTest, TimelineHasEveryAction) {
  const Schedule s = Generate(ScheduleKind::k1F1B, 3, 4);
  const SimulationResult r = Simulate(s);
  for (int rank = 0; rank < 3; ++rank) {
    ASSERT_EQ(r.timeline[rank].size(), s.actions(rank).size());
    for (size_t k = 0; k < s.actions(rank).size(); ++k) {
      const ActionTiming& t = r.timeline[rank][k];
      EXPECT_DOUBLE_EQ(t.end - t.start, s.actions(rank)[k].is_compute() ? 1.0 : 0.0);
      if (k > 0) EXPECT_GE(t.start, r.timeline[rank][k - 1].end);
    }
  }
}

TEST(SimulateTest, RendezvousNeverFinishesEarlier) {
  for (double backward : {1.0, 2.0}) {
    SimulateOptions async, rendezvous;
    async.costs.backward = rendezvous.costs.backward = backward;
    rendezvous.comm_model = CommModel::kRendezvous;
    const Schedule s = Generate(ScheduleKind::kInterleaved1F1B, 4, 8, 2);
    EXPECT_GE(Simulate(s, rendezvous).makespan, Simulate(s, async).makespan);
  }
}

TEST(SimulateTest, Grid) {
  const Schedule s = Generate(ScheduleKind::k1F1B, 2, 2);
  EXPECT_EQ(RenderGrid(s, Simulate(s)),
            "time   0   1   2   3   4   5\n"
            "rank 0 0F0 0F1 .   0B0 .   0B1\n"
            "rank 1 .   1F0 1B0 1F1 1B1 .\n");
  SimulateOptions o;
  o.costs.backward = 2;
  EXPECT_EQ(RenderGrid(s, Simulate(s, o)),
            "time   0   1   2   3   4   5   6   7   8\n"
            "rank 0 0F0 0F1 .   .   0B0 ~   .   0B1 ~\n"
            "rank 1 .   1F0 1B0 ~   1F1 1B1 ~   .   .\n");
  GridOptions window;
  window.begin = 4;
  window.end = 6;
  EXPECT_EQ(RenderGrid(s, Simulate(s, o), window),
            "time   4   5\n"
            "rank 0 0B0 ~\n"
            "rank 1 1F1 1B1\n");
  window = {};
  window.unit = 2;
  EXPECT_EQ(RenderGrid(s, Simulate(s, o), window),
            "time   0   2   4   6   8\n"
            "rank 0 0F1 .   0B0 0B1 ~\n"
            "rank 1 1F0 1B0 1B1 ~   .\n");
}

TEST(SimulateTest, ModelNames) {
  EXPECT_EQ(*ParseCommModel("Rendezvous"), CommModel::kRendezvous);
  EXPECT_EQ(*ParseCommModel("async"), CommModel::kAsync);
  EXPECT_STREQ(CommModelName(CommModel::kAsync), "async");
  EXPECT_THAT(ParseCommModel("eager").status().message(),
              HasSubstr("unknown comm model 'eager' (expected rendezvous or async)"));
}

TEST(SimulateTest, Errors) {
  absl::StatusOr<Schedule> bad = Schedule::Parse("0B0 0F0\n");
  ASSERT_TRUE(bad.ok());
  absl::StatusOr<SimulationResult> r = SimulateSchedule(*bad);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("backward of stage 0 microbatch 0 comes before its "
                                              "forward"));
  absl::StatusOr<Schedule> cycle = Schedule::Parse("0F0 0B0 0F1 0B1\n1F1 1B1 1F0 1B0\n");
  ASSERT_TRUE(cycle.ok());
  cycle->set_name("cycle");
  r = SimulateSchedule(*cycle);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("schedule 'cycle': deadlock: no rank can proceed"));
  SimulateOptions o;
  o.costs.forward = 0;
  r = SimulateSchedule(Generate(ScheduleKind::k1F1B, 2, 2), o);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(),
              HasSubstr("cost of forward is 0; compute costs must be finite and > 0"));
}

}  // namespace
}  // namespace strata::pipeline
