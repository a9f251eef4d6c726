// strata::Store over LibTorch's c10d stores, for C++ trainers that link
// LibTorch and are launched by torchrun (or srun with MASTER_ADDR and
// MASTER_PORT): the Gloo (and NCCL) bootstrap then goes through the same
// TCPStore torchrun serves, as from Python.
//
//   absl::StatusOr<strata::LaunchEnv> env = strata::LaunchEnv::Detect();
//   strata::RootOptions root;
//   STRATA_ASSIGN_OR_RETURN(root.store, strata::torch::ConnectC10dStore(*env));
//   STRATA_ASSIGN_OR_RETURN(auto comm, strata::CreateRootCommunicator(*env, root));
//
// Part of the strata::torch target (built when LibTorch is found).
// Thread-safety: the stores returned are thread-safe (c10d's TCPStore
// serialises its requests).
#pragma once

#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "strata/base/export.h"
#include "strata/comm/launch_env.h"
#include "strata/comm/store.h"

namespace strata::torch {

// Wraps `store`. Keys strata writes are prefixed with `prefix` so they do
// not clash with torch.distributed's in a shared store; `describe` names
// the store in messages. Deadlines map to c10d's per-call wait timeouts: a
// Get or Wait past its deadline is DeadlineExceeded naming the keys; a
// connection failure is Unavailable.
STRATA_EXPORT std::shared_ptr<Store> WrapC10dStore(c10::intrusive_ptr<c10d::Store> store,
                                                   std::string describe,
                                                   std::string prefix = "strata/");

struct STRATA_EXPORT C10dStoreOptions {
  static constexpr int kVersion = 1;
  int version = kVersion;
  // How long to try reaching (or, on the serving rank, opening) the store.
  absl::Duration connect_timeout = absl::Minutes(5);
  std::string prefix = "strata/";
};

// Connects to the TCPStore at env.master_addr:env.master_port the way
// torch.distributed's env:// rendezvous does: under torchrun the agent
// serves it (TORCHELASTIC_USE_AGENT_STORE=True) and every rank is a
// client; otherwise rank 0 serves it. FailedPrecondition when the launch
// has no MASTER_ADDR/MASTER_PORT; Unavailable naming the address when the
// store cannot be reached within options.connect_timeout; InvalidArgument
// for bad options.
STRATA_EXPORT absl::StatusOr<std::shared_ptr<Store>> ConnectC10dStore(
    const LaunchEnv& env, const C10dStoreOptions& options = {});

}  // namespace strata::torch
