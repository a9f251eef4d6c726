// Communicator: one process group's collectives and point-to-point
// operations, on one backend (MPI for host memory, NCCL for device memory,
// Gloo for host memory bootstrapped from a store).
//
// Every operation is asynchronous: it validates its arguments, starts, and
// returns a Work to wait on. Operations issued on one communicator complete
// in the order they were issued; several may be in flight at once, also on
// different communicators.
//
//   std::vector<float> x(n, 1.0f);
//   strata::Buffer buf = strata::Buffer::Of(x.data(), x.size());
//   absl::StatusOr<std::unique_ptr<strata::Work>> work =
//       comm.AllReduce(buf, buf, strata::ReduceOp::kSum);       // in place
//   if (!work.ok()) return work.status();                      // misuse, named
//   STRATA_RETURN_IF_ERROR((*work)->Wait(absl::Now() + absl::Seconds(30)));
//
// Structure: the rules of the interface live once, in this class. Its
// public operations are not virtual; each one
//   1. validates its arguments against the rules below and the dtypes the
//      backend declared it can move and reduce (CommCapabilities),
//   2. resolves its options once: the absolute deadline (a zero timeout
//      means the communicator's default), the stream, the description that
//      names the operation, the group and this rank in every message,
//   3. numbers the operation (collectives and point-to-point operations
//      separately, as PyTorch's flight recorder does) and, when
//      CommOptions::sink is set, records it (strata/observe/op_record.h),
//   4. calls the backend's protected hook (DoAllReduce, DoSend, ...), which
//      holds only what is the backend's own: starting the operation on its
//      engine and reporting its start and completion to the record.
// Split and Shrink check the new communicator's options; Shrink also
// checks the excluded ranks and lets only the survivors reach the backend.
// Backends (src/comm/mpi, gloo, nccl) and test doubles implement the hooks
// and so obey the same rules, with the same messages
// (tests/cpp/comm/conformance holds the suite every backend passes).
//
// Misuse detected locally (a null buffer with a nonzero count, a count that
// overflows, mismatched counts or dtypes, a peer or root out of range, a
// dtype or op the backend cannot reduce, a negative timeout) is an
// InvalidArgument error from the call itself, naming the values. Failures
// after the start (a peer lost, a deadline passed, the communicator aborted
// or revoked) come from Work::Wait / Work::Test, and name the rank, the
// group and the operation.
//
// Fault handling is part of the interface, for the elastic layer: Abort()
// returns in bounded time and fails every pending Work; Revoke() makes every
// rank's pending and future operations on this communicator fail; Shrink()
// builds a new communicator without the excluded (failed or evicted) ranks.
// A backend or library version that cannot do one returns Unimplemented or
// FailedPrecondition saying why, never a silent no-op.
//
// Thread-safety: a Communicator may be used from several threads, but as in
// MPI and NCCL, every rank must issue the same collectives on it in the same
// order (operations issued concurrently from several threads get their
// sequence numbers in the order they reach the communicator). Abort() and
// AsyncError() may be called from any thread at any time. The hooks may be
// called concurrently; each backend serialises what must be.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "strata/base/dtype.h"
#include "strata/base/export.h"
#include "strata/observe/op_record.h"

namespace strata {

enum class ReduceOp : uint8_t { kSum, kProd, kMin, kMax, kAvg };

// The payload key (absl::Status::GetPayload) a backend sets on an error
// caused by a failed peer rank. Its value lists the failed ranks of the
// group, comma-separated ("2,5"), or is empty when the backend cannot tell.
// The Python layer raises strata.RankFailure for such errors.
inline constexpr char kRankFailurePayload[] = "strata/rank-failure";

// The payload key a backend sets on the error of a regroup (a root's
// creation, Split, Shrink) that went through the store's rendezvous and
// then gave up waiting for a peer to connect: its value is that peer's rank
// in the communicator the call was made on (decimal). The peer was alive
// enough to publish its address; it died since, or the network between it
// and this rank does not carry (a partition the store does not see).
inline constexpr char kUnreachablePayload[] = "strata/unreachable";

// "sum", "prod", "min", "max", "avg".
STRATA_EXPORT const char* ReduceOpName(ReduceOp op);
// Parses the names above. InvalidArgument names the unknown string.
STRATA_EXPORT absl::StatusOr<ReduceOp> ParseReduceOp(absl::string_view name);

// Where a communicator's buffers live.
enum class MemoryKind : uint8_t { kHost, kCuda };

// A contiguous typed buffer (count elements of dtype) in the communicator's
// memory. Not owning.
struct STRATA_EXPORT Buffer {
  void* data = nullptr;
  size_t count = 0;
  DataType dtype = DataType::kFloat32;

  template <typename T>
  static Buffer Of(T* data, size_t count);
};

// A read-only buffer; every Buffer converts to one.
struct STRATA_EXPORT ConstBuffer {
  const void* data = nullptr;
  size_t count = 0;
  DataType dtype = DataType::kFloat32;

  ConstBuffer() = default;
  ConstBuffer(const void* d, size_t c, DataType t) : data(d), count(c), dtype(t) {}
  ConstBuffer(const Buffer& b) : data(b.data), count(b.count), dtype(b.dtype) {}  // NOLINT
};

// Options every operation takes.
struct STRATA_EXPORT OpOptions {
  // How long the operation may take before it fails with DeadlineExceeded
  // (and the communicator is marked failed). Zero means the communicator's
  // default (CommOptions::timeout).
  absl::Duration timeout = absl::ZeroDuration();
  // The CUDA stream (cudaStream_t) to order the operation on, for device
  // backends; null means the communicator's stream. Host backends ignore it.
  void* stream = nullptr;
};

// Options of a new communicator (root, split, or shrunk).
struct STRATA_EXPORT CommOptions {
  static constexpr int kVersion = 1;
  int version = kVersion;
  // Name used in messages and logs: "world", "tp", "dp-cp", ...
  std::string name = "world";
  // Default time limit of each operation.
  absl::Duration timeout = absl::Minutes(10);
  // Where the records of this communicator's operations go
  // (strata/observe/op_record.h): a flight recorder, metrics. Null: none,
  // and recording costs nothing. Communicators split or shrunk from this
  // one inherit it unless their own options name another. The
  // communicator and its in-flight operations share its ownership.
  std::shared_ptr<observe::OpSink> sink;
  // Shrink only: how long the backend may wait for the excluded ranks to
  // be reported failed (they died, were killed, or are exiting) so that it
  // can build the new communicator the way its fault tolerance is meant to
  // be used (MPI under ULFM: MPIX_Comm_shrink). Past it, or with zero (the
  // default: excluded ranks may stay alive), it builds the communicator
  // among the survivors alone. strata.elastic sets it: the ranks it
  // excludes are dead, fenced or leaving.
  absl::Duration excluded_exit_wait = absl::ZeroDuration();
};

// What a backend can do with each dtype, declared once by the backend; the
// operations reject the rest with InvalidArgument ("dtype bool cannot be
// reduced by this backend").
struct STRATA_EXPORT CommCapabilities {
  // True when `dtype` can be moved (broadcast, gather, all-to-all, p2p).
  bool (*can_move)(DataType dtype) = nullptr;
  // True when `dtype` can be reduced with sum/prod/min/max (avg also needs
  // a floating-point dtype).
  bool (*can_reduce)(DataType dtype) = nullptr;
};

// Counts for AllToAllV: send_counts[i] elements go to rank i, recv_counts[i]
// come from rank i, each block contiguous in rank order.
struct STRATA_EXPORT AllToAllCounts {
  std::vector<size_t> send_counts;
  std::vector<size_t> recv_counts;
};

// One started operation.
//
// Thread-safety: Wait and Test may be called from one thread at a time.
class STRATA_EXPORT Work {
 public:
  virtual ~Work() = default;

  // Blocks until the operation completes, fails, or `deadline` passes.
  // DeadlineExceeded (naming rank, group and operation) if the deadline
  // passes first; the operation is then still in flight and may be waited
  // for again. Idempotent after completion. The time the caller spent
  // blocked here goes to the operation's record (OpSink::OnWaited), so
  // compute time can be told from time waiting for peers.
  absl::Status Wait(absl::Time deadline = absl::InfiniteFuture());
  // True when the operation has completed successfully, false while it is in
  // flight; the operation's error when it failed.
  virtual absl::StatusOr<bool> Test() = 0;
  // "allreduce(sum, 1048576 x fp32) on group tp (rank 1 of 2, world rank 3)".
  virtual std::string Describe() const = 0;

  // For the owner of an operation's buffers once the communicator that
  // started it was destroyed (with the operation failed or abandoned): keeps
  // `holder` (what keeps the buffers alive) as long as the backend may still
  // read or write them, then releases it, on whatever thread lets go last.
  // Backends whose destruction ends every use of the buffers (their threads
  // joined, their streams synchronised: Gloo, NCCL, the test doubles)
  // release it at once, which this default does. MPI cannot cancel a
  // collective: an operation whose requests are still pending keeps it
  // until MPI completes them or the process exits.
  virtual void KeepBuffersAlive(std::shared_ptr<void> holder) { holder.reset(); }

  // The communicator's record of this operation (null: nothing recorded).
  void AttachTrace(std::shared_ptr<observe::OpTrace> trace) { trace_ = std::move(trace); }

 protected:
  // The backend's wait (see Wait).
  virtual absl::Status DoWait(absl::Time deadline) = 0;

 private:
  std::shared_ptr<observe::OpTrace> trace_;
};

class STRATA_EXPORT Communicator {
 public:
  virtual ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // This process's rank in the group, and the group's size.
  int rank() const { return rank_; }
  int size() const { return size_; }
  // The group's name (CommOptions::name) and this process's world rank, for
  // messages.
  const std::string& name() const { return name_; }
  int world_rank() const { return world_rank_; }
  // "mpi", "nccl" or "gloo".
  virtual absl::string_view backend() const = 0;
  // How collectives and send/recv move data, for reports: the backend's
  // name, or for gloo "gloo, host copies" (the ranks share a host and copy
  // between each other's buffers) or "gloo, tcp" (Gloo's transport).
  virtual std::string transport() const { return std::string(backend()); }
  virtual MemoryKind memory() const = 0;
  // True when a posted receive or send progresses on its own, whatever was
  // issued before it on this rank (MPI, Gloo): code may post a receive,
  // issue sends, and only then wait for the receive. False (the default)
  // for transports that run a rank's operations in issue order (NCCL on one
  // stream), where a receive waited for after later sends must be posted
  // before them and nothing issued in between may depend on it.
  virtual bool progresses_independently() const { return false; }
  // The dtypes this backend moves and reduces.
  const CommCapabilities& capabilities() const { return capabilities_; }
  // The default time limit of an operation (CommOptions::timeout).
  absl::Duration timeout() const { return timeout_; }
  // Where this communicator's operations are recorded (CommOptions::sink);
  // null when nowhere.
  const std::shared_ptr<observe::OpSink>& sink() const { return sink_; }

  // ---- collectives (in place when send.data == recv.data) ----------------
  // recv = op over ranks of send; counts and dtypes must match.
  absl::StatusOr<std::unique_ptr<Work>> AllReduce(ConstBuffer send, Buffer recv, ReduceOp op,
                                                  const OpOptions& options = {});
  // buffer on every rank = buffer on `root`.
  absl::StatusOr<std::unique_ptr<Work>> Broadcast(Buffer buffer, int root,
                                                  const OpOptions& options = {});
  // recv on `root` = op over ranks of send; recv is ignored elsewhere.
  absl::StatusOr<std::unique_ptr<Work>> Reduce(ConstBuffer send, Buffer recv, ReduceOp op, int root,
                                               const OpOptions& options = {});
  // recv (size() * send.count) = concatenation of every rank's send in rank
  // order.
  absl::StatusOr<std::unique_ptr<Work>> AllGather(ConstBuffer send, Buffer recv,
                                                  const OpOptions& options = {});
  // send (size() * recv.count) is reduced; rank i receives block i.
  absl::StatusOr<std::unique_ptr<Work>> ReduceScatter(ConstBuffer send, Buffer recv, ReduceOp op,
                                                      const OpOptions& options = {});
  // Equal splits: block i (send.count / size()) of send goes to rank i; recv
  // block j comes from rank j.
  absl::StatusOr<std::unique_ptr<Work>> AllToAll(ConstBuffer send, Buffer recv,
                                                 const OpOptions& options = {});
  // Variable splits (see AllToAllCounts); the counts must sum to send.count
  // and recv.count.
  absl::StatusOr<std::unique_ptr<Work>> AllToAllV(ConstBuffer send, Buffer recv,
                                                  const AllToAllCounts& counts,
                                                  const OpOptions& options = {});
  // Completes on a rank once every rank of the group has started it.
  absl::StatusOr<std::unique_ptr<Work>> Barrier(const OpOptions& options = {});

  // ---- point to point (peer is a rank of this group) ----------------------
  // `buffer` goes to `peer`, where a Recv of the same count and dtype takes
  // it; the k-th send to a peer meets the peer's k-th receive from here.
  absl::StatusOr<std::unique_ptr<Work>> Send(ConstBuffer buffer, int peer,
                                             const OpOptions& options = {});
  // Fills `buffer` with the next message from `peer`; a message of another
  // count is an InvalidArgument from Wait naming both counts.
  absl::StatusOr<std::unique_ptr<Work>> Recv(Buffer buffer, int peer,
                                             const OpOptions& options = {});

  // ---- structure ----------------------------------------------------------
  // Collective over this communicator: ranks with the same color form a new
  // communicator, ordered by key (ties by rank). A negative color takes no
  // part and gets nullptr. Bounded by options.timeout; the new
  // communicator inherits this one's sink unless options name one.
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key,
                                                      const CommOptions& options);

  // ---- fault handling -----------------------------------------------------
  // Stops this rank's use of the communicator in bounded time: pending Work
  // fails with Aborted, later calls fail with FailedPrecondition. Peers are
  // not told (see Revoke). Safe to call from any thread, and more than once.
  // Once a receive's Work has failed (Abort, Revoke, its deadline) its
  // buffer may be freed: nothing arriving later is written into it. MPI
  // cannot cancel a collective, so on MPI a failed collective's buffers
  // may still be written until MPI completes it; keep them alive, or end
  // the job's use of MPI.
  absl::Status Abort();
  // Makes pending and future operations fail with Aborted on every rank of
  // the group (ULFM MPIX_Comm_revoke, ncclCommRevoke), so survivors stop
  // waiting on a failed peer. The communicator may still be shrunk.
  absl::Status Revoke();
  // Collective over the surviving ranks: a new communicator without
  // `excluded` (ranks of this group: failed ones, or live ones being
  // evicted). Ranks keep their relative order. An excluded rank takes no
  // part: if it calls Shrink it gets nullptr at once. The excluded ranks
  // must be in range, listed once, and not every rank (InvalidArgument);
  // survivors that pass different lists get an InvalidArgument (or, when
  // they cannot meet, DeadlineExceeded) instead of a communicator.
  absl::StatusOr<std::unique_ptr<Communicator>> Shrink(absl::Span<const int> excluded,
                                                       const CommOptions& options);
  // OK while healthy; otherwise the error that broke the communicator (a
  // peer failure reported by the backend, a passed deadline, an abort or a
  // revocation), naming rank, group and operation where known.
  absl::Status AsyncError();

 protected:
  // Who this process is in the group.
  struct Membership {
    int rank = 0;
    int size = 1;
    int world_rank = 0;
  };
  // `options` must have passed the checks of a new communicator's options
  // (CreateRootCommunicator, Split and Shrink make them); `capabilities`
  // must name both functions.
  Communicator(const CommOptions& options, const Membership& membership,
               const CommCapabilities& capabilities);

  // An operation's options, resolved once by the public operation for its
  // hook.
  struct ResolvedOptions {
    // When the operation fails with DeadlineExceeded (and marks the
    // communicator failed): now + OpOptions::timeout, or + the
    // communicator's default when that is zero. For Split and Shrink: now +
    // the new communicator's timeout.
    absl::Time deadline;
    // The time limit the deadline came from, for messages ("the operation's
    // timeout of 200ms passed").
    absl::Duration timeout;
    // OpOptions::stream (device backends; null: the communicator's own).
    void* stream = nullptr;
    // "allreduce(sum, 4 x fp32) on group tp (rank 1 of 2, world rank 3)":
    // every message about the operation starts with it, and Work::Describe
    // returns it.
    std::string description;
    // Null unless a sink records the operation. The backend calls
    // trace->Started() when it starts the operation (if it can tell) and
    // trace->Completed(status) when it completes, from whichever thread
    // sees it first: keep it with whatever completes the operation. If the
    // hook returns an error, the public operation completes the trace with
    // it.
    std::shared_ptr<observe::OpTrace> trace;
  };

  // The survivors of a Shrink, worked out once for the hook. Only
  // survivors reach DoShrink.
  struct ShrinkPlan {
    std::vector<int> excluded;   // sorted, distinct, in range
    std::vector<int> survivors;  // the other ranks, in order
    int new_rank = 0;            // this rank's rank among the survivors
    // FNV-1a over the survivors: survivors compare it to catch ranks that
    // pass different lists.
    uint64_t survivors_hash = 0;
    // How many shrinks of this communicator this rank made before, with
    // the same survivors. Every survivor counts alike, whatever shrinks
    // (with other survivors) some of them made in between, so (hash,
    // attempt) names this shrink identically on every survivor and
    // differently from any other.
    int attempt = 0;
  };

  // "group tp (rank 1 of 2, world rank 3)".
  const std::string& where() const { return where_; }

  // ---- the hooks: arguments validated, options resolved ------------------
  // Each starts the operation and returns its Work, or fails with the
  // backend's error (a broken communicator: FailedPrecondition or Aborted,
  // named by options.description).
  virtual absl::StatusOr<std::unique_ptr<Work>> DoAllReduce(ConstBuffer send, Buffer recv,
                                                            ReduceOp op,
                                                            const ResolvedOptions& options) = 0;
  virtual absl::StatusOr<std::unique_ptr<Work>> DoBroadcast(Buffer buffer, int root,
                                                            const ResolvedOptions& options) = 0;
  // `recv` is meaningful only on the root.
  virtual absl::StatusOr<std::unique_ptr<Work>> DoReduce(ConstBuffer send, Buffer recv, ReduceOp op,
                                                         int root,
                                                         const ResolvedOptions& options) = 0;
  virtual absl::StatusOr<std::unique_ptr<Work>> DoAllGather(ConstBuffer send, Buffer recv,
                                                            const ResolvedOptions& options) = 0;
  virtual absl::StatusOr<std::unique_ptr<Work>> DoReduceScatter(ConstBuffer send, Buffer recv,
                                                                ReduceOp op,
                                                                const ResolvedOptions& options) = 0;
  virtual absl::StatusOr<std::unique_ptr<Work>> DoAllToAll(ConstBuffer send, Buffer recv,
                                                           const ResolvedOptions& options) = 0;
  virtual absl::StatusOr<std::unique_ptr<Work>> DoAllToAllV(ConstBuffer send, Buffer recv,
                                                            const AllToAllCounts& counts,
                                                            const ResolvedOptions& options) = 0;
  virtual absl::StatusOr<std::unique_ptr<Work>> DoBarrier(const ResolvedOptions& options) = 0;
  virtual absl::StatusOr<std::unique_ptr<Work>> DoSend(ConstBuffer buffer, int peer,
                                                       const ResolvedOptions& options) = 0;
  virtual absl::StatusOr<std::unique_ptr<Work>> DoRecv(Buffer buffer, int peer,
                                                       const ResolvedOptions& options) = 0;
  // `options` is the new communicator's, checked, with the sink inherited;
  // `resolved.deadline` bounds the whole call.
  virtual absl::StatusOr<std::unique_ptr<Communicator>> DoSplit(
      int color, int key, const CommOptions& options, const ResolvedOptions& resolved) = 0;
  virtual absl::StatusOr<std::unique_ptr<Communicator>> DoShrink(
      const ShrinkPlan& plan, const CommOptions& options, const ResolvedOptions& resolved) = 0;
  virtual absl::Status DoAbort() = 0;
  virtual absl::Status DoRevoke() = 0;
  virtual absl::Status DoAsyncError() = 0;

 private:
  // What a public operation tells Resolve about itself (communicator.cc).
  struct OpCall;
  // Resolves `options` for `call`, numbers it, and starts its trace when a
  // sink is set. InvalidArgument for a negative timeout.
  absl::StatusOr<ResolvedOptions> Resolve(const OpCall& call, const OpOptions& options);
  // The hook's result; a failure completes the trace.
  template <typename T>
  static absl::StatusOr<T> Finish(absl::StatusOr<T> result, const ResolvedOptions& resolved);
  // The child options of Split and Shrink: checked, sink inherited.
  absl::StatusOr<CommOptions> ChildOptions(const CommOptions& options) const;
  const std::shared_ptr<const observe::CommRecord>& comm_record();

  const std::string name_;
  const int rank_;
  const int size_;
  const int world_rank_;
  const absl::Duration timeout_;
  const CommCapabilities capabilities_;
  const std::shared_ptr<observe::OpSink> sink_;
  const std::string where_;
  // Operation numbers (see observe::OpRecord).
  std::atomic<uint64_t> op_seq_{0};
  std::atomic<uint64_t> collective_seq_{0};
  std::atomic<uint64_t> p2p_seq_{0};
  // Shrinks made, by survivors' hash (ShrinkPlan::attempt).
  std::mutex shrink_mu_;
  std::map<uint64_t, int> shrink_attempts_;
  // Made on the first recorded operation (backend() is virtual).
  std::once_flag comm_record_once_;
  std::shared_ptr<const observe::CommRecord> comm_record_;
};

template <typename T>
struct DataTypeOf;
template <>
struct DataTypeOf<float> {
  static constexpr DataType value = DataType::kFloat32;
};
template <>
struct DataTypeOf<double> {
  static constexpr DataType value = DataType::kFloat64;
};
template <>
struct DataTypeOf<int8_t> {
  static constexpr DataType value = DataType::kInt8;
};
template <>
struct DataTypeOf<uint8_t> {
  static constexpr DataType value = DataType::kUInt8;
};
template <>
struct DataTypeOf<int16_t> {
  static constexpr DataType value = DataType::kInt16;
};
template <>
struct DataTypeOf<int32_t> {
  static constexpr DataType value = DataType::kInt32;
};
template <>
struct DataTypeOf<int64_t> {
  static constexpr DataType value = DataType::kInt64;
};

template <typename T>
Buffer Buffer::Of(T* data, size_t count) {
  return Buffer{static_cast<void*>(data), count, DataTypeOf<T>::value};
}

}  // namespace strata
