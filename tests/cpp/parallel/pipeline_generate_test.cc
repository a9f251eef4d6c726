// The generators: exact orders for small cases (written out from the
// definitions in generate.h), and every refused option with its reason.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "strata/parallel/pipeline/generate.h"
#include "strata/parallel/pipeline/validate.h"

namespace strata::pipeline {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

ScheduleOptions Options(ScheduleKind kind, int p, int m, int v = 1, int n = 0) {
  ScheduleOptions o;
  o.kind = kind;
  o.num_ranks = p;
  o.num_microbatches = m;
  o.virtual_stages = v;
  o.microbatch_group_size = n;
  return o;
}

std::string ComputeOrder(const ScheduleOptions& o) {
  absl::StatusOr<Schedule> s = GenerateComputeOrder(o);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? s->ToText() : "";
}

TEST(GenerateTest, GPipe) {
  EXPECT_EQ(ComputeOrder(Options(ScheduleKind::kGPipe, 2, 3)),
            "0F0 0F1 0F2 0B0 0B1 0B2\n"
            "1F0 1F1 1F2 1B0 1B1 1B2\n");
}

TEST(GenerateTest, OneForwardOneBackward) {
  // Warmup min(p - r - 1, m): 2, 1, 0 forwards.
  EXPECT_EQ(ComputeOrder(Options(ScheduleKind::k1F1B, 3, 4)),
            "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3\n"
            "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3\n"
            "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3\n");
}

TEST(GenerateTest, OneForwardOneBackwardWithFewerMicrobatchesThanRanks) {
  // Warmup min(p - r - 1, m) = 2, 2, 1, 0.
  EXPECT_EQ(ComputeOrder(Options(ScheduleKind::k1F1B, 4, 2)),
            "0F0 0F1 0B0 0B1\n"
            "1F0 1F1 1B0 1B1\n"
            "2F0 2F1 2B0 2B1\n"
            "3F0 3B0 3F1 3B1\n");
}

TEST(GenerateTest, ZeroBubbleH1) {
  // F = I = W = 1, worked by hand from generate.h: rank 0 takes F0 F1 I0 F2
  // I1 I2 (1F1B's order) and rank 1 F0 I0 F1 I1 F2 I2, each with W's where
  // the next F or I would wait: rank 0 at t = 4 (a third forward would hold
  // 3 > min(p, m) = 2 activations) and t = 7 (I2 waits for rank 1), rank 1
  // at t = 5 (F2 arrives at 6). Makespan 10 = 3m + p - 1.
  ScheduleOptions o = Options(ScheduleKind::kZeroBubbleH1, 2, 3);
  o.costs.backward_input = o.costs.backward_weight = 1.0;
  EXPECT_EQ(ComputeOrder(o),
            "0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2\n"
            "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2\n");
  absl::StatusOr<Schedule> s = GenerateSchedule(o);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->name(), "ZB-H1 p=2 m=3");
  EXPECT_THAT(s->activation_limit(), ElementsAre(2, 2));
  SimulateOptions sim;
  sim.costs = o.costs;
  absl::StatusOr<SimulationResult> r = SimulateSchedule(*s, sim);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_DOUBLE_EQ(r->makespan, 10.0);
  // The costs are bad: refused before generating.
  o.costs.backward_weight = 0;
  EXPECT_FALSE(GenerateComputeOrder(o).ok());
}

TEST(GenerateTest, Interleaved) {
  // p=2, v=2, N=2: stages 0, 2 on rank 0 and 1, 3 on rank 1. Forward table
  // (mb, chunk): (0,0) (1,0) (0,1) (1,1) (2,0) (3,0) (2,1) (3,1); backwards
  // take the chunks reversed. Warmup 2 (p - r - 1) + (v - 1) N = 4 and 2.
  EXPECT_EQ(ComputeOrder(Options(ScheduleKind::kInterleaved1F1B, 2, 4, 2)),
            "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3\n"
            "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3\n");
}

TEST(GenerateTest, InterleavedWithALargerGroup) {
  // p=2, m=5, v=2, N=3: groups {0,1,2} and the last {3,4} (2 >= p).
  // Rank 1 warmup = (v - 1) N = 3.
  absl::StatusOr<Schedule> s =
      GenerateComputeOrder(Options(ScheduleKind::kInterleaved1F1B, 2, 5, 2, 3));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->name(), "interleaved 1F1B p=2 m=5 v=2 N=3");
  std::string rank1;
  for (const Action& a : s->actions(1)) rank1 += a.ToString() + " ";
  EXPECT_EQ(rank1,
            "1F0 1F1 1F2 3F0 3B0 3F1 3B1 3F2 3B2 1F3 1B0 1F4 1B1 3F3 1B2 3F4 3B3 3B4 1B3 1B4 ");
}

TEST(GenerateTest, InterleavedWithOneVirtualStageIsOneForwardOneBackward) {
  for (int p : {1, 2, 5}) {
    for (int m : {1, 3, 8}) {
      EXPECT_EQ(ComputeOrder(Options(ScheduleKind::kInterleaved1F1B, p, m, 1)),
                ComputeOrder(Options(ScheduleKind::k1F1B, p, m)))
          << "p=" << p << " m=" << m;
    }
  }
}

TEST(GenerateTest, NamesAndActivationLimits) {
  absl::StatusOr<Schedule> s = GenerateSchedule(Options(ScheduleKind::k1F1B, 4, 8));
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->name(), "1F1B p=4 m=8");
  EXPECT_THAT(s->activation_limit(), ElementsAre(4, 3, 2, 1));  // p - r
  s = GenerateSchedule(Options(ScheduleKind::k1F1B, 4, 2));
  ASSERT_TRUE(s.ok());
  EXPECT_THAT(s->activation_limit(), ElementsAre(2, 2, 2, 1));  // min(p - r, m)
  s = GenerateSchedule(Options(ScheduleKind::kGPipe, 3, 5));
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->name(), "GPipe p=3 m=5");
  EXPECT_THAT(s->activation_limit(), ElementsAre(5, 5, 5));  // m
  s = GenerateSchedule(Options(ScheduleKind::kInterleaved1F1B, 4, 8, 2));
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->name(), "interleaved 1F1B p=4 m=8 v=2 N=4");
  // min(2 (p - r - 1) + (v - 1) N + 1, m v)
  EXPECT_THAT(s->activation_limit(), ElementsAre(11, 9, 7, 5));
}

TEST(GenerateTest, PipelineOfTwoInterleavesWithoutAmbiguity) {
  // Megatron-Core refuses p = 2 with interleaving unless p2p overlap is on;
  // here every transfer is its own ordered action, so it is accepted, and the
  // validator's pairwise-order check confirms both ranks agree.
  absl::StatusOr<Schedule> s = GenerateSchedule(Options(ScheduleKind::kInterleaved1F1B, 2, 4, 3));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(ValidateSchedule(*s).ok());
}

TEST(GenerateTest, ScheduleKindNames) {
  for (ScheduleKind k : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved1F1B,
                         ScheduleKind::kZeroBubbleH1}) {
    absl::StatusOr<ScheduleKind> back = ParseScheduleKind(ScheduleKindName(k));
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, k);
  }
  EXPECT_EQ(*ParseScheduleKind("GPipe"), ScheduleKind::kGPipe);
  EXPECT_EQ(*ParseScheduleKind("Interleaved"), ScheduleKind::kInterleaved1F1B);
  EXPECT_EQ(*ParseScheduleKind("interleaved1f1b"), ScheduleKind::kInterleaved1F1B);
  EXPECT_EQ(*ParseScheduleKind("Zero-Bubble"), ScheduleKind::kZeroBubbleH1);
  absl::StatusOr<ScheduleKind> bad = ParseScheduleKind("zb-v");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(),
              HasSubstr("unknown schedule kind 'zb-v' (expected gpipe, 1f1b, "
                        "interleaved-1f1b or zb-h1)"));
}

struct Refused {
  ScheduleOptions options;
  std::vector<std::string> message;
};

TEST(GenerateTest, RefusesOptionsWithTheReason) {
  ScheduleOptions bad_version = Options(ScheduleKind::k1F1B, 2, 2);
  bad_version.version = 2;
  const Refused cases[] = {
      {bad_version, {"ScheduleOptions version 2 is not supported"}},
      {Options(ScheduleKind::k1F1B, 0, 2), {"num_ranks is 0; want 1..65536"}},
      {Options(ScheduleKind::kGPipe, 2, 0), {"num_microbatches is 0; want 1..1048576"}},
      {Options(ScheduleKind::kInterleaved1F1B, 2, 2, 0), {"virtual_stages is 0; want >= 1"}},
      {Options(ScheduleKind::k1F1B, 2, 2, 2),
       {"virtual_stages 2 needs kind interleaved-1f1b (1f1b has one stage per rank)"}},
      {Options(ScheduleKind::kZeroBubbleH1, 2, 2, 2),
       {"virtual_stages 2 needs kind interleaved-1f1b (zb-h1 has one stage per rank)"}},
      {Options(ScheduleKind::kGPipe, 2, 2, 1, 2),
       {"microbatch_group_size applies to interleaved-1f1b only (kind is gpipe)"}},
      {Options(ScheduleKind::kInterleaved1F1B, 2, 2, 1, 2),
       {"microbatch_group_size 2 has no effect with virtual_stages 1"}},
      {Options(ScheduleKind::kInterleaved1F1B, 2, 4, 2, -1),
       {"microbatch_group_size is -1; want 0 (meaning p) or a size >= p"}},
      {Options(ScheduleKind::kInterleaved1F1B, 4, 2, 2),
       {"interleaved 1F1B needs at least p = 4 microbatches, got m = 2", "(a dependency bubble)",
        "use 1F1B, or m >= 4"}},
      {Options(ScheduleKind::kInterleaved1F1B, 4, 8, 2, 3),
       {"microbatch_group_size N = 3 is smaller than p = 4", "(a dependency bubble)"}},
      {Options(ScheduleKind::kInterleaved1F1B, 4, 8, 2, 9),
       {"microbatch_group_size N = 9 is larger than the number of microbatches m = 8"}},
      {Options(ScheduleKind::kInterleaved1F1B, 4, 10, 2),
       {"m = 10 microbatches in groups of N = 4 leaves a last group of 2 microbatches, fewer "
        "than p = 4",
        "(a dependency bubble)", "microbatch_group_size 5, 6, 10 would work for m = 10"}},
      {Options(ScheduleKind::kInterleaved1F1B, 4096, 8, 2), {"is too large"}},
  };
  for (const Refused& c : cases) {
    absl::StatusOr<Schedule> s = GenerateSchedule(c.options);
    ASSERT_FALSE(s.ok()) << c.message[0];
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    for (const std::string& part : c.message) EXPECT_THAT(s.status().message(), HasSubstr(part));
    EXPECT_EQ(CheckScheduleOptions(c.options), s.status());
  }
}

}  // namespace
}  // namespace strata::pipeline
