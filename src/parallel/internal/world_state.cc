// WorldState: group names, creation (standard, on request, shared), the
// lookups, Rebuild, AbortAll and Destroy (see world_state.h, world.h).
#include "parallel/internal/world_state.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "parallel/internal/named_communicator.h"
#include "strata/base/status.h"

namespace strata::internal {
namespace {

// The standard groups, in creation order.
constexpr const char* kStandardGroups[] = {"tp",       "cp", "dp",  "pp",  "dp-cp", "tp-pp",
                                           "tp-dp-cp", "ep", "etp", "edp", "etp-ep"};

// Display order of the tokens in canonical names ("tp-dp-cp", "etp-ep").
constexpr const char* kDenseOrder[] = {"tp", "dp", "cp", "pp"};
constexpr const char* kExpertOrder[] = {"etp", "ep", "edp", "pp"};

bool SameGroups(const RankGroups& a, const RankGroups& b) {
  return a.group_size() == b.group_size() && a.flat() == b.flat();
}

absl::StatusOr<RankGroups> GroupsOf(const Mesh& mesh, const GroupName& name) {
  return name.expert ? mesh.ExpertGroups(name.mesh_axes) : mesh.Groups(name.mesh_axes);
}

void AbortQuietly(const std::shared_ptr<Communicator>& c) {
  if (c != nullptr) (void)c->Abort();
}

absl::Status SpareHasNoGroup(const std::string& canonical) {
  return absl::FailedPreconditionError(
      absl::StrCat("group '", canonical,
                   "': this rank is a hot spare, in no group of the mesh until it takes a "
                   "member's place (strata.elastic places spares at a failure)"));
}

}  // namespace

absl::StatusOr<GroupName> ParseGroupName(absl::string_view axes) {
  if (axes == "world") return GroupName{"world", false, ""};
  std::vector<std::string> tokens = absl::StrSplit(axes, '-');
  bool expert = false;
  for (const std::string& t : tokens) {
    if (t == "ep" || t == "etp" || t == "edp") expert = true;
  }
  const auto& order = expert ? kExpertOrder : kDenseOrder;
  std::vector<std::string> canonical, mesh_axes;
  for (const char* axis : order) {
    const long n = std::count(tokens.begin(), tokens.end(), axis);
    if (n > 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("group '", axes, "' names axis ", axis, " twice"));
    }
    if (n == 1) {
      canonical.push_back(axis);
      std::string a = axis;
      if (a == "etp") a = "tp";
      if (a == "edp") a = "dp";
      mesh_axes.push_back(a);
    }
  }
  if (canonical.size() != tokens.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("group '", axes, "' is not a combination of ",
                     expert ? "expert axes (etp, ep, edp, pp)" : "dense axes (tp, dp, cp, pp)",
                     " nor 'world'; dense and expert axes (ep, etp, edp) cannot be mixed"));
  }
  return GroupName{absl::StrJoin(canonical, "-"), expert, absl::StrJoin(mesh_axes, "-")};
}

std::vector<std::string> AllGroupNames() {
  std::vector<std::string> out = {"world"};
  for (const auto* order : {&kDenseOrder, &kExpertOrder}) {
    const bool expert = order == &kExpertOrder;
    for (unsigned mask = 1; mask < 16; ++mask) {
      std::vector<std::string> axes;
      for (int i = 0; i < 4; ++i) {
        if (mask & (1u << i)) axes.push_back((*order)[i]);
      }
      if (expert && axes == std::vector<std::string>{"pp"}) continue;  // the dense pp
      out.push_back(absl::StrJoin(axes, "-"));
    }
  }
  return out;
}

WorldState::WorldState(std::unique_ptr<Communicator> job, Mesh mesh, Timeouts timeouts)
    : timeouts_(timeouts), job_(std::move(job)), mesh_(std::move(mesh)) {
  if (job_->size() == mesh_.world_size()) {
    root_ = job_;
    world_ = WorldAlias(root_);
  }
}

absl::StatusOr<std::shared_ptr<Communicator>> WorldState::SplitRoot(
    const std::shared_ptr<Communicator>& job, const Mesh& mesh, uint64_t generation) const {
  if (job->size() == mesh.world_size()) return job;
  const bool member = job->rank() < mesh.world_size();
  CommOptions options;
  options.name = "world";
  options.timeout = timeouts_.op;
  absl::StatusOr<std::unique_ptr<Communicator>> split =
      job->Split(member ? 0 : -1, job->rank(), options);
  if (!split.ok()) {
    return Annotate(split.status(),
                    absl::StrCat("splitting the mesh's ", mesh.world_size(), " ranks from the ",
                                 job->size() - mesh.world_size(), " spares (world generation ",
                                 generation, ")"));
  }
  return std::shared_ptr<Communicator>(std::move(split).value());
}

WorldState::~WorldState() { Destroy(); }

std::shared_ptr<Communicator> WorldState::WorldAlias(const std::shared_ptr<Communicator>& root) {
  if (root->name() == "world") return root;
  return std::make_shared<NamedCommunicator>(root, "world");
}

const WorldState::Entry* WorldState::Find(const Groups& groups, const std::string& name) {
  for (const Entry& e : groups) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

absl::Status WorldState::Usable(absl::string_view what) const {
  const uint64_t g = generation();
  if (destroyed_) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": its World was destroyed (at generation ", g, ")"));
  }
  if (rebuilding_) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": the World is being rebuilt to generation ", g,
                     "; resolve the group again once World::Rebuild has returned"));
  }
  if (!broken_.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": world generation ", g, " is unusable: its rebuild failed (",
                     broken_.ToString(), "); rebuild the World again or destroy it"));
  }
  return absl::OkStatus();
}

absl::Status WorldState::status() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  return Usable("the World");
}

Mesh WorldState::mesh() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  return mesh_;
}

Communicator* WorldState::root() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  return root_ != nullptr ? root_.get() : job_.get();
}

Communicator* WorldState::job() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  return job_.get();
}

bool WorldState::spare() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  return job_ != nullptr && job_->rank() >= mesh_.world_size();
}

int WorldState::spares() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  return job_ != nullptr ? job_->size() - mesh_.world_size() : 0;
}

std::vector<std::string> WorldState::GroupNames() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  std::vector<std::string> out;
  for (const Entry& e : groups_) out.push_back(e.name);
  return out;
}

absl::Status WorldState::CreateInto(Communicator& root, const Mesh& mesh, uint64_t generation,
                                    const GroupName& name, Agreement agreement,
                                    Groups* groups) const {
  STRATA_ASSIGN_OR_RETURN(RankGroups members, GroupsOf(mesh, name));
  // The same members as a group that exists: share its communicator. Every
  // rank decides alike (the mesh is the same everywhere), so no collective.
  for (const Entry& e : *groups) {
    if (e.base != e.comm) continue;  // compare with the communicators' owners only
    STRATA_ASSIGN_OR_RETURN(GroupName other, ParseGroupName(e.name));
    STRATA_ASSIGN_OR_RETURN(RankGroups other_members, GroupsOf(mesh, other));
    if (SameGroups(members, other_members)) {
      groups->push_back(
          {name.canonical, std::make_shared<NamedCommunicator>(e.base, name.canonical), e.base});
      return absl::OkStatus();
    }
  }
  if (agreement == Agreement::kCheck) {
    STRATA_RETURN_IF_ERROR(AgreeOnGroup(root, name.canonical, generation, timeouts_.creation));
  }
  // This rank's group and position in it: the split's color and key.
  const int rank = root.rank();
  int color = -1, key = -1;
  for (int g = 0; g < members.num_groups() && color < 0; ++g) {
    absl::Span<const int> group = members.group(g);
    auto it = std::find(group.begin(), group.end(), rank);
    if (it != group.end()) {
      color = g;
      key = static_cast<int>(it - group.begin());
    }
  }
  STRATA_CHECK(color >= 0, "rank ", rank, " is in no group of ", name.canonical);
  CommOptions options;
  options.name = name.canonical;
  options.timeout = timeouts_.op;
  absl::StatusOr<std::unique_ptr<Communicator>> split = root.Split(color, key, options);
  if (!split.ok()) {
    return Annotate(split.status(), absl::StrCat("creating group '", name.canonical,
                                                 "' (world generation ", generation, ")"));
  }
  STRATA_CHECK(*split != nullptr, "split of ", name.canonical, " returned no communicator");
  std::shared_ptr<Communicator> comm = std::move(split).value();
  groups->push_back({name.canonical, comm, comm});
  return absl::OkStatus();
}

absl::Status WorldState::CreateStandardGroups() {
  std::lock_guard<std::mutex> create(create_mu_);
  if (root_ == nullptr) {
    STRATA_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> root,
                            SplitRoot(job_, mesh_, generation()));
    std::unique_lock<std::shared_mutex> lock(mu_);
    root_ = std::move(root);
    if (root_ != nullptr) world_ = WorldAlias(root_);
  }
  if (root_ == nullptr) return absl::OkStatus();  // a spare: no group
  Groups groups;
  for (const char* requested : kStandardGroups) {
    STRATA_ASSIGN_OR_RETURN(GroupName name, ParseGroupName(requested));
    STRATA_RETURN_IF_ERROR(
        CreateInto(*root_, mesh_, generation(), name, Agreement::kNone, &groups));
  }
  std::unique_lock<std::shared_mutex> lock(mu_);
  groups_ = std::move(groups);
  return absl::OkStatus();
}

absl::StatusOr<ResolvedGroup> WorldState::Get(const std::string& canonical) {
  {
    std::shared_lock<std::shared_mutex> lock(mu_);
    if (destroyed_ || rebuilding_ || !broken_.ok()) {
      return Usable(absl::StrCat("group '", canonical, "'"));
    }
    if (root_ == nullptr) return SpareHasNoGroup(canonical);
    if (canonical == "world") return ResolvedGroup{world_.get(), generation()};
    if (const Entry* e = Find(groups_, canonical)) {
      return ResolvedGroup{e->comm.get(), generation()};
    }
  }
  const std::string what = absl::StrCat("group '", canonical, "'");
  STRATA_ASSIGN_OR_RETURN(GroupName name, ParseGroupName(canonical));
  // Not created yet: one creation at a time, and never under `mu_`.
  std::lock_guard<std::mutex> create(create_mu_);
  std::shared_ptr<Communicator> root;
  Groups groups;
  uint64_t now;
  Mesh mesh = [&] {
    std::shared_lock<std::shared_mutex> lock(mu_);
    return mesh_;
  }();
  {
    std::shared_lock<std::shared_mutex> lock(mu_);
    STRATA_RETURN_IF_ERROR(Usable(what));
    if (root_ == nullptr) return SpareHasNoGroup(canonical);
    if (name.world()) return ResolvedGroup{world_.get(), generation()};
    if (const Entry* e = Find(groups_, name.canonical)) {  // another thread made it
      return ResolvedGroup{e->comm.get(), generation()};
    }
    root = root_;
    groups = groups_;
    now = generation();
  }
  STRATA_RETURN_IF_ERROR(CreateInto(*root, mesh, now, name, Agreement::kCheck, &groups));
  std::unique_lock<std::shared_mutex> lock(mu_);
  // create_mu_ keeps Rebuild and Destroy out meanwhile.
  groups_.push_back(groups.back());
  return ResolvedGroup{groups_.back().comm.get(), now};
}

absl::Status WorldState::Rebuild(std::unique_ptr<Communicator> new_root, const Mesh& new_mesh) {
  if (new_root == nullptr)
    return absl::InvalidArgumentError("World::Rebuild: the new root is null");
  if (new_mesh.world_size() > new_root->size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("World::Rebuild: the mesh is for ", new_mesh.world_size(),
                     " ranks but the new root communicator '", new_root->name(), "' has only ",
                     new_root->size()));
  }
  std::lock_guard<std::mutex> create(create_mu_);
  std::shared_ptr<Communicator> old_job, old_root, old_world;
  Groups old_groups;
  uint64_t generation;
  std::shared_ptr<Communicator> job = std::move(new_root);
  std::shared_ptr<Communicator> root = job->size() == new_mesh.world_size() ? job : nullptr;
  {
    std::unique_lock<std::shared_mutex> lock(mu_);
    if (destroyed_) return absl::FailedPreconditionError("World::Rebuild: the World was destroyed");
    old_job = std::move(job_);
    old_root = std::move(root_);
    old_world = std::move(world_);
    old_groups = std::move(groups_);
    groups_.clear();
    job_ = job;    // AbortAll reaches the new communicators while the groups are made
    root_ = root;  // null until split off the job's spares
    if (root_ != nullptr) world_ = WorldAlias(root_);
    mesh_ = new_mesh;
    broken_ = absl::OkStatus();
    rebuilding_ = true;
    generation = generation_.fetch_add(1, std::memory_order_acq_rel) + 1;
  }
  // The old generation: abort first, so that pending Work fails with
  // Aborted and nothing waits on a peer that left, then destroy (groups
  // before the root, whose backend may own threads they use).
  for (const Entry& e : old_groups) AbortQuietly(e.comm);
  AbortQuietly(old_root);
  AbortQuietly(old_job);
  old_groups.clear();
  old_world.reset();
  old_root.reset();
  old_job.reset();

  Groups groups;
  absl::Status made;
  if (root == nullptr) {
    absl::StatusOr<std::shared_ptr<Communicator>> split = SplitRoot(job, new_mesh, generation);
    if (split.ok()) {
      root = *std::move(split);
      std::unique_lock<std::shared_mutex> lock(mu_);
      root_ = root;
      if (root_ != nullptr) world_ = WorldAlias(root_);
    } else {
      made = split.status();
    }
  }
  for (const char* requested : kStandardGroups) {
    if (!made.ok() || root == nullptr) break;  // failed, or a spare: no group
    absl::StatusOr<GroupName> name = ParseGroupName(requested);
    STRATA_CHECK(name.ok(), name.status().ToString());
    made = CreateInto(*root, new_mesh, generation, *name, Agreement::kNone, &groups);
    if (!made.ok()) break;
  }
  if (!made.ok()) {
    // Never half a world: what was made goes, and the World says why.
    for (const Entry& e : groups) AbortQuietly(e.comm);
    groups.clear();
    made = Annotate(made, absl::StrCat("rebuilding the World to generation ", generation));
  }
  std::unique_lock<std::shared_mutex> lock(mu_);
  rebuilding_ = false;
  groups_ = std::move(groups);
  broken_ = made;
  return made;
}

void WorldState::AbortAll() {
  std::vector<std::shared_ptr<Communicator>> comms;
  {
    std::shared_lock<std::shared_mutex> lock(mu_);
    comms.push_back(job_);
    if (root_ != job_) comms.push_back(root_);
    for (const Entry& e : groups_) comms.push_back(e.base);
  }
  // Outside the lock; the copies keep them alive if Rebuild drops them
  // meanwhile.
  for (const auto& c : comms) AbortQuietly(c);
}

void WorldState::Destroy() {
  std::lock_guard<std::mutex> create(create_mu_);
  std::shared_ptr<Communicator> job, root, world;
  Groups groups;
  {
    std::unique_lock<std::shared_mutex> lock(mu_);
    if (destroyed_) return;
    destroyed_ = true;
    job = std::move(job_);
    root = std::move(root_);
    world = std::move(world_);
    groups = std::move(groups_);
  }
  // Groups before the root: the root's backend may own threads the groups
  // use.
  groups.clear();
  world.reset();
  root.reset();
  job.reset();
}

}  // namespace strata::internal
