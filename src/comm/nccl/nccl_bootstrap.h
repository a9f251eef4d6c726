// How the ranks of a new NCCL root communicator agree on its unique ids.
//
// NCCL needs every rank to hold the same ncclUniqueId(s) before
// ncclCommInitRankConfig / ncclCommInitRankScalable. With a Store (torchrun,
// srun with MASTER_ADDR/MASTER_PORT), the owner of each id publishes it and
// everyone else reads it: O(ids) store operations per rank, no O(N^2)
// traffic, and with more than NcclOptions::ranks_per_unique_id ranks several
// ids spread NCCL's own bootstrap over several roots. Under mpirun the ids
// are broadcast over MPI instead.
//
// Thread-safety: pure functions over the store (itself thread-safe).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "strata/comm/backend.h"
#include "strata/comm/store.h"

namespace strata::nccl {

// How many unique ids a job of `world_size` ranks uses: one per
// `ranks_per_id` ranks (rounded up) when the NCCL in use has
// ncclCommInitRankScalable, else one. InvalidArgument when ranks_per_id < 1.
absl::StatusOr<int> UniqueIdCount(int world_size, int ranks_per_id, bool scalable_init);

// The rank that creates id `index` of `count`: spread evenly over the job.
int UniqueIdOwner(int index, int count, int world_size);

// Every rank calls this with the same `world_size` and `count`. The owners
// of the ids call `make_id` (ncclGetUniqueId) and publish the result under
// a key unique to this initialisation (a generation counter in the store,
// so a job may create several roots through one store); the rest read them.
// Returns the `count` ids in order. DeadlineExceeded names the rank, the
// missing key and the store when an owner never published.
absl::StatusOr<std::vector<std::string>> ExchangeUniqueIds(
    Store& store, int rank, int world_size, int count,
    const std::function<absl::StatusOr<std::string>()>& make_id, absl::Time deadline);

// Under mpirun: rank 0 calls `make_id` `count` times and broadcasts the ids
// over a temporary MPI communicator (one broadcast of count * 128 bytes).
// FailedPrecondition in a build without MPI (saying to use a store).
absl::StatusOr<std::vector<std::string>> UniqueIdsOverMpi(
    const LaunchEnv& env, const RootOptions& options, int count,
    const std::function<absl::StatusOr<std::string>()>& make_id);

}  // namespace strata::nccl
