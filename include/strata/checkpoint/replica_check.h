// Checks, before a checkpoint is written, that the ranks holding replicas of
// a tensor hold the same tensor.
//
// A checkpoint writes each replicated box once, from one of the ranks that
// hold it (see AssignWriters in sharded_tensor.h). When the replicas are not
// equal -- a buffer that differs from rank to rank, a tensor-parallel shard
// passed without its layout -- every value but the writer's would be lost
// without a word. CheckReplicasMatch compares them first. Per group of ranks
// that hold the same replicas it issues two int64 min-allreduces: one of
// (number of tensors, digest of their keys), one of a digest per tensor
// (dtype, shape and content), each sent as (v, -v) so one collective yields
// the minimum and the maximum. Only after a mismatch does it gather records
// from the group's ranks (an all-reduce over one slot per rank) and
// broadcast key lists, to name the tensors and the ranks that differ. Then
// every rank of the save agrees on the verdict, so all fail together, with
// the same explanation, before anything is written.
//
//   std::vector<uint64_t> d = strata::ContentDigests({{w, w_bytes}}, /*threads=*/4);
//   strata::ReplicaGroup whole;
//   whole.group = world->Handle("tp-dp-cp").value();   // the ranks holding the same whole tensors
//   whole.tensors = {{"model.norm.weight", strata::DataType::kFloat32, {1024}, d[0]}};
//   strata::ReplicaCheckOptions o;
//   o.all = world->Handle("world").value();            // every rank of the save learns the verdict
//   o.deadline = absl::Now() + absl::Minutes(5);
//   STRATA_RETURN_IF_ERROR(strata::CheckReplicasMatch({whole}, o));
//
// The groups are handles (strata/parallel/group_handle.h), resolved at the
// call: GroupHandle::Fixed(comm) for a communicator without a World.
//
// Thread-safety: free functions. CheckReplicasMatch is collective over the
// communicators it is given (every rank passes its groups in the same order).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "strata/base/dtype.h"
#include "strata/base/export.h"
#include "strata/comm/communicator.h"
#include "strata/parallel/group_handle.h"

namespace strata {

// Bytes in host memory.
struct STRATA_EXPORT HostBytes {
  const void* data = nullptr;
  size_t size = 0;
};

// A 64-bit digest of each buffer's content: xxh3-64 of every 8 MiB chunk,
// the chunks hashed on up to `threads` threads, combined by xxh3-64 of the
// chunk digests seeded with the size. Equal bytes give equal digests on
// every machine; the digest is for comparing replicas, not for storage.
STRATA_EXPORT std::vector<uint64_t> ContentDigests(absl::Span<const HostBytes> buffers,
                                                   int threads);

// One tensor this rank holds as a replica.
struct STRATA_EXPORT ReplicaDigest {
  std::string key;
  DataType dtype = DataType::kFloat32;
  std::vector<int64_t> shape;  // the box this rank holds
  uint64_t content = 0;        // ContentDigests of its bytes
};

// The tensors this rank holds as replicas over `group`: every rank of it
// should hold the same keys with the same dtypes, shapes and bytes. An empty
// handle or a group of size 1 has nothing to compare.
struct STRATA_EXPORT ReplicaGroup {
  GroupHandle group;
  std::vector<ReplicaDigest> tensors;
};

struct STRATA_EXPORT ReplicaCheckOptions {
  // Version 2: `all` and ReplicaGroup::group are handles (were pointers).
  static constexpr int kVersion = 2;
  int version = kVersion;
  // Every rank of the save: after the groups' checks, all agree on the
  // verdict (one int32 min-allreduce; two broadcasts more on a failure).
  // Empty: each rank learns only its own groups' verdicts.
  GroupHandle all;
  // Every collective of the check ends by then.
  absl::Time deadline = absl::InfiniteFuture();
  // Named in messages ("checkpoint step 5: ..."); negative: not named.
  int64_t step = -1;
};

// Collective: compares each group's replicas (see the file comment).
// InvalidArgument when they differ, naming the group, up to four tensors
// that differ (key, and for each set of world ranks holding one version, its
// dtype, shape and content digest) or the keys held by some ranks and not
// others; with `all`, every rank of it returns that error (the others with
// "rank <k> checking replicas: " before it). A failed collective (deadline,
// lost peer) returns its error.
STRATA_EXPORT absl::Status CheckReplicasMatch(absl::Span<const ReplicaGroup> groups,
                                              const ReplicaCheckOptions& options);

}  // namespace strata
