// World: creation, the group lookups, Rebuild and AbortAll over the shared
// state (parallel/internal/world_state.h), and GroupHandle.
#include "strata/parallel/world.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "parallel/internal/trace_dumper.h"
#include "parallel/internal/world_state.h"
#include "strata/base/settings.h"
#include "strata/base/status.h"
#include "strata/observe/flight_recorder.h"

namespace strata {

using internal::GroupName;
using internal::ParseGroupName;
using internal::WorldState;

World::World(std::shared_ptr<WorldState> state) : state_(std::move(state)) {}

World::~World() {
  tracer_.reset();  // no dumps of the teardown's aborted operations
  state_->Destroy();
}

namespace {

// The dumper's options for a World over `state` (ranks of each group from
// its mesh).
internal::TraceDumperOptions DumperOptions(const std::shared_ptr<WorldState>& state,
                                           const TraceOptions& trace, const std::string& dir) {
  internal::TraceDumperOptions o;
  o.dir = dir;
  o.world_rank = state->root()->world_rank();
  o.world_size = state->root()->size();
  o.request_poll = trace.request_poll;
  std::weak_ptr<WorldState> weak = state;
  o.group_ranks = [weak](const observe::CommRecord& comm) -> std::optional<std::vector<int>> {
    std::shared_ptr<WorldState> s = weak.lock();
    if (s == nullptr) return std::nullopt;
    const Mesh mesh = s->mesh();
    if (comm.name == "world" && comm.size == mesh.world_size()) {
      std::vector<int> all(comm.size);
      for (int i = 0; i < comm.size; ++i) all[i] = i;
      return all;
    }
    absl::StatusOr<GroupName> name = ParseGroupName(comm.name);
    if (!name.ok()) return std::nullopt;
    // The mesh is the current generation's; a communicator of an older one
    // (or of a rank renumbered by a rebuild) is caught by the check below
    // and left without members rather than given wrong ones. (The root is
    // not asked: a Rebuild may be replacing it on another thread.)
    absl::StatusOr<std::vector<int>> ranks = mesh.GroupOf(comm.world_rank, name->canonical);
    if (!ranks.ok()) ranks = mesh.ExpertGroupOf(comm.world_rank, name->canonical);
    if (!ranks.ok() || static_cast<int>(ranks->size()) != comm.size || comm.rank < 0 ||
        comm.rank >= comm.size || (*ranks)[comm.rank] != comm.world_rank) {
      return std::nullopt;
    }
    return *std::move(ranks);
  };
  return o;
}

absl::Status CheckTrace(const TraceOptions& trace) {
  if (trace.capacity < 1) {
    return absl::InvalidArgumentError(
        "TraceOptions::capacity is 0; the flight recorder keeps "
        "at least one operation (or set enabled = false)");
  }
  if (trace.request_poll <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TraceOptions::request_poll is ", absl::FormatDuration(trace.request_poll), "; want > 0"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<World>> World::Create(const LaunchEnv& env, const Mesh& mesh,
                                                     const WorldOptions& options) {
  if (options.version != WorldOptions::kVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("WorldOptions version ", options.version,
                     " is not supported (this build: ", WorldOptions::kVersion, ")"));
  }
  if (options.spares < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("WorldOptions::spares is ", options.spares, "; want >= 0"));
  }
  if (mesh.world_size() + options.spares != env.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("the mesh is for ", mesh.world_size(), " ranks",
                     options.spares > 0 ? absl::StrCat(" and ", options.spares, " spares") : "",
                     " but the job has ", env.world_size, " (", env.ToString(), ")"));
  }
  STRATA_RETURN_IF_ERROR(CheckTrace(options.trace));
  STRATA_ASSIGN_OR_RETURN(Settings settings, Settings::FromEnvironment());
  const bool trace = options.trace.enabled.value_or(settings.trace);
  const std::string dir = !options.trace.dir.empty()    ? options.trace.dir
                          : !settings.trace_dir.empty() ? settings.trace_dir
                                                        : internal::TraceDumper::DefaultDir();
  WorldOptions with_trace = options;
  // The recorder exists before the root, so that the root's first
  // operations are recorded; the dumper starts once the World has its
  // groups (an early failure is dumped then).
  std::shared_ptr<observe::FlightRecorder> recorder;
  std::shared_ptr<internal::TraceDumper::ErrorHook> hook;
  if (trace) {
    hook = std::make_shared<internal::TraceDumper::ErrorHook>();
    observe::FlightRecorderOptions ro;
    ro.capacity = options.trace.capacity;
    ro.on_error = [hook](const observe::OpRecord& r) { hook->Fire(r); };
    STRATA_ASSIGN_OR_RETURN(recorder, observe::FlightRecorder::Create(ro));
    with_trace.root.comm.sink = options.root.comm.sink == nullptr
                                    ? std::shared_ptr<observe::OpSink>(recorder)
                                    : observe::MakeFanOutSink({options.root.comm.sink, recorder});
  }
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> root,
                          CreateRootCommunicator(env, with_trace.root));
  if (options.on_root) {
    if (absl::Status s = options.on_root(*root); !s.ok()) {
      (void)root->Abort();  // its peers may drop theirs
      return s;
    }
  }
  WorldOptions rest = options;
  rest.trace.enabled = false;  // FromRoot must not look for a recorder again
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<World> world, FromRoot(std::move(root), mesh, rest));
  if (trace) {
    STRATA_ASSIGN_OR_RETURN(world->tracer_,
                            internal::TraceDumper::Start(
                                recorder, hook, DumperOptions(world->state_, options.trace, dir)));
  }
  return world;
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
  if (options.spares < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("WorldOptions::spares is ", options.spares, "; want >= 0"));
  }
  if (mesh.world_size() + options.spares != root->size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the mesh is for ", mesh.world_size(), " ranks",
                     options.spares > 0 ? absl::StrCat(" and ", options.spares, " spares") : "",
                     " but the root communicator has ", root->size()));
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
  std::unique_ptr<World> world(new World(std::move(state)));
  // A root recorded by a FlightRecorder of the caller's: dump it on
  // requests and signals.
  auto recorder = std::dynamic_pointer_cast<observe::FlightRecorder>(world->root().sink());
  if (recorder != nullptr && options.trace.enabled.value_or(true)) {
    STRATA_RETURN_IF_ERROR(CheckTrace(options.trace));
    STRATA_ASSIGN_OR_RETURN(Settings settings, Settings::FromEnvironment());
    const std::string dir = !options.trace.dir.empty()    ? options.trace.dir
                            : !settings.trace_dir.empty() ? settings.trace_dir
                                                          : internal::TraceDumper::DefaultDir();
    STRATA_ASSIGN_OR_RETURN(
        world->tracer_, internal::TraceDumper::Start(
                            recorder, nullptr, DumperOptions(world->state_, options.trace, dir)));
  }
  return world;
}

int World::rank() const { return state_->root()->rank(); }
int World::size() const { return state_->root()->size(); }
Mesh World::mesh() const { return state_->mesh(); }
Communicator& World::root() const { return *state_->root(); }
Communicator& World::job() const { return *state_->job(); }
bool World::is_spare() const { return state_->spare(); }
int World::spares() const { return state_->spares(); }
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

std::shared_ptr<observe::FlightRecorder> World::flight_recorder() const {
  return tracer_ != nullptr ? tracer_->recorder() : nullptr;
}

std::string World::trace_dir() const { return tracer_ != nullptr ? tracer_->dir() : ""; }

absl::StatusOr<std::string> World::DumpTrace(absl::string_view reason) {
  if (tracer_ == nullptr) {
    return absl::FailedPreconditionError(
        "this World has no flight recorder (STRATA_TRACE=0 or TraceOptions::enabled = false)");
  }
  return tracer_->DumpNow(reason);
}

absl::StatusOr<std::string> World::RequestTraceDump(absl::string_view reason) {
  if (tracer_ == nullptr) {
    return absl::FailedPreconditionError(
        "this World has no flight recorder (STRATA_TRACE=0 or TraceOptions::enabled = false)");
  }
  return tracer_->RequestAll(reason);
}

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
