// Access to a strata.Group's handle from binding files other than
// comm_bindings.cc, for calls that use the group for a long time and must
// follow world rebuilds (the pipeline runner's step).
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
#include <shared_mutex>

#include "strata/parallel/group_handle.h"

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

}  // namespace strata::bindings
