// Membership: who is in the job now (an epoch), and how a mesh regroups when
// ranks leave it.
//
// A Membership is the value every member of one epoch agrees on: the epoch
// number (1 at start, +1 at every membership change: a failure, and later an
// eviction or a join), the job ranks (the ranks of the original world,
// stable identities) that form the current World in root-rank order, and
// the mesh spec they are laid out by.
//
// PlanRegroup is the arithmetic of "a rank died": model-parallel groups
// (tp, cp, pp, and on the expert mesh etp, ep, pp) must stay whole, so a
// data-parallel replica that lost a rank is dropped whole. A replica is the
// smallest set of ranks closed under membership of those groups (with ep = 1
// it is one dp slice: every rank with the same dp coordinate; with ep > 1 it
// is every rank with the same expert-dp coordinate, ep dense slices). The
// survivors keep their order, their tp/cp/pp (and etp/ep) coordinates and so
// their shards; only their dp coordinate changes.
//
//   absl::StatusOr<strata::elastic::RegroupPlan> plan =
//       strata::elastic::PlanRegroup(mesh, /*failed root ranks=*/{3});
//   // dp4 x tp2: plan->leaving == {2}, plan->new_mesh.dp == 3
//
// Thread-safety: values and pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "strata/base/export.h"
#include "strata/parallel/mesh.h"

namespace strata::elastic {

struct STRATA_EXPORT Membership {
  // 1 at the start of a job; +1 at every agreed change.
  uint64_t epoch = 1;
  // members[i] is the job rank of root rank i of the current World's job
  // communicator: first the mesh.world_size ranks of the mesh, in mesh
  // order, then the hot spares (initialised, standing by, in no group).
  std::vector<int> members;
  // The current mesh (spec.world_size <= members.size()).
  MeshSpec mesh;
  // The data-parallel size the job started with: joiners (and spares) make
  // dp grow back up to it (PlanGrow). 0: unknown (no growing).
  int full_dp = 0;
  // How many join requests the agreements so far have answered (admitted
  // or refused): the n-th request to join the job (n > joins_seen) is still
  // waiting.
  int64_t joins_seen = 0;

  // The root rank of `job_rank` in this epoch, or -1 when it is no member.
  int RootRankOf(int job_rank) const;
  // How many members stand by, and whether `job_rank` is one of them.
  int spares() const;
  bool IsSpare(int job_rank) const;
  // "epoch 2: 6 ranks [0, 1, 4, 5, 6, 7], dp3 x tp2" (", spares [8]").
  std::string ToString() const;
};

// The starting membership of a World of `mesh` and `spares` hot spares:
// epoch 1, job ranks 0..n-1 in the mesh, n..n+spares-1 standing by;
// full_dp is the mesh's dp.
STRATA_EXPORT Membership InitialMembership(const MeshSpec& mesh, int spares = 0);

// "dp4 x tp2" (axes of size 1 left out; "1 rank" for a world of one).
STRATA_EXPORT std::string DescribeMesh(const MeshSpec& spec);

// The replicas of `mesh` (see the header comment), each a sorted list of
// root ranks, ordered by their smallest rank.
STRATA_EXPORT std::vector<std::vector<int>> Replicas(const Mesh& mesh);

// What a change of membership does to the current mesh.
struct STRATA_EXPORT RegroupPlan {
  // Root ranks (of the current World), each sorted.
  std::vector<int> failed;     // ranks that are gone
  std::vector<int> leaving;    // live ranks of replicas that lost a rank
  std::vector<int> excluded;   // failed + leaving: what Shrink excludes
  std::vector<int> survivors;  // everyone else, in root-rank order
  // The mesh of the survivors: the same sizes and order but dp (and edp).
  MeshSpec new_mesh;
  int replicas_before = 0;
  int replicas_after = 0;
};

// Plans the regroup of `mesh` without the root ranks `failed` (any order,
// no duplicates, each in [0, world)). FailedPrecondition naming the replicas
// and what each lost when no complete replica is left; InvalidArgument for
// a bad rank. An empty `failed` plans a rebuild onto the same mesh.
STRATA_EXPORT absl::StatusOr<RegroupPlan> PlanRegroup(const Mesh& mesh,
                                                      absl::Span<const int> failed);

// What a change of membership does, spares included: each replica that
// lost ranks gets spares in their places (the spare takes the failed rank's
// mesh position, so dp stays) while enough spares are alive, replicas with
// the fewest losses first; the replicas left without are dropped whole as
// PlanRegroup says.
struct STRATA_EXPORT ChangePlan {
  // The next membership (epoch unset): members in root order, the mesh.
  Membership next;
  // Job ranks: live ranks of dropped replicas, sorted.
  std::vector<int> leaving;
  // (failed job rank, the spare that takes its mesh position), by position.
  std::vector<std::pair<int, int>> replaced;
};

// Plans the change of `current` without the job ranks `failed` (members of
// `current`, any order). The errors of PlanRegroup; InvalidArgument for a
// rank that is no member.
STRATA_EXPORT absl::StatusOr<ChangePlan> PlanChange(const Membership& current,
                                                    absl::Span<const int> failed);

// Growing back: while `next` has fewer replicas than `next.full_dp` and
// enough spares for a whole replica, the first spares form a new replica
// (dp + 1): the members keep every coordinate but nothing moves (the new
// replica takes the positions of the highest dp coordinate) and the spares
// take the new positions in mesh order. Returns the job ranks so placed, in
// position order (none when nothing grew). Only meshes whose replica is one
// data-parallel slice grow (ep = 1; with ep > 1 joiners stay spares).
STRATA_EXPORT absl::StatusOr<std::vector<int>> PlanGrow(Membership& next);

}  // namespace strata::elastic
