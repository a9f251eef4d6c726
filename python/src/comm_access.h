// Access to a strata.Group's handle from binding files other than
// comm_bindings.cc, for calls that use the group for a long time and must
// follow world rebuilds (the pipeline runner's step); and to a strata.World
// itself, for the elastic layer that rebuilds it (WorldRef).
//
//   GroupRef ref = GroupRefOf(group);               // with the GIL held
//   {
//     py::gil_scoped_release release;
//     std::shared_lock<std::shared_mutex> lease(*ref.mu);
//     if (!ref.alive()) ...                         // the world was destroyed
//     ... ref.handle.Resolve() at each use ...
//   }
//
// While the shared lock is held, the group's world cannot be destroyed or
// rebuilt: World.destroy() and World._rebuild() wait for it.
#pragma once

#include <pybind11/pybind11.h>

#include <functional>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>

#include "strata/parallel/group_handle.h"
#include "strata/parallel/world.h"

namespace strata::bindings {

struct GroupRef {
  // Keeps the mutex (and the group's owner object) alive.
  std::shared_ptr<void> owner;
  std::shared_mutex* mu = nullptr;
  // False once the world (or the split/shrunk communicator) was destroyed.
  std::function<bool()> alive;
  // The group: (world, axes), following rebuilds, or a split/shrunk
  // communicator that `owner` holds.
  GroupHandle handle;
};

// The handle of `group`, a strata.Group or its strata._Group. Raises
// strata.InvalidArgument for another object and strata.CommError when its
// world was destroyed.
GroupRef GroupRefOf(pybind11::handle group);

// A strata.World's C++ World, for the elastic layer (elastic_bindings.cc):
//
//   WorldRef ref = WorldRefOf(world);                // with the GIL held
//   {
//     py::gil_scoped_release release;
//     std::unique_lock<std::shared_mutex> lock(*ref.mu);  // rebuilds: exclusive
//     if (ref.alive()) ... ref.world()->Rebuild(...) ...
//   }
//
// abort_all() may be called from any thread at any time without the lock
// (it never waits for an operation); after the world was destroyed it does
// nothing.
struct WorldRef {
  std::shared_ptr<void> owner;
  std::shared_mutex* mu = nullptr;
  std::function<bool()> alive;
  std::function<void()> abort_all;
  // The World; only while alive() and with `mu` held.
  std::function<World*()> world;
};

// Raises strata.InvalidArgument for an object that is no strata.World and
// strata.CommError for a destroyed one.
WorldRef WorldRefOf(pybind11::handle world);

// The WorldOptions of strata.init's arguments (besides backend, store and
// spares), and a strata._World that owns `world` (the elastic joiner's).
WorldOptions InitWorldOptions(std::optional<double> timeout, std::optional<double> group_timeout,
                              std::optional<bool> trace, std::optional<std::string> trace_dir,
                              std::optional<size_t> trace_buffer,
                              std::shared_ptr<observe::OpSink> sink);
pybind11::object WrapWorld(std::unique_ptr<World> world);

}  // namespace strata::bindings
