#include "strata/parallel/world.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "strata/base/status.h"

namespace strata {
namespace {

// The standard groups, in creation order.
constexpr const char* kDenseGroups[] = {"tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-dp-cp"};
constexpr const char* kExpertGroups[] = {"ep", "etp", "edp", "etp-ep"};

// Display order of the tokens in canonical names ("tp-dp-cp", "etp-ep").
constexpr const char* kDenseOrder[] = {"tp", "dp", "cp", "pp"};
constexpr const char* kExpertOrder[] = {"etp", "ep", "edp", "pp"};

// A group name resolved against the mesh.
struct GroupName {
  std::string canonical;  // "dp-cp"
  bool expert = false;
  std::string mesh_axes;  // what Mesh::Groups / ExpertGroups takes: "dp-cp", "tp-ep"
};

absl::StatusOr<GroupName> ResolveName(absl::string_view axes) {
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
                     "; dense and expert axes (ep, etp, edp) cannot be mixed"));
  }
  return GroupName{absl::StrJoin(canonical, "-"), expert, absl::StrJoin(mesh_axes, "-")};
}

bool SameGroups(const RankGroups& a, const RankGroups& b) {
  return a.group_size() == b.group_size() && a.flat() == b.flat();
}

}  // namespace

World::World(std::unique_ptr<Communicator> root, Mesh mesh)
    : root_(std::move(root)), mesh_(std::move(mesh)) {}

World::~World() {
  // Groups before the root: the root's backend may own threads the groups
  // use.
  groups_.clear();
  root_.reset();
}

absl::StatusOr<std::unique_ptr<World>> World::Create(const LaunchEnv& env, const Mesh& mesh,
                                                     const WorldOptions& options) {
  if (options.version != WorldOptions::kVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("WorldOptions version ", options.version,
                     " is not supported (this build: ", WorldOptions::kVersion, ")"));
  }
  if (mesh.world_size() != env.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("the mesh is for ", mesh.world_size(),
                                                   " ranks but the job has ", env.world_size, " (",
                                                   env.ToString(), ")"));
  }
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> root,
                          CreateRootCommunicator(env, options.root));
  return FromRoot(std::move(root), mesh, options);
}

absl::StatusOr<std::unique_ptr<World>> World::FromRoot(std::unique_ptr<Communicator> root,
                                                       const Mesh& mesh,
                                                       const WorldOptions& options) {
  if (root == nullptr) return absl::InvalidArgumentError("World::FromRoot: root is null");
  if (mesh.world_size() != root->size()) {
    return absl::InvalidArgumentError(absl::StrCat("the mesh is for ", mesh.world_size(),
                                                   " ranks but the root communicator has ",
                                                   root->size()));
  }
  std::vector<std::string> names(std::begin(kDenseGroups), std::end(kDenseGroups));
  names.insert(names.end(), std::begin(kExpertGroups), std::end(kExpertGroups));
  for (const std::string& extra : options.extra_groups) names.push_back(extra);

  std::unique_ptr<World> world(new World(std::move(root), mesh));
  const int rank = world->root_->rank();
  std::vector<std::pair<RankGroups, std::shared_ptr<Communicator>>> created;
  for (const std::string& requested : names) {
    STRATA_ASSIGN_OR_RETURN(GroupName name, ResolveName(requested));
    if (world->groups_.count(name.canonical) != 0) continue;
    STRATA_ASSIGN_OR_RETURN(RankGroups groups, name.expert ? mesh.ExpertGroups(name.mesh_axes)
                                                           : mesh.Groups(name.mesh_axes));
    std::shared_ptr<Communicator> comm;
    for (const auto& [other, other_comm] : created) {
      if (SameGroups(groups, other)) comm = other_comm;
    }
    if (comm == nullptr) {
      // This rank's group and position in it: the split's color and key.
      int color = -1, key = -1;
      for (int g = 0; g < groups.num_groups() && color < 0; ++g) {
        absl::Span<const int> members = groups.group(g);
        auto it = std::find(members.begin(), members.end(), rank);
        if (it != members.end()) {
          color = g;
          key = static_cast<int>(it - members.begin());
        }
      }
      STRATA_CHECK(color >= 0, "rank ", rank, " is in no group of ", name.canonical);
      CommOptions comm_options;
      comm_options.name = name.canonical;
      comm_options.timeout = options.root.comm.timeout;
      STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> split,
                              world->root_->Split(color, key, comm_options));
      STRATA_CHECK(split != nullptr, "split of ", name.canonical, " returned no communicator");
      comm = std::move(split);
      created.emplace_back(std::move(groups), comm);
    }
    world->groups_[name.canonical] = comm;
    world->order_.push_back(name.canonical);
  }
  return world;
}

absl::StatusOr<Communicator*> World::Group(absl::string_view axes) const {
  if (axes == "world" || axes == root_->name()) return root_.get();
  STRATA_ASSIGN_OR_RETURN(GroupName name, ResolveName(axes));
  auto it = groups_.find(name.canonical);
  if (it == groups_.end()) {
    return absl::NotFoundError(absl::StrCat("no group '", axes, "' in this world (groups: world, ",
                                            absl::StrJoin(order_, ", "),
                                            "; add others with WorldOptions::extra_groups)"));
  }
  return it->second.get();
}

std::vector<std::string> World::GroupNames() const { return order_; }

}  // namespace strata
