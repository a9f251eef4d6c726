// The argument checks of Communicator's public operations (communicator.cc
// runs them before any backend's hook), and the descriptions that name an
// operation in messages. Backend-neutral and in one place, so every backend
// rejects the same misuse with the same words.
//
//   GroupInfo g{"tp", /*rank=*/1, /*size=*/2, /*world_rank=*/3};
//   STRATA_RETURN_IF_ERROR(ValidateAllReduce(g, send, recv, op, caps));
//   std::string what = DescribeOp("allreduce", ReduceOpName(op), recv);
//   // "allreduce(sum, 1048576 x fp32)"
//   std::string where = DescribeGroup(g);
//   // "group tp (rank 1 of 2, world rank 3)"
//
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "strata/comm/communicator.h"

namespace strata::comm_internal {

// Who is calling, for messages.
struct GroupInfo {
  absl::string_view name;
  int rank = 0;
  int size = 1;
  int world_rank = 0;
};

// What a backend can do with each dtype (declared by the backend, checked
// by Communicator's public operations).
using Capabilities = CommCapabilities;

// "group tp (rank 1 of 2, world rank 3)".
std::string DescribeGroup(const GroupInfo& group);
// "allreduce(sum, 1048576 x fp32)"; `detail` may be empty ("barrier()").
std::string DescribeOp(absl::string_view op, absl::string_view detail, const ConstBuffer& buffer);
std::string DescribeOp(absl::string_view op, absl::string_view detail);

// InvalidArgument naming the value when `dtype` is outside the enum.
absl::Status CheckDataType(DataType dtype);
// InvalidArgument when the byte size of `count` elements of `dtype`
// overflows, or when `data` is null with a nonzero count. `which` names the
// buffer ("send buffer").
absl::Status CheckBuffer(absl::string_view which, const void* data, size_t count, DataType dtype);
// InvalidArgument when `op` is outside the enum or is avg on an integer
// dtype.
absl::Status CheckReduceOp(ReduceOp op, DataType dtype);

// `count` times `factor` without overflow, or InvalidArgument naming both.
absl::Status CheckedMultiply(size_t count, size_t factor, absl::string_view what, size_t* out);

// True when the byte ranges of two buffers overlap.
bool Overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes);

// The checks of each operation. Each error names the operation, the group
// and the values. `caps` says which dtypes the backend supports.
absl::Status ValidateAllReduce(const GroupInfo& g, const ConstBuffer& send, const Buffer& recv,
                               ReduceOp op, const Capabilities& caps);
absl::Status ValidateBroadcast(const GroupInfo& g, const Buffer& buffer, int root,
                               const Capabilities& caps);
absl::Status ValidateReduce(const GroupInfo& g, const ConstBuffer& send, const Buffer& recv,
                            ReduceOp op, int root, const Capabilities& caps);
absl::Status ValidateAllGather(const GroupInfo& g, const ConstBuffer& send, const Buffer& recv,
                               const Capabilities& caps);
absl::Status ValidateReduceScatter(const GroupInfo& g, const ConstBuffer& send, const Buffer& recv,
                                   ReduceOp op, const Capabilities& caps);
absl::Status ValidateAllToAll(const GroupInfo& g, const ConstBuffer& send, const Buffer& recv,
                              const Capabilities& caps);
absl::Status ValidateAllToAllV(const GroupInfo& g, const ConstBuffer& send, const Buffer& recv,
                               const AllToAllCounts& counts, const Capabilities& caps);
absl::Status ValidatePeer(const GroupInfo& g, absl::string_view op, const ConstBuffer& buffer,
                          int peer, const Capabilities& caps);
// The excluded ranks of a Shrink: each in range and listed once, and not
// every rank.
absl::Status ValidateExcluded(const GroupInfo& g, absl::Span<const int> excluded);
// InvalidArgument for a bad version, a non-positive timeout or an empty
// name of a new communicator: CreateRootCommunicator checks a root's,
// Communicator::Split and Shrink their children's.
absl::Status CheckCommOptions(const CommOptions& options);

}  // namespace strata::comm_internal
