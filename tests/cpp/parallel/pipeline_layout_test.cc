// Stage layouts: the text form, balanced splits, weights for the simulator.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "strata/parallel/pipeline/generate.h"
#include "strata/parallel/pipeline/layout.h"

namespace strata::pipeline {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(LayoutTest, ParsesTheTextForm) {
  absl::StatusOr<StageLayout> l = StageLayout::Parse("E t*3 | t*4 | t t t t | t*2 t L");
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->num_stages(), 4);
  EXPECT_EQ(l->num_layers(), 14);
  EXPECT_THAT(l->layer_counts(), ElementsAre(3, 4, 4, 3));
  EXPECT_EQ(l->first_layer(2), 7);
  EXPECT_TRUE(l->has_embedding(0));
  EXPECT_FALSE(l->has_embedding(1));
  EXPECT_TRUE(l->has_loss(3));
  EXPECT_EQ(l->ToText(), "E t*3|t*4|t*4|t*3 L");
  absl::StatusOr<StageLayout> back = StageLayout::Parse(l->ToText());
  ASSERT_TRUE(back.ok());
  EXPECT_TRUE(*back == *l);
  EXPECT_EQ(l->Describe(2),
            "stage 0 (rank 0): embedding, layers 0-2\n"
            "stage 1 (rank 1): layers 3-6\n"
            "stage 2 (rank 0): layers 7-10\n"
            "stage 3 (rank 1): layers 11-13, loss\n");
}

TEST(LayoutTest, EdgeShapes) {
  absl::StatusOr<StageLayout> one = StageLayout::Parse("E t*4 L");
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->num_stages(), 1);
  EXPECT_EQ(one->Describe(1), "stage 0 (rank 0): embedding, layers 0-3, loss\n");
  // The first and last stage may hold only the embedding and the loss.
  absl::StatusOr<StageLayout> ends = StageLayout::Parse("E | t | L");
  ASSERT_TRUE(ends.ok());
  EXPECT_THAT(ends->layer_counts(), ElementsAre(0, 1, 0));
  EXPECT_EQ(ends->ToText(), "E|t|L");
  EXPECT_EQ(ends->Describe(3),
            "stage 0 (rank 0): embedding\nstage 1 (rank 1): layer 0\nstage 2 (rank 2): loss\n");
}

TEST(LayoutTest, ParseErrorsNameStageAndItem) {
  const std::pair<const char*, const char*> cases[] = {
      {"t*4 | t*4 L", "stage 0 must start with the embedding E"},
      {"E t*4 | t*4", "the last stage (stage 1) must end with the loss head L"},
      {"E t | E t L",
       "stage 1 item 0 'E' of layout 'E t | E t L': the embedding E belongs at the "
       "start of stage 0"},
      {"E L t",
       "stage 0 item 1 'L' of layout 'E L t': the loss head L belongs at the end of the "
       "last stage (stage 0)"},
      {"E t | | t L", "stage 1 of layout 'E t | | t L' is empty"},
      {"E x L", "stage 0 item 1 'x' of layout 'E x L': unknown item (expected E, t, t*n or L)"},
      {"E t*0 L", "a repeat is t*n with n in 1..1048576"},
      {"E t*x L", "a repeat is t*n"},
      {"E t*99999999 L", "a repeat is t*n"},
      {"", "stage 0 of layout '' is empty"},
  };
  for (const auto& [text, message] : cases) {
    absl::StatusOr<StageLayout> l = StageLayout::Parse(text);
    ASSERT_FALSE(l.ok()) << text;
    EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(l.status().message(), HasSubstr(message)) << text;
  }
}

TEST(LayoutTest, FromCounts) {
  absl::StatusOr<StageLayout> l = StageLayout::FromCounts({1, 2, 0});
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->ToText(), "E t|t*2|L");
  EXPECT_THAT(StageLayout::FromCounts({2, 0, 2}).status().message(),
              HasSubstr("stage 1 holds no layers; a stage between the first (embedding) and the "
                        "last (loss) needs at least one"));
  EXPECT_THAT(StageLayout::FromCounts({2, -1}).status().message(),
              HasSubstr("stage 1 has -1 layers; want >= 0"));
  EXPECT_THAT(StageLayout::FromCounts({}).status().message(),
              HasSubstr("a layout needs at least one stage"));
  EXPECT_THAT(StageLayout::FromCounts(std::vector<int>(4097, 1)).status().message(),
              HasSubstr("a layout has at most 4096 stages, got 4097"));
  EXPECT_THAT(StageLayout::FromCounts({1 << 20, 1}).status().message(),
              HasSubstr("a layout has at most 1048576 layers, got 1048577"));
}

TEST(LayoutTest, BalancedSplitsByWeight) {
  BalancedLayoutOptions o;
  o.num_layers = 16;
  o.num_stages = 4;
  EXPECT_THAT(StageLayout::Balanced(o)->layer_counts(), ElementsAre(4, 4, 4, 4));
  // Embedding and loss counted as one layer each (18 units, 4.5 per stage).
  o.embedding_weight = 1;
  o.loss_weight = 1;
  absl::StatusOr<StageLayout> l = StageLayout::Balanced(o);
  ASSERT_TRUE(l.ok());
  EXPECT_THAT(l->layer_counts(), ElementsAre(3, 5, 4, 4));
  // Closest to even: no stage's weight is more than one layer off the mean.
  const std::vector<double> w = l->StageWeights({1.0, 1.0, 1.0});
  const double mean = std::accumulate(w.begin(), w.end(), 0.0) / w.size();
  for (double x : w) EXPECT_LE(std::abs(x - mean), 1.0);
  o.embedding_weight = 3;
  o.loss_weight = 3;
  o.num_layers = 6;
  EXPECT_THAT(StageLayout::Balanced(o)->layer_counts(), ElementsAre(0, 3, 3, 0));
}

TEST(LayoutTest, BalancedRefusesTooFewLayers) {
  BalancedLayoutOptions o;
  o.num_layers = 2;
  o.num_stages = 5;
  absl::StatusOr<StageLayout> l = StageLayout::Balanced(o);
  ASSERT_FALSE(l.ok());
  EXPECT_THAT(l.status().message(),
              HasSubstr("2 layers (embedding weight 0, loss weight 0) do not fill 5 stages"));
  o.num_stages = 0;
  EXPECT_THAT(StageLayout::Balanced(o).status().message(), HasSubstr("num_stages is 0"));
  o.num_stages = 2;
  o.num_layers = -1;
  EXPECT_THAT(StageLayout::Balanced(o).status().message(),
              HasSubstr("num_layers is -1; want 0..1048576"));
  o.num_layers = 2;
  o.num_stages = 2;
  o.loss_weight = -1;
  EXPECT_THAT(StageLayout::Balanced(o).status().message(),
              HasSubstr("loss_weight is -1; want a finite weight >= 0"));
}

TEST(LayoutTest, WeightsDriveTheSimulator) {
  // An uneven layout on GPipe: the slowest stage sets the pace (flow-shop
  // makespan sum + (m - 1) max, per direction).
  absl::StatusOr<StageLayout> l = StageLayout::Parse("E t*2 | t*3 | t*3 L");
  ASSERT_TRUE(l.ok());
  const std::vector<double> w = l->StageWeights({1.0, 1.0, 2.0});
  EXPECT_THAT(w, ElementsAre(3.0, 3.0, 5.0));
  ScheduleOptions o;
  o.kind = ScheduleKind::kGPipe;
  o.num_ranks = 3;
  o.num_microbatches = 4;
  absl::StatusOr<Schedule> s = GenerateSchedule(o);
  ASSERT_TRUE(s.ok());
  EXPECT_TRUE(CheckLayoutFits(*l, *s).ok());
  SimulateOptions sim;
  sim.costs.stage_scale = w;
  absl::StatusOr<SimulationResult> r = SimulateSchedule(*s, sim);
  ASSERT_TRUE(r.ok());
  EXPECT_DOUBLE_EQ(r->makespan, 2 * (11.0 + 3 * 5.0));

  o.num_ranks = 2;
  s = GenerateSchedule(o);
  ASSERT_TRUE(s.ok());
  EXPECT_THAT(CheckLayoutFits(*l, *s).message(),
              HasSubstr("the layout has 3 stages but the schedule 'GPipe p=2 m=4' has 2"));
}

}  // namespace
}  // namespace strata::pipeline
