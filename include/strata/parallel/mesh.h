// Mesh: the data/tensor/pipeline/context/expert-parallel layout of a job.
//
// A Mesh is pure arithmetic over rank numbers: no communication, no state
// beyond its spec. It answers which ranks form each process group, and it
// numbers ranks exactly as Megatron-Core's RankGenerator does, so a job moved
// from Megatron-Core gets the same groups:
//
//   * The order string lists axes from fastest- to slowest-varying: with the
//     default "tp-cp-ep-dp-pp", tp has stride 1, then cp, dp and pp.
//     rank = sum over axes of coordinate * (product of the sizes before it).
//   * The dense mesh has axes tp, cp, dp, pp (dp = world / (tp*cp*pp) unless
//     given). ep has size 1 there.
//   * Expert parallelism is carved out of dp*cp, not an extra factor of the
//     world: the expert mesh has its own expert-TP (etp, default tp), ep and
//     expert-DP (edp = world / (etp*ep*pp)), cp of 1, the same order, and the
//     same pipeline groups as the dense mesh.
//   * A group for a combination of axes ("dp-cp", "tp-pp") holds every rank
//     that differs from this one only on those axes, ordered by the order
//     string (so "cp-dp" and "dp-cp" are the same group).
//
//   strata::MeshSpec spec;
//   spec.world_size = 8; spec.tp = 2; spec.pp = 2;         // dp inferred: 2
//   absl::StatusOr<strata::Mesh> mesh = strata::Mesh::Create(spec);
//   mesh->GroupOf(5, "tp");        // {4, 5}
//   mesh->Groups("dp")->group(0);  // {0, 2}
//   std::puts(mesh->Describe().c_str());
//
// Every invalid spec is an InvalidArgument error naming the numbers.
//
// Thread-safety: a Mesh is immutable after Create(); const methods may be
// called concurrently.
#pragma once

#include <array>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "strata/base/export.h"

namespace strata {

// The sizes and order of a mesh. Versioned: it is stored in checkpoints.
struct STRATA_EXPORT MeshSpec {
  static constexpr int kVersion = 1;
  int version = kVersion;
  int world_size = 1;
  int tp = 1;
  int pp = 1;
  int cp = 1;
  int ep = 1;
  // Expert tensor-parallel size; 0 means "same as tp".
  int etp = 0;
  // Data-parallel size; 0 means "infer as world / (tp*cp*pp)".
  int dp = 0;
  std::string order = "tp-cp-ep-dp-pp";
  // Ranks per node, for the topology check; 0 means unknown.
  int ranks_per_node = 0;
};

// The groups of one axis (or combination of axes): num_groups() groups of
// group_size() ranks each, stored in one flat array (so 131,072 ranks cost
// 512 KiB, not 131,072 small vectors). Every rank is in exactly one group.
class STRATA_EXPORT RankGroups {
 public:
  RankGroups() = default;
  RankGroups(int group_size, std::vector<int> ranks);

  int group_size() const { return group_size_; }
  int num_groups() const {
    return group_size_ == 0 ? 0 : static_cast<int>(ranks_.size()) / group_size_;
  }
  absl::Span<const int> group(int i) const {
    return absl::MakeConstSpan(ranks_).subspan(static_cast<size_t>(i) * group_size_, group_size_);
  }
  const std::vector<int>& flat() const { return ranks_; }
  std::vector<std::vector<int>> ToVectors() const;

 private:
  int group_size_ = 0;
  std::vector<int> ranks_;
};

// A finding of the topology check: a group of `axis` that crosses nodes.
struct STRATA_EXPORT TopologyWarning {
  std::string axis;         // "tp", "cp" or "ep"
  int groups_spanning = 0;  // how many groups of the axis span nodes
  std::string message;      // what is wrong, with the numbers
  std::string suggestion;   // an order or sizes that keep the axis in a node
};

class STRATA_EXPORT Mesh {
 public:
  // The axes of both meshes, in the canonical order used by order strings.
  static constexpr std::array<const char*, 5> kAxisNames = {"tp", "cp", "ep", "dp", "pp"};

  static absl::StatusOr<Mesh> Create(const MeshSpec& spec);

  // The spec with dp, etp resolved and the order completed with size-1 axes.
  const MeshSpec& spec() const { return spec_; }
  int world_size() const { return spec_.world_size; }
  int tp() const { return spec_.tp; }
  int pp() const { return spec_.pp; }
  int cp() const { return spec_.cp; }
  int dp() const { return spec_.dp; }
  int ep() const { return spec_.ep; }
  int etp() const { return spec_.etp; }
  int edp() const { return edp_; }
  // The five axis names in order, fastest first.
  const std::vector<std::string>& order() const { return order_; }

  // Every group of an axis or '-'-joined combination of axes of the dense
  // mesh ("tp", "dp-cp", "tp-pp", "tp-dp-cp"). ep is not a dense axis.
  absl::StatusOr<RankGroups> Groups(absl::string_view axes) const;
  // The same on the expert mesh: "ep", "tp" (expert-TP), "dp" (expert-DP),
  // "pp" and combinations such as "tp-ep" or "tp-ep-pp".
  absl::StatusOr<RankGroups> ExpertGroups(absl::string_view axes) const;
  // The group of `axes` that holds `rank`, in group order.
  absl::StatusOr<std::vector<int>> GroupOf(int rank, absl::string_view axes) const;
  absl::StatusOr<std::vector<int>> ExpertGroupOf(int rank, absl::string_view axes) const;

  // Coordinates of `rank`: dense "tp", "cp", "dp", "pp", and when ep > 1 or
  // etp != tp also the expert coordinates "etp", "ep", "edp".
  absl::StatusOr<std::map<std::string, int>> Coords(int rank) const;
  // The rank at the given coordinates: either dense axes (tp, cp, dp, pp) or
  // expert axes (etp, ep, edp, pp); axes not given are 0. Giving both kinds is
  // allowed only when they name the same rank.
  absl::StatusOr<int> RankAt(const std::map<std::string, int>& coords) const;

  // Pipeline neighbours of `rank` in its pp group, wrapping around as in
  // Megatron-Core (the next of the last stage is the first).
  absl::StatusOr<int> PipelineNext(int rank) const;
  absl::StatusOr<int> PipelinePrev(int rank) const;
  // The ranks of the first and last pipeline stage of `rank`'s pp group (one
  // rank when pp == 1): the group that ties input and output embeddings.
  absl::StatusOr<std::vector<int>> EmbeddingGroup(int rank) const;

  // Groups of tp, cp (dense) and ep (expert) that span more than one node
  // when nodes hold `ranks_per_node` consecutive ranks (0: use the spec's).
  // Each warning says which order or sizes would keep the axis in a node.
  std::vector<TopologyWarning> CheckTopology(int ranks_per_node = 0) const;

  // A readable table of each axis's groups, at most `max_groups` per axis.
  std::string Describe(int max_groups = 4) const;

 private:
  struct Layout {
    std::array<int, 5> sizes;     // per axis, in order_ order
    std::array<long, 5> strides;  // prefix products
  };
  Mesh() = default;
  absl::StatusOr<RankGroups> GroupsIn(const Layout& layout, absl::string_view axes,
                                      bool expert) const;
  absl::StatusOr<std::vector<int>> GroupOfIn(const Layout& layout, int rank, absl::string_view axes,
                                             bool expert) const;
  absl::Status CheckRank(int rank) const;

  MeshSpec spec_;
  int edp_ = 1;
  std::vector<std::string> order_;
  std::array<int, 5> position_{};  // canonical axis index -> position in order_
  Layout dense_{};
  Layout expert_{};
};

}  // namespace strata
