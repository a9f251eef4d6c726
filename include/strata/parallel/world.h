// World: the root communicator of a job and one communicator per mesh
// group this rank belongs to, reachable by axis name; rebuilt in place
// (a new generation) when ranks leave.
//
// The communication layer knows nothing of meshes; the World is where the
// two meet. It creates the root communicator through the backend factory
// (strata/comm/backend.h) and builds each group by splitting the root
// (color = group index, key = position in the group), so that a group's
// ranks are numbered in the mesh's group order.
//
//   absl::StatusOr<strata::LaunchEnv> env = strata::LaunchEnv::Detect();
//   strata::MeshSpec spec;
//   spec.world_size = env->world_size; spec.tp = 2; spec.pp = 2;
//   absl::StatusOr<strata::Mesh> mesh = strata::Mesh::Create(spec);
//   absl::StatusOr<std::unique_ptr<strata::World>> world =
//       strata::World::Create(*env, *mesh, strata::WorldOptions{});
//   absl::StatusOr<strata::Communicator*> tp = (*world)->Group("tp");
//   (*tp)->AllReduce(buf, buf, strata::ReduceOp::kSum);
//   absl::StatusOr<strata::GroupHandle> dp = (*world)->Handle("dp");  // for holders
//   world->reset();   // tears everything down; Create may run again
//
// Groups. Every combination of the mesh's axes is a group: dense, any of
// tp, dp, cp, pp ("tp-dp" is Megatron-Core's tensor-and-data-parallel
// group); expert, any of etp (expert tensor-parallel), ep, edp (expert
// data-parallel) and pp. Dense and expert axes do not mix; "pp" alone is the
// dense pp group. With "world" (the root) that is 30 names (AllGroupNames).
// A combination may be written in any order; its canonical spelling lists
// the axes as "tp-dp-cp-pp" and "etp-ep-edp-pp" do ("cp-dp" is "dp-cp").
//   - Standard groups are created with the World (and at every Rebuild), in
//     this order: tp, cp, dp, pp, dp-cp, tp-pp, tp-dp-cp, ep, etp, edp,
//     etp-ep.
//   - Every other group is created on first request (Group or Handle), as
//     torch.distributed.new_group creates one: collectively over the whole
//     world. Every rank must request the same new group at the same point
//     of its sequence of creations. The ranks first check that they agree
//     (host roots: an allreduce of the name's hash; device roots, where
//     collectives need device memory: a probe split colored by the hash);
//     ranks asking for different groups get InvalidArgument naming what
//     this rank asked for (and, on host roots, which ranks asked for what);
//     a rank that never asks makes the others fail with DeadlineExceeded
//     naming the group after WorldOptions::group_creation_timeout. After
//     such a failure the root may be unusable (MPI cannot withdraw a
//     collective): rebuild or destroy the World.
//   - Groups whose members are the same (e.g. "dp" and "dp-cp" when
//     cp = 1) share one communicator; no collective is needed for the
//     second. Each name still gets its own Communicator object that reports
//     that name in name() and in the messages of its operations and their
//     errors, so a group always says what it was asked as.
//
// Generations. A World starts at generation 1. Rebuild() replaces the root
// and the mesh in place (after the elastic layer has revoked the old root
// and shrunk it into a new one): it aborts and destroys every communicator
// of the old generation, creates the standard groups of the new mesh and
// increments the generation. Work of the old generation stays safe to wait
// on and fails with Aborted. Pointers from Group() and root() are valid
// until the next Rebuild or the World's destruction; code that outlives a
// rebuild holds a GroupHandle (group_handle.h), which resolves the current
// generation's communicator at each use.
//
// Spares. A job may have more processes than the mesh: the first
// mesh.world_size() ranks of the job communicator form the mesh, the last
// WorldOptions::spares stand by. A spare's World has no group (Group and
// Handle fail with FailedPrecondition saying so); its root() is the job
// communicator. Creation (and Rebuild) is collective over the whole job,
// spares included; a Rebuild whose new job communicator puts a spare among
// the first mesh.world_size() ranks makes it a member. job() is what the
// elastic layer shrinks.
//
// Thread-safety: lookups of existing groups (Group, Handle, GroupHandle::
// Resolve), generation(), status(), mesh() and AbortAll() may be called from
// any thread at any time; none of them waits for a collective. Creating a
// group is collective: at most one creation runs at a time per process (a
// second thread's creation waits for the first), every rank must create
// the same groups in the same order, and no other thread may run
// collectives on the root ("world") meanwhile, since the creation does. Rebuild, and destroying the
// World, must not run while other threads use communicators they resolved; AbortAll() is how
// another thread stops them first. The communicators follow Communicator's rules.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "strata/base/export.h"
#include "strata/comm/backend.h"
#include "strata/comm/communicator.h"
#include "strata/comm/launch_env.h"
#include "strata/parallel/group_handle.h"
#include "strata/parallel/mesh.h"

namespace strata {

namespace observe {
class FlightRecorder;
}
namespace internal {
class TraceDumper;
}

// The World's flight recorder (strata/observe/flight_recorder.h; see
// docs/observability.md). On by default: every operation of every group
// is kept in a ring of the last `capacity`, and each rank writes the ring
// to `dir` as strata_trace_rank_<rank>.json when one of its operations
// fails (a deadline, a backend error), on SIGUSR1, when asked by
// World::DumpTrace, or when another rank asks every rank
// (World::RequestTraceDump; a failing rank and SIGUSR1 also ask). Ranks
// meet for the requests through a file store in `dir`, so the ranks of a
// job on several hosts need `dir` on a filesystem they all see.
struct STRATA_EXPORT TraceOptions {
  // Unset: $STRATA_TRACE (default on).
  std::optional<bool> enabled;
  // "": $STRATA_TRACE_DIR, else strata-trace-<job id> under $TMPDIR (else
  // /tmp), the job id read from the launcher (Open MPI's namespace,
  // torchrun's run id, Slurm's job and step).
  std::string dir;
  // Operations kept per rank (PyTorch's default: 2000).
  size_t capacity = 2000;
  // How often each rank looks for another rank's request to dump (one
  // small file read).
  absl::Duration request_poll = absl::Seconds(1);
};

struct STRATA_EXPORT WorldOptions {
  // Version 2 removed `extra_groups` (every combination is created on first
  // request) and added `group_creation_timeout`; version 3 added `trace`;
  // version 4 added `spares`; version 5 added `on_root`.
  static constexpr int kVersion = 5;
  int version = kVersion;
  // Root communicator: backend ("auto", "mpi"), default operation timeout
  // (which also bounds the creation of every group), backend settings.
  RootOptions root;
  // How long the ranks wait for each other when a group is created on first
  // request: past it, DeadlineExceeded naming the group. Zero means the
  // root's operation timeout (root.comm.timeout).
  absl::Duration group_creation_timeout = absl::ZeroDuration();
  // The flight recorder (Create only: a root given to FromRoot is recorded
  // when its CommOptions::sink is a FlightRecorder, which is then used).
  TraceOptions trace;
  // Hot spares: the job has the mesh's ranks plus this many, which stand
  // by in no group (see "Spares" above) until strata::elastic places one
  // where a member failed.
  int spares = 0;
  // Create only: called once the root communicator exists, before any
  // group is made (what must happen between the two on every rank: the
  // elastic layer's joiner votes there, as the members do after their
  // rendezvous). An error ends the creation with it.
  std::function<absl::Status(Communicator& root)> on_root;
};

class STRATA_EXPORT World {
 public:
  // Creates the root communicator from `env` and the standard groups of
  // `mesh`. Collective over the job. InvalidArgument when the mesh's world
  // size plus the spares is not the job's.
  static absl::StatusOr<std::unique_ptr<World>> Create(const LaunchEnv& env, const Mesh& mesh,
                                                       const WorldOptions& options);
  // The same over an existing root communicator (any backend), which the
  // World takes over.
  static absl::StatusOr<std::unique_ptr<World>> FromRoot(std::unique_ptr<Communicator> root,
                                                         const Mesh& mesh,
                                                         const WorldOptions& options);

  // Destroys the group communicators, then the root (joining the backend's
  // threads). Operations still in flight fail with Aborted; handles on this
  // World fail with FailedPrecondition.
  ~World();
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  // This rank in the root communicator, and its size (current generation).
  int rank() const;
  int size() const;
  // Every process of the job: the root plus the spares (the root itself
  // when there are none). Valid until Rebuild.
  Communicator& job() const;
  // Whether this rank stands by outside the mesh, and how many do.
  bool is_spare() const;
  int spares() const;
  // The mesh of the current generation.
  Mesh mesh() const;
  // The root communicator of the current generation (valid until Rebuild).
  Communicator& root() const;
  // 1 at creation; +1 at every Rebuild that got past its argument checks,
  // whether it succeeded or not.
  uint64_t generation() const;
  // OK while usable; after a failed Rebuild, why not (every Group and
  // Resolve fails with FailedPrecondition saying so until a Rebuild
  // succeeds).
  absl::Status status() const;

  // The communicator of this rank's group of `axes` ("tp", "dp-cp", "ep",
  // "world" for the root), created on first request (collective: see the
  // header comment). InvalidArgument for a name that is no combination of
  // axes. Valid until the next Rebuild or the World's destruction.
  absl::StatusOr<Communicator*> Group(absl::string_view axes);
  // A handle on the group of `axes` that follows rebuilds (group_handle.h);
  // creates the group as Group() does.
  absl::StatusOr<GroupHandle> Handle(absl::string_view axes);
  // The names of the groups that exist in this generation, in creation
  // order (canonical spellings, without "world").
  std::vector<std::string> GroupNames() const;
  // Every name Group() accepts, canonical: "world", the 15 dense and the 14
  // expert combinations (expert "pp" is the dense one).
  static std::vector<std::string> AllGroupNames();
  // The canonical spelling of a group name ("cp-dp" -> "dp-cp");
  // InvalidArgument names what is wrong with it.
  static absl::StatusOr<std::string> CanonicalGroupName(absl::string_view axes);

  // Replaces the root and the mesh in place: aborts every communicator of
  // the current generation (Work in flight fails with Aborted), destroys
  // them, then creates the standard groups of `new_mesh` over `new_root`
  // and increments the generation. Collective over `new_root` (every
  // survivor calls it); the caller has revoked or aborted the old root and
  // made `new_root` from it (Shrink). `new_root` may be larger than the
  // mesh: its last ranks are then spares (see "Spares"). InvalidArgument
  // (the World unchanged) when `new_root` is null or smaller than the mesh; on a later
  // failure the World is left broken at the new generation (status() says
  // why; a later Rebuild may repair it), never half built.
  absl::Status Rebuild(std::unique_ptr<Communicator> new_root, const Mesh& new_mesh);

  // Aborts the root and every group communicator of the current generation
  // (and the new root while a Rebuild is running), so that every pending
  // and later operation fails at once. From any thread; returns in bounded
  // time (it never waits for a collective). Rebuild repairs the World.
  void AbortAll();

  // ---- flight recorder (TraceOptions) ----

  // The recorder of this World's operations; null when off.
  std::shared_ptr<observe::FlightRecorder> flight_recorder() const;
  // Where this rank writes its dumps ("" when the recorder is off).
  std::string trace_dir() const;
  // Writes this rank's dump now; returns its path. FailedPrecondition when
  // the recorder is off; Unavailable when the file cannot be written.
  absl::StatusOr<std::string> DumpTrace(absl::string_view reason = "called");
  // Asks every rank of the job to dump (through the store in trace_dir();
  // each rank sees the request within TraceOptions::request_poll) and
  // dumps this rank; returns this rank's path. Not collective: any rank may
  // call it, e.g. rank 0 when it sees a step hang.
  absl::StatusOr<std::string> RequestTraceDump(absl::string_view reason = "asked");

 private:
  explicit World(std::shared_ptr<internal::WorldState> state);

  std::shared_ptr<internal::WorldState> state_;
  // Declared last: stopped (its thread joined) before the groups go.
  std::unique_ptr<internal::TraceDumper> tracer_;
};

}  // namespace strata
