// GroupHandle: how code that uses a process group holds it, so that it
// follows a rebuild of the World instead of keeping a Communicator* that
// dangles.
//
// A handle is either a (World, axes) pair, made by World::Handle, or a fixed
// communicator, for code that has no World (a Split or Shrink result, a test
// double). Resolve() gives the communicator of the World's current
// generation at each use:
//
//   absl::StatusOr<strata::GroupHandle> tp = world->Handle("tp");
//   ...
//   STRATA_ASSIGN_OR_RETURN(strata::Communicator* comm, tp->Resolve());  // at each use
//   STRATA_ASSIGN_OR_RETURN(auto work, comm->AllReduce(buf, buf, strata::ReduceOp::kSum));
//
// A holder whose state is laid out for one rank and size of its group (a
// tensor-parallel layer's shards, a pipeline runner's schedule) pins the
// handle: Pin() records this rank's rank and the group's size now, and a
// later Resolve fails with FailedPrecondition when a rebuild changed either,
// naming both generations and both layouts:
//
//   group 'pp' was rank 1 of 2 at world generation 1; at generation 2 this
//   rank is rank 0 of 3: this pipeline runner was built for the old layout;
//   build a new one
//
// A rebuild that keeps the layout (other replicas left) is followed. A
// handle whose World was destroyed, or whose World's last rebuild failed,
// fails clearly; an empty (default-constructed) handle fails too.
//
// The pointer Resolve returns is valid until the World is rebuilt or
// destroyed (for a fixed handle: as long as that communicator lives), so
// resolve again at each use rather than keeping it.
//
// Thread-safety: a GroupHandle is immutable; copies are cheap and Resolve
// may be called from any thread. Resolve of a (World, axes) handle whose
// group does not exist in the current generation (a non-standard group after
// a rebuild) creates it, which is collective over the world: see world.h.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "strata/base/export.h"
#include "strata/comm/communicator.h"

namespace strata {

namespace internal {
class WorldState;
}  // namespace internal

// What Resolve does when a rebuild changed this rank's rank in the group or
// the group's size.
enum class LayoutChange : uint8_t {
  // Resolve gives the current generation's group, whatever its layout.
  kFollow,
  // Resolve fails with FailedPrecondition (see Pin).
  kRefuse,
};

class STRATA_EXPORT GroupHandle {
 public:
  // This rank's position in a group at one world generation.
  struct Layout {
    uint64_t generation = 0;
    int rank = 0;
    int size = 0;
  };

  // An empty handle: Resolve fails with FailedPrecondition.
  GroupHandle();
  // A handle on `comm`, which the caller keeps alive while the handle is
  // used (not owned). For code without a World: a Split or Shrink result,
  // a test double. A null `comm` gives a handle whose Resolve fails.
  static GroupHandle Fixed(Communicator* comm);

  // The communicator of the group now: the World's current generation, or
  // the fixed communicator. FailedPrecondition when the handle is empty,
  // its World was destroyed or failed to rebuild, or the layout changed
  // under a pinned handle; a creation's error when the group had to be
  // created (see world.h).
  absl::StatusOr<Communicator*> Resolve() const;
  // Resolve, also giving the World generation the communicator belongs to
  // (1 for a fixed handle): for a holder that derives state from the
  // communicator (a communicator split off it) and must redo that when the
  // generation changes.
  absl::StatusOr<Communicator*> Resolve(uint64_t* generation) const;

  // A copy that refuses layout changes (LayoutChange::kRefuse): resolves
  // the group now and records this rank's rank, the group's size and the
  // World's generation; `holder` ("pipeline runner") names what was built
  // for that layout in Resolve's error.
  absl::StatusOr<GroupHandle> Pin(absl::string_view holder) const;

  // The group's name: the canonical axes the handle was made for ("dp-cp"
  // for "cp-dp", "world"), or the fixed communicator's name ("" if empty).
  const std::string& name() const { return name_; }
  // True for a (World, axes) handle.
  bool has_world() const { return kind_ == Kind::kWorld; }
  bool empty() const { return kind_ == Kind::kEmpty; }
  LayoutChange layout_change() const {
    return pinned_.has_value() ? LayoutChange::kRefuse : LayoutChange::kFollow;
  }
  // The layout recorded by Pin, if pinned.
  const std::optional<Layout>& pinned() const { return pinned_; }

 private:
  friend class World;
  enum class Kind : uint8_t { kEmpty, kWorld, kFixed };

  // Resolves and returns the generation it resolved at (1 for fixed).
  absl::StatusOr<Communicator*> ResolveAt(uint64_t* generation) const;

  Kind kind_ = Kind::kEmpty;
  std::string name_;
  std::weak_ptr<internal::WorldState> world_;
  Communicator* fixed_ = nullptr;
  std::optional<Layout> pinned_;
  std::string holder_;
};

}  // namespace strata
