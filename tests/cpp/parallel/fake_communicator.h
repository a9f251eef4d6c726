// FakeGroup: the ranks of one process group as threads of one process, a
// test double for unit tests of code written against strata::Communicator
// (the pipeline runner, the tensor-parallel kernels), and the in-process
// backend of the communicator conformance suite (tests/cpp/comm/conformance).
//
//   FakeGroup group(4, FakeOrdering::kInOrder);
//   std::unique_ptr<strata::Communicator> c0 = group.Comm(0);  // one per thread
//
// It implements Communicator's hooks, so Communicator's public operations
// validate, resolve deadlines and record exactly as for the real backends,
// with the same messages. Every operation is implemented: the collectives
// (reductions of every dtype but bool), send and receive, split, shrink,
// abort and revoke; an operation past its own timeout fails with
// DeadlineExceeded and marks its rank's communicator failed, when a wait or
// a test finds it (there is no progress thread).
//
// Matching follows MPI's non-overtaking rule: the k-th send from a to b
// meets the k-th receive on b from a; dtypes must agree, and a receive whose
// count differs from the message's fails as on the real backends ("received
// 4 x int32, expected 8", "larger than the buffer"). With kInOrder each
// rank's operations also progress one at a time in issue order, and a send
// and a receive complete only when both are the oldest pending operation of
// their ranks (a transport like NCCL on one stream, the strictest the
// Communicator contract allows), so code that issues operations in a wrong
// order hangs until its deadline instead of passing by luck. Data is copied
// from the sender's buffer when the pair matches, so the sender must keep it
// alive until its send completes.
//
// Collectives match by issue order (the k-th collective of every rank is
// one operation; kind, dtype, count, op and root must agree, else every
// rank gets InvalidArgument). The rank that starts it last computes it for
// all: reductions run in double in rank order and round once to the dtype,
// so results are deterministic. Under kInOrder a collective also waits
// until it is the oldest pending operation of every rank. Split is a
// collective too; Shrink meets the survivors only.
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
  // the FakeGroup object. The second form takes the communicator's options
  // (its timeout, a sink); the first uses CommOptions{name}.
  std::unique_ptr<Communicator> Comm(int rank);
  std::unique_ptr<Communicator> Comm(int rank, const CommOptions& options);

  // Send/receive pairs completed so far.
  int64_t matched() const;
  // Sends and receives posted so far, by OpOptions::stream.
  std::map<void*, int64_t> p2p_by_stream() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
  std::string name_;  // of the communicators Comm(rank) makes
};

}  // namespace strata::testing
