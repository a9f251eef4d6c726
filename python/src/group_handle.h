// Access from any binding file to the C++ communicator behind a Python
// strata.Group (python/strata/comm.py) or its raw _Group, so areas that run
// collectives in C++ (topology consistency, checkpoints) take the group the
// user already has. Code that holds a group across world rebuilds takes a
// GroupRef (comm_access.h) instead.
#pragma once

#include <pybind11/pybind11.h>

#include "strata/comm/communicator.h"

namespace strata::bindings {

// The communicator of `group` (a strata.Group or a _Group) in its world's
// current generation. Raises strata.InvalidArgument for another object and
// strata.CommError when the group's world was destroyed (or cannot give the
// group). The reference is valid while `group` is alive and its world is
// neither rebuilt nor destroyed.
Communicator& GroupCommunicator(pybind11::handle group);

}  // namespace strata::bindings
