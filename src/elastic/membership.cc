// Membership values and the regroup arithmetic (membership.h).
#include "strata/elastic/membership.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "strata/base/status.h"

namespace strata::elastic {
namespace {

// Union-find over root ranks.
class Components {
 public:
  explicit Components(int n) : parent_(static_cast<size_t>(n)) {
    std::iota(parent_.begin(), parent_.end(), 0);
  }
  int Find(int x) {
    while (parent_[x] != x) {
      parent_[x] = parent_[parent_[x]];
      x = parent_[x];
    }
    return x;
  }
  void Union(int a, int b) {
    a = Find(a);
    b = Find(b);
    if (a != b) parent_[std::max(a, b)] = std::min(a, b);
  }
  void UnionGroups(const RankGroups& groups) {
    for (int g = 0; g < groups.num_groups(); ++g) {
      absl::Span<const int> members = groups.group(g);
      for (size_t i = 1; i < members.size(); ++i) Union(members[0], members[i]);
    }
  }

 private:
  std::vector<int> parent_;
};

std::string Ranks(absl::Span<const int> ranks) {
  return absl::StrCat("[", absl::StrJoin(ranks, ", "), "]");
}

}  // namespace

int Membership::RootRankOf(int job_rank) const {
  auto it = std::find(members.begin(), members.end(), job_rank);
  return it == members.end() ? -1 : static_cast<int>(it - members.begin());
}

int Membership::spares() const {
  return std::max(0, static_cast<int>(members.size()) - mesh.world_size);
}

bool Membership::IsSpare(int job_rank) const {
  const int root = RootRankOf(job_rank);
  return root >= 0 && root >= mesh.world_size;
}

std::string Membership::ToString() const {
  const size_t active = std::min(members.size(), static_cast<size_t>(mesh.world_size));
  std::string out = absl::StrCat("epoch ", epoch, ": ", active, " ranks ",
                                 Ranks(absl::MakeConstSpan(members).subspan(0, active)), ", ",
                                 DescribeMesh(mesh));
  if (spares() > 0) {
    absl::StrAppend(&out, ", spares ", Ranks(absl::MakeConstSpan(members).subspan(active)));
  }
  return out;
}

Membership InitialMembership(const MeshSpec& mesh, int spares) {
  Membership m;
  m.epoch = 1;
  m.members.resize(static_cast<size_t>(mesh.world_size + std::max(0, spares)));
  std::iota(m.members.begin(), m.members.end(), 0);
  m.mesh = mesh;
  absl::StatusOr<Mesh> made = Mesh::Create(mesh);
  m.full_dp = made.ok() ? made->spec().dp : 0;
  return m;
}

std::string DescribeMesh(const MeshSpec& spec) {
  std::vector<std::string> parts;
  const int dp = spec.dp > 0 ? spec.dp : spec.world_size / std::max(1, spec.tp * spec.cp * spec.pp);
  if (dp > 1) parts.push_back(absl::StrCat("dp", dp));
  if (spec.tp > 1) parts.push_back(absl::StrCat("tp", spec.tp));
  if (spec.cp > 1) parts.push_back(absl::StrCat("cp", spec.cp));
  if (spec.pp > 1) parts.push_back(absl::StrCat("pp", spec.pp));
  if (spec.ep > 1) parts.push_back(absl::StrCat("ep", spec.ep));
  if (spec.etp > 0 && spec.etp != spec.tp) parts.push_back(absl::StrCat("etp", spec.etp));
  if (parts.empty()) return spec.world_size == 1 ? "1 rank" : absl::StrCat("dp", dp);
  return absl::StrJoin(parts, " x ");
}

std::vector<std::vector<int>> Replicas(const Mesh& mesh) {
  const int n = mesh.world_size();
  Components c(n);
  // Every rank that differs from another only in model-parallel axes.
  absl::StatusOr<RankGroups> dense = mesh.Groups("tp-cp-pp");
  STRATA_CHECK(dense.ok(), dense.status().ToString());
  c.UnionGroups(*dense);
  absl::StatusOr<RankGroups> expert = mesh.ExpertGroups("tp-ep-pp");
  STRATA_CHECK(expert.ok(), expert.status().ToString());
  c.UnionGroups(*expert);
  std::map<int, std::vector<int>> by_root;
  for (int r = 0; r < n; ++r) by_root[c.Find(r)].push_back(r);
  std::vector<std::vector<int>> out;
  out.reserve(by_root.size());
  for (auto& [root, ranks] : by_root) out.push_back(std::move(ranks));
  return out;  // std::map orders by the smallest rank (the component's root)
}

absl::StatusOr<RegroupPlan> PlanRegroup(const Mesh& mesh, absl::Span<const int> failed) {
  const int n = mesh.world_size();
  std::vector<int> sorted(failed.begin(), failed.end());
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    if (sorted[i] < 0 || sorted[i] >= n) {
      return absl::InvalidArgumentError(
          absl::StrCat("failed rank ", sorted[i], " is not a rank of the world of ", n));
    }
    if (i > 0 && sorted[i] == sorted[i - 1]) {
      return absl::InvalidArgumentError(
          absl::StrCat("failed rank ", sorted[i], " is listed twice"));
    }
  }
  RegroupPlan plan;
  plan.failed = sorted;
  const std::vector<std::vector<int>> replicas = Replicas(mesh);
  plan.replicas_before = static_cast<int>(replicas.size());
  std::vector<char> out(static_cast<size_t>(n), 0);
  for (int r : sorted) out[r] = 1;
  std::vector<std::string> broken;
  for (const std::vector<int>& replica : replicas) {
    std::vector<int> lost;
    for (int r : replica) {
      if (out[r] == 1) lost.push_back(r);
    }
    if (lost.empty()) {
      ++plan.replicas_after;
      continue;
    }
    broken.push_back(absl::StrCat("replica ", Ranks(replica), " lost ", Ranks(lost)));
    for (int r : replica) {
      if (out[r] == 0) {
        out[r] = 2;
        plan.leaving.push_back(r);
      }
    }
  }
  std::sort(plan.leaving.begin(), plan.leaving.end());
  if (plan.replicas_after == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no complete model replica is left to rebuild the mesh ", DescribeMesh(mesh.spec()),
        " from: every replica lost a rank (", absl::StrJoin(broken, "; "),
        "); model-parallel groups (tp, cp, pp, ep) cannot be rebuilt without their ranks"));
  }
  for (int r = 0; r < n; ++r) {
    if (out[r] == 0) {
      plan.survivors.push_back(r);
    } else {
      plan.excluded.push_back(r);
    }
  }
  MeshSpec spec = mesh.spec();
  spec.world_size = static_cast<int>(plan.survivors.size());
  spec.dp = 0;  // inferred: the other axes keep their sizes
  absl::StatusOr<Mesh> next = Mesh::Create(spec);
  if (!next.ok()) {
    return strata::internal::Annotate(
        next.status(), absl::StrCat("the mesh ", DescribeMesh(mesh.spec()), " without ranks ",
                                    Ranks(plan.excluded), " (", plan.replicas_after,
                                    " complete replicas) cannot be laid out"));
  }
  // Every survivor must keep its model-parallel coordinates, hence its
  // shards; only dp (and expert dp) may change. This holds for every order
  // string because a removed replica is a full slice of the other axes, but
  // it is what makes keeping the state in memory correct, so it is checked.
  for (int i = 0; i < static_cast<int>(plan.survivors.size()); ++i) {
    absl::StatusOr<std::map<std::string, int>> before = mesh.Coords(plan.survivors[i]);
    absl::StatusOr<std::map<std::string, int>> after = next->Coords(i);
    STRATA_CHECK(before.ok() && after.ok(), "coordinates of a valid rank");
    for (const auto& [axis, value] : *before) {
      if (axis == "dp" || axis == "edp") continue;
      auto it = after->find(axis);
      const int now = it == after->end() ? 0 : it->second;
      if (now != value) {
        return absl::FailedPreconditionError(absl::StrCat(
            "the mesh ", DescribeMesh(mesh.spec()), " without ranks ", Ranks(plan.excluded),
            " would move rank ", plan.survivors[i], " from ", axis, " ", value, " to ", axis, " ",
            now, " (order '", mesh.spec().order, "'): its shards would not fit its new place"));
      }
    }
  }
  plan.new_mesh = next->spec();
  return plan;
}

absl::StatusOr<ChangePlan> PlanChange(const Membership& current, absl::Span<const int> failed) {
  const int active = current.mesh.world_size;
  std::vector<char> gone(current.members.size(), 0);
  for (int f : failed) {
    const int root = current.RootRankOf(f);
    if (root < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("failed rank ", f, " is no member of ", current.ToString()));
    }
    gone[static_cast<size_t>(root)] = 1;
  }
  std::vector<int> spares;  // live spares, in standing order
  for (size_t r = static_cast<size_t>(active); r < current.members.size(); ++r) {
    if (gone[r] == 0) spares.push_back(current.members[r]);
  }
  STRATA_ASSIGN_OR_RETURN(Mesh mesh, Mesh::Create(current.mesh));
  // The failed mesh positions of each replica; the replicas that lost the
  // fewest get spares first (a spare placed in a replica that is dropped
  // anyway would be wasted).
  std::vector<std::vector<int>> losses;
  for (const std::vector<int>& replica : Replicas(mesh)) {
    std::vector<int> lost;
    for (int r : replica) {
      if (gone[static_cast<size_t>(r)] != 0) lost.push_back(r);
    }
    if (!lost.empty()) losses.push_back(std::move(lost));
  }
  std::stable_sort(losses.begin(), losses.end(),
                   [](const auto& a, const auto& b) { return a.size() < b.size(); });
  std::map<int, int> placed;  // mesh position -> spare's job rank
  std::vector<int> dropped;   // failed positions left without a spare
  size_t next_spare = 0;
  for (const std::vector<int>& lost : losses) {
    if (spares.size() - next_spare >= lost.size()) {
      for (int position : lost) placed[position] = spares[next_spare++];
    } else {
      dropped.insert(dropped.end(), lost.begin(), lost.end());
    }
  }
  STRATA_ASSIGN_OR_RETURN(RegroupPlan regroup, PlanRegroup(mesh, dropped));
  ChangePlan plan;
  plan.next.mesh = regroup.new_mesh;
  for (int r : regroup.leaving) plan.leaving.push_back(current.members[static_cast<size_t>(r)]);
  std::sort(plan.leaving.begin(), plan.leaving.end());
  for (int position : regroup.survivors) {
    auto it = placed.find(position);
    if (it == placed.end()) {
      plan.next.members.push_back(current.members[static_cast<size_t>(position)]);
    } else {
      plan.next.members.push_back(it->second);
      plan.replaced.emplace_back(current.members[static_cast<size_t>(position)], it->second);
    }
  }
  for (size_t i = next_spare; i < spares.size(); ++i) plan.next.members.push_back(spares[i]);
  return plan;
}

absl::StatusOr<std::vector<int>> PlanGrow(Membership& next) {
  std::vector<int> grown;
  while (true) {
    STRATA_ASSIGN_OR_RETURN(Mesh mesh, Mesh::Create(next.mesh));
    const MeshSpec& spec = mesh.spec();
    if (spec.ep > 1 || spec.dp >= next.full_dp || spec.dp < 1) return grown;
    const int replica = spec.world_size / spec.dp;
    if (next.spares() < replica) return grown;
    MeshSpec bigger = spec;
    bigger.world_size = spec.world_size + replica;
    bigger.dp = spec.dp + 1;
    absl::StatusOr<Mesh> grew = Mesh::Create(bigger);
    if (!grew.ok()) {
      return strata::internal::Annotate(
          grew.status(), absl::StrCat("growing the mesh ", DescribeMesh(spec), " by a replica"));
    }
    const size_t active = static_cast<size_t>(spec.world_size);
    std::vector<int> spares(next.members.begin() + static_cast<std::ptrdiff_t>(active),
                            next.members.end());
    std::vector<int> members;
    size_t used = 0;
    for (int r = 0; r < bigger.world_size; ++r) {
      absl::StatusOr<std::map<std::string, int>> coords = grew->Coords(r);
      STRATA_CHECK(coords.ok(), "coordinates of a valid rank");
      if (coords->at("dp") < spec.dp) {
        std::map<std::string, int> dense;
        for (const char* axis : {"tp", "cp", "dp", "pp"}) {
          auto it = coords->find(axis);
          if (it != coords->end()) dense[axis] = it->second;
        }
        absl::StatusOr<int> old = mesh.RankAt(dense);
        STRATA_CHECK(old.ok(), "a member's position in the smaller mesh");
        members.push_back(next.members[static_cast<size_t>(*old)]);
      } else {
        members.push_back(spares[used]);
        grown.push_back(spares[used++]);
      }
    }
    members.insert(members.end(), spares.begin() + static_cast<std::ptrdiff_t>(used), spares.end());
    next.members = std::move(members);
    next.mesh = grew->spec();
  }
}

}  // namespace strata::elastic
