// Stage layouts: which layers of a model each pipeline stage holds.
//
// A model here is an embedding (E), a run of transformer layers (t) and a
// loss head (L: final norm, output projection and loss), in that order. A
// layout cuts it into stages, first to last; stage 0 holds E and the last
// stage holds L. Stages need not be even: the first and last stage often get
// fewer layers to make up for the embedding and the loss.
//
// The text form lists the stages separated by '|', each as its items, with
// "t*n" for n layers (this is the spirit of Megatron-Core's
// pipeline-model-parallel layout):
//
//   absl::StatusOr<strata::pipeline::StageLayout> layout =
//       strata::pipeline::StageLayout::Parse("E t*3 | t*4 | t*4 | t*3 L");
//   layout->num_stages();       // 4
//   layout->first_layer(1);     // 3
//   layout->layer_count(3);     // 3
//   layout->ToText();           // "E t*3|t*4|t*4|t*3 L"
//
// Balanced() computes such a split from the layer count and how much the
// embedding and the loss weigh, and StageWeights() turns a layout into the
// per-stage cost scale of the simulator (CostModel::stage_scale), so an
// uneven model is simulated as it will run. With interleaving, stage s is
// virtual stage s on rank s mod p; a layout is checked against a schedule by
// CheckLayoutFits.
//
// Thread-safety: StageLayout is a value; const methods may be called
// concurrently.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "strata/base/export.h"
#include "strata/parallel/pipeline/schedule.h"

namespace strata::pipeline {

struct STRATA_EXPORT BalancedLayoutOptions {
  int num_layers = 0;  // transformer layers
  int num_stages = 1;
  // What the embedding and the loss head cost, in transformer layers (0: not
  // counted). Megatron-Core's account_for_embedding/loss_in_pipeline_split
  // count each as one layer.
  double embedding_weight = 0;
  double loss_weight = 0;
};

// How much each item costs when turning a layout into stage weights.
struct STRATA_EXPORT LayerWeights {
  double layer = 1.0;
  double embedding = 0.0;
  double loss = 0.0;
};

class STRATA_EXPORT StageLayout {
 public:
  // Parses the text form. InvalidArgument names the stage and item: an
  // unknown item, E anywhere but the start of stage 0 or L anywhere but the
  // end of the last stage (or either missing or repeated), a bad repeat
  // count, or a stage with nothing in it.
  static absl::StatusOr<StageLayout> Parse(absl::string_view text);
  // `layers_per_stage[s]` transformer layers on stage s, in order, with E on
  // stage 0 and L on the last. Every stage must hold something: a middle
  // stage needs at least one layer.
  static absl::StatusOr<StageLayout> FromCounts(absl::Span<const int> layers_per_stage);
  // The contiguous split whose stages weigh closest to equal: layer j goes to
  // the stage its midpoint falls in when the embedding, the layers and the
  // loss are laid end to end by weight. InvalidArgument when some stage
  // would be empty (too few layers for the stages).
  static absl::StatusOr<StageLayout> Balanced(const BalancedLayoutOptions& options);

  int num_stages() const { return static_cast<int>(counts_.size()); }
  int num_layers() const { return num_layers_; }
  // The first transformer layer of `stage` and how many it holds.
  int first_layer(int stage) const { return first_[stage]; }
  int layer_count(int stage) const { return counts_[stage]; }
  const std::vector<int>& layer_counts() const { return counts_; }
  bool has_embedding(int stage) const { return stage == 0; }
  bool has_loss(int stage) const { return stage == num_stages() - 1; }

  // The canonical text form: "E t*3|t*4|t*4|t*3 L".
  std::string ToText() const;
  // One line per stage: "stage 0 (rank 0): embedding, layers 0-2".
  // `num_ranks` places stage s on rank s mod num_ranks.
  std::string Describe(int num_ranks) const;
  // Per stage: layers * weights.layer (+ weights.embedding on stage 0,
  // + weights.loss on the last), for CostModel::stage_scale.
  std::vector<double> StageWeights(const LayerWeights& weights = {}) const;

  friend bool operator==(const StageLayout& a, const StageLayout& b) {
    return a.counts_ == b.counts_;
  }

 private:
  StageLayout() = default;
  static StageLayout FromValidCounts(std::vector<int> counts);

  std::vector<int> counts_;
  std::vector<int> first_;
  int num_layers_ = 0;
};

// InvalidArgument unless the layout has exactly one stage per stage of the
// schedule.
STRATA_EXPORT absl::Status CheckLayoutFits(const StageLayout& layout, const Schedule& schedule);

}  // namespace strata::pipeline
