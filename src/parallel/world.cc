// World: creation, the group lookups, Rebuild and AbortAll over the shared
// state (parallel/internal/world_state.h), and GroupHandle.
#include "strata/parallel/world.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "parallel/internal/world_state.h"
#include "strata/base/status.h"

namespace strata {

using internal::GroupName;
using internal::ParseGroupName;
using internal::WorldState;

World::World(std::shared_ptr<WorldState> state) : state_(std::move(state)) {}

World::~World() { state_->Destroy(); }

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
  if (options.version != WorldOptions::kVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("WorldOptions version ", options.version,
                     " is not supported (this build: ", WorldOptions::kVersion, ")"));
  }
  if (root == nullptr) return absl::InvalidArgumentError("World::FromRoot: root is null");
  if (mesh.world_size() != root->size()) {
    return absl::InvalidArgumentError(absl::StrCat("the mesh is for ", mesh.world_size(),
                                                   " ranks but the root communicator has ",
                                                   root->size()));
  }
  if (options.group_creation_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("WorldOptions::group_creation_timeout is ",
                     absl::FormatDuration(options.group_creation_timeout), "; want >= 0"));
  }
  WorldState::Timeouts timeouts;
  timeouts.op = options.root.comm.timeout;
  timeouts.creation = options.group_creation_timeout > absl::ZeroDuration()
                          ? options.group_creation_timeout
                          : options.root.comm.timeout;
  auto state = std::make_shared<WorldState>(std::move(root), mesh, timeouts);
  STRATA_RETURN_IF_ERROR(state->CreateStandardGroups());
  return std::unique_ptr<World>(new World(std::move(state)));
}

int World::rank() const { return state_->root()->rank(); }
int World::size() const { return state_->root()->size(); }
Mesh World::mesh() const { return state_->mesh(); }
Communicator& World::root() const { return *state_->root(); }
uint64_t World::generation() const { return state_->generation(); }
absl::Status World::status() const { return state_->status(); }

absl::StatusOr<Communicator*> World::Group(absl::string_view axes) {
  STRATA_ASSIGN_OR_RETURN(GroupName name, ParseGroupName(axes));
  STRATA_ASSIGN_OR_RETURN(internal::ResolvedGroup group, state_->Get(name.canonical));
  return group.comm;
}

absl::StatusOr<GroupHandle> World::Handle(absl::string_view axes) {
  STRATA_ASSIGN_OR_RETURN(GroupName name, ParseGroupName(axes));
  STRATA_RETURN_IF_ERROR(state_->Get(name.canonical).status());  // created now, if new
  GroupHandle handle;
  handle.kind_ = GroupHandle::Kind::kWorld;
  handle.name_ = name.canonical;
  handle.world_ = state_;
  return handle;
}

std::vector<std::string> World::GroupNames() const { return state_->GroupNames(); }

std::vector<std::string> World::AllGroupNames() { return internal::AllGroupNames(); }

absl::StatusOr<std::string> World::CanonicalGroupName(absl::string_view axes) {
  STRATA_ASSIGN_OR_RETURN(GroupName name, ParseGroupName(axes));
  return name.canonical;
}

absl::Status World::Rebuild(std::unique_ptr<Communicator> new_root, const Mesh& new_mesh) {
  return state_->Rebuild(std::move(new_root), new_mesh);
}

void World::AbortAll() { state_->AbortAll(); }

// ---- GroupHandle -----------------------------------------------------------

GroupHandle::GroupHandle() = default;

GroupHandle GroupHandle::Fixed(Communicator* comm) {
  GroupHandle handle;
  if (comm == nullptr) return handle;
  handle.kind_ = Kind::kFixed;
  handle.name_ = comm->name();
  handle.fixed_ = comm;
  return handle;
}

absl::StatusOr<Communicator*> GroupHandle::ResolveAt(uint64_t* generation) const {
  switch (kind_) {
    case Kind::kEmpty:
      return absl::FailedPreconditionError(
          "the group handle is empty (no World group and no communicator)");
    case Kind::kFixed:
      *generation = 1;
      return fixed_;
    case Kind::kWorld:
      break;
  }
  std::shared_ptr<WorldState> state = world_.lock();
  if (state == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("group '", name_, "': its World was destroyed"));
  }
  STRATA_ASSIGN_OR_RETURN(internal::ResolvedGroup group, state->Get(name_));
  *generation = group.generation;
  return group.comm;
}

absl::StatusOr<Communicator*> GroupHandle::Resolve() const {
  uint64_t generation = 0;
  return Resolve(&generation);
}

absl::StatusOr<Communicator*> GroupHandle::Resolve(uint64_t* generation_out) const {
  uint64_t generation = 0;
  STRATA_ASSIGN_OR_RETURN(Communicator * comm, ResolveAt(&generation));
  *generation_out = generation;
  if (pinned_.has_value() && generation != pinned_->generation &&
      (comm->rank() != pinned_->rank || comm->size() != pinned_->size)) {
    return absl::FailedPreconditionError(
        absl::StrCat("group '", name_, "' was rank ", pinned_->rank, " of ", pinned_->size,
                     " at world generation ", pinned_->generation, "; at generation ", generation,
                     " this rank is rank ", comm->rank(), " of ", comm->size(), ": this ", holder_,
                     " was built for the old layout; build a new one"));
  }
  return comm;
}

absl::StatusOr<GroupHandle> GroupHandle::Pin(absl::string_view holder) const {
  // An earlier pin still holds: a handle pinned for the old layout is not
  // re-pinned to the new one.
  if (pinned_.has_value()) STRATA_RETURN_IF_ERROR(Resolve().status());
  uint64_t generation = 0;
  STRATA_ASSIGN_OR_RETURN(Communicator * comm, ResolveAt(&generation));
  GroupHandle pinned = *this;
  pinned.pinned_ = Layout{generation, comm->rank(), comm->size()};
  pinned.holder_ = std::string(holder);
  return pinned;
}

}  // namespace strata
