// Every generated schedule for p in 1..16, m in 1..64, v in 1..4 (where
// interleaving accepts it; ZB-H1 with v = 1) validates, simulates to the closed-form makespan
// and bubble, keeps its activation promise and round-trips through text.
// One test per p keeps each under a second.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "strata/parallel/pipeline/generate.h"
#include "strata/parallel/pipeline/validate.h"

namespace strata::pipeline {
namespace {

using ::testing::HasSubstr;

constexpr int kMaxMicrobatchesSwept = 64;

ScheduleOptions Options(ScheduleKind kind, int p, int m, int v = 1, int n = 0) {
  ScheduleOptions o;
  o.kind = kind;
  o.num_ranks = p;
  o.num_microbatches = m;
  o.virtual_stages = v;
  o.microbatch_group_size = n;
  return o;
}

// Generates, validates (rendezvous, with the generator's activation limit),
// round-trips and simulates under `costs` (also the generator's); returns
// the simulation.
SimulationResult Check(const ScheduleOptions& o, const CostModel& costs) {
  const std::string what =
      absl::StrCat(ScheduleKindName(o.kind), " p=", o.num_ranks, " m=", o.num_microbatches,
                   " v=", o.virtual_stages, " N=", o.microbatch_group_size);
  absl::StatusOr<Schedule> order = GenerateComputeOrder(o);
  EXPECT_TRUE(order.ok()) << what << ": " << order.status();
  if (!order.ok()) return {};
  EXPECT_TRUE(ValidateSchedule(*order).ok()) << what;
  ScheduleOptions with_costs = o;
  with_costs.costs = costs;
  absl::StatusOr<Schedule> s = GenerateSchedule(with_costs);
  EXPECT_TRUE(s.ok()) << what << ": " << s.status();
  if (!s.ok()) return {};
  const absl::Status valid = ValidateSchedule(*s);
  EXPECT_TRUE(valid.ok()) << what << ": " << valid;
  absl::StatusOr<Schedule> back = Schedule::Parse(s->ToText());
  EXPECT_TRUE(back.ok() && *back == *s) << what;
  SimulateOptions sim;
  sim.costs = costs;
  absl::StatusOr<SimulationResult> r = SimulateSchedule(*s, sim);
  EXPECT_TRUE(r.ok()) << what << ": " << r.status();
  if (!r.ok()) return {};
  EXPECT_EQ(r->peak_in_flight, s->activation_limit()) << what;
  return *r;
}

// The same with F = 1 and B = `backward`.
SimulationResult Check(const ScheduleOptions& o, double backward) {
  CostModel costs;
  costs.backward = backward;
  return Check(o, costs);
}

class SweepTest : public ::testing::TestWithParam<int> {};

TEST_P(SweepTest, GPipeAndOneForwardOneBackward) {
  const int p = GetParam();
  for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B}) {
    for (int m = 1; m <= kMaxMicrobatchesSwept; ++m) {
      for (double backward : {1.0, 2.0}) {
        const SimulationResult r = Check(Options(kind, p, m), backward);
        ASSERT_EQ(r.bubble_fraction.size(), static_cast<size_t>(p));
        EXPECT_DOUBLE_EQ(r.makespan, (m + p - 1) * (1 + backward)) << "p=" << p << " m=" << m;
        for (int rank = 0; rank < p; ++rank) {
          EXPECT_DOUBLE_EQ(r.busy[rank], m * (1 + backward));
          EXPECT_NEAR(r.bubble_fraction[rank], double(p - 1) / (m + p - 1), 1e-12);
          const int held = kind == ScheduleKind::kGPipe ? m : std::min(p - rank, m);
          EXPECT_EQ(r.peak_in_flight[rank], held) << "p=" << p << " m=" << m;
        }
      }
    }
  }
}

TEST_P(SweepTest, Interleaved) {
  const int p = GetParam();
  for (int v = 1; v <= 4; ++v) {
    for (int m = 1; m <= kMaxMicrobatchesSwept; ++m) {
      const ScheduleOptions o = Options(ScheduleKind::kInterleaved1F1B, p, m, v);
      const bool accepted = v == 1 || m % p == 0;
      const absl::Status check = CheckScheduleOptions(o);
      ASSERT_EQ(check.ok(), accepted) << "p=" << p << " m=" << m << " v=" << v << ": " << check;
      if (!accepted) {
        EXPECT_THAT(check.message(), HasSubstr("dependency bubble"));
        continue;
      }
      const SimulationResult r = Check(o, 1.0);
      ASSERT_EQ(r.bubble_fraction.size(), static_cast<size_t>(p));
      EXPECT_DOUBLE_EQ(r.makespan, 2.0 * (v * m + p - 1)) << "p=" << p << " m=" << m;
      for (int rank = 0; rank < p; ++rank) {
        EXPECT_DOUBLE_EQ(r.busy[rank], 2.0 * v * m);
        EXPECT_NEAR(r.bubble_fraction[rank], double(p - 1) / (v * m + p - 1), 1e-12);
        const int warmup = v == 1 ? p - rank - 1 : 2 * (p - rank - 1) + (v - 1) * p;
        EXPECT_EQ(r.peak_in_flight[rank], std::min(warmup + 1, m * v));
      }
    }
  }
}

TEST_P(SweepTest, ZeroBubbleH1) {
  const int p = GetParam();
  for (int m = 1; m <= kMaxMicrobatchesSwept; ++m) {
    const std::string what = absl::StrCat("p=", p, " m=", m);
    // F = I = W: with m >= p each rank idles p - 1, a third of 1F1B's
    // 3 (p - 1) with B = I + W (makespans 3m + p - 1 and 3 (m + p - 1)).
    CostModel equal;
    equal.backward_input = equal.backward_weight = 1.0;
    const SimulationResult r = Check(Options(ScheduleKind::kZeroBubbleH1, p, m), equal);
    ASSERT_EQ(r.bubble_fraction.size(), static_cast<size_t>(p)) << what;
    const double one_f_one_b = (m + p - 1) * 3.0;  // 1F1B with B = I + W
    EXPECT_LE(r.makespan, one_f_one_b) << what;
    if (m >= p) EXPECT_DOUBLE_EQ(r.makespan, 3.0 * m + p - 1) << what;
    for (int rank = 0; rank < p; ++rank) {
      EXPECT_DOUBLE_EQ(r.busy[rank], 3.0 * m) << what;
      EXPECT_EQ(r.peak_in_flight[rank], std::min(p, m)) << what << " rank " << rank;
    }
    // Costs as measured on a GPU (I a bit dearer than F, W cheaper): still
    // valid, within its limit, and never slower than 1F1B.
    CostModel gpu;
    gpu.backward_input = 1.1;
    gpu.backward_weight = 0.9;
    const SimulationResult g = Check(Options(ScheduleKind::kZeroBubbleH1, p, m), gpu);
    EXPECT_LE(g.makespan, (m + p - 1) * 3.0 + 1e-9) << what;
  }
}

INSTANTIATE_TEST_SUITE_P(EveryPipelineSize, SweepTest, ::testing::Range(1, 17),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return absl::StrCat("p", info.param);
                         });

TEST(SweepTest, InterleavedGroupSizes) {
  // Every accepted N for small pipelines, with B = 2F: still exact.
  for (int p = 1; p <= 4; ++p) {
    for (int m = p; m <= 16; ++m) {
      for (int n = p; n <= m; ++n) {
        for (int v = 2; v <= 3; ++v) {
          const ScheduleOptions o = Options(ScheduleKind::kInterleaved1F1B, p, m, v, n);
          const bool accepted = m % n == 0 || m % n >= p;
          ASSERT_EQ(CheckScheduleOptions(o).ok(), accepted);
          if (!accepted) continue;
          const SimulationResult r = Check(o, 2.0);
          EXPECT_DOUBLE_EQ(r.makespan, 3.0 * (v * m + p - 1))
              << "p=" << p << " m=" << m << " v=" << v << " N=" << n;
        }
      }
    }
  }
}

}  // namespace
}  // namespace strata::pipeline
