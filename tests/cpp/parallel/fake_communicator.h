// FakeGroup: the ranks of one process group as threads of one process, a
// test double for unit tests of code written against strata::Communicator
// (the pipeline runner, the tensor-parallel kernels). Point-to-point
// operations, AllReduce, AllGather, ReduceScatter, Broadcast, Barrier,
// Revoke and Abort are implemented; Reduce, all-to-all, Split and Shrink
// return Unimplemented.
//
//   FakeGroup group(4, FakeOrdering::kInOrder);
//   std::unique_ptr<strata::Communicator> c0 = group.Comm(0);  // one per thread
//
// Matching follows MPI's non-overtaking rule: the k-th send from a to b
// meets the k-th receive on b from a; counts and dtypes must agree. With
// kInOrder each rank's operations also progress one at a time in issue
// order, and a send and a receive complete only when both are the oldest
// pending operation of their ranks (a transport like NCCL on one stream, the
// strictest the Communicator contract allows), so code that issues
// operations in a wrong order hangs until its deadline instead of passing by
// luck. Data is copied from the sender's buffer when the pair matches, so
// the sender must keep it alive until its send completes.
//
// Collectives match by issue order (the k-th collective of every rank is
// one operation; kind, dtype, count, op and root must agree, else every
// rank gets InvalidArgument). The rank that starts it last computes it for
// all: reductions run in double in rank order and round once to the dtype
// (fp32, fp64, fp16, bf16, int32, int64), so results are deterministic.
// Under kInOrder a collective also waits until it is the oldest pending
// operation of every rank.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "strata/comm/communicator.h"

namespace strata::testing {

enum class FakeOrdering { kMatchPosted, kInOrder };

class FakeGroup {
 public:
  // `memory` is what the communicators report (the data is always host
  // memory; kCuda only tests code that checks it).
  FakeGroup(int size, FakeOrdering ordering, std::string name = "pp",
            MemoryKind memory = MemoryKind::kHost);
  ~FakeGroup();

  // The communicator of `rank`; it shares the group's state and may outlive
  // the FakeGroup object.
  std::unique_ptr<Communicator> Comm(int rank);

  // Send/receive pairs completed so far.
  int64_t matched() const;
  // Sends and receives posted so far, by OpOptions::stream.
  std::map<void*, int64_t> p2p_by_stream() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace strata::testing
