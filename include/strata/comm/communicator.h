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
// Misuse detected locally (a null buffer with a nonzero count, a count that
// overflows, mismatched counts or dtypes, a peer or root out of range, a
// dtype or op the backend cannot reduce) is an InvalidArgument error from
// the call itself, naming the values. Failures after the start (a peer lost,
// a deadline passed, the communicator aborted or revoked) come from
// Work::Wait / Work::Test, and name the rank, the group and the operation.
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
// order. Abort() and AsyncError() may be called from any thread at any time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "strata/base/dtype.h"
#include "strata/base/export.h"

namespace strata {

enum class ReduceOp : uint8_t { kSum, kProd, kMin, kMax, kAvg };

// The payload key (absl::Status::GetPayload) a backend sets on an error
// caused by a failed peer rank. Its value lists the failed ranks of the
// group, comma-separated ("2,5"), or is empty when the backend cannot tell.
// The Python layer raises strata.RankFailure for such errors.
inline constexpr char kRankFailurePayload[] = "strata/rank-failure";

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
  // for again. Idempotent after completion.
  virtual absl::Status Wait(absl::Time deadline = absl::InfiniteFuture()) = 0;
  // True when the operation has completed successfully, false while it is in
  // flight; the operation's error when it failed.
  virtual absl::StatusOr<bool> Test() = 0;
  // "allreduce(sum, 1048576 x fp32) on group tp (rank 1 of 2, world rank 3)".
  virtual std::string Describe() const = 0;
};

class STRATA_EXPORT Communicator {
 public:
  virtual ~Communicator() = default;

  // This process's rank in the group, and the group's size.
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // The group's name (CommOptions::name) and this process's world rank, for
  // messages.
  virtual const std::string& name() const = 0;
  virtual int world_rank() const = 0;
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

  // ---- collectives (in place when send.data == recv.data) ----------------
  // recv = op over ranks of send; counts and dtypes must match.
  virtual absl::StatusOr<std::unique_ptr<Work>> AllReduce(ConstBuffer send, Buffer recv,
                                                          ReduceOp op,
                                                          const OpOptions& options = {}) = 0;
  // buffer on every rank = buffer on `root`.
  virtual absl::StatusOr<std::unique_ptr<Work>> Broadcast(Buffer buffer, int root,
                                                          const OpOptions& options = {}) = 0;
  // recv on `root` = op over ranks of send; recv is ignored elsewhere.
  virtual absl::StatusOr<std::unique_ptr<Work>> Reduce(ConstBuffer send, Buffer recv, ReduceOp op,
                                                       int root, const OpOptions& options = {}) = 0;
  // recv (size() * send.count) = concatenation of every rank's send in rank
  // order.
  virtual absl::StatusOr<std::unique_ptr<Work>> AllGather(ConstBuffer send, Buffer recv,
                                                          const OpOptions& options = {}) = 0;
  // send (size() * recv.count) is reduced; rank i receives block i.
  virtual absl::StatusOr<std::unique_ptr<Work>> ReduceScatter(ConstBuffer send, Buffer recv,
                                                              ReduceOp op,
                                                              const OpOptions& options = {}) = 0;
  // Equal splits: block i (send.count / size()) of send goes to rank i; recv
  // block j comes from rank j.
  virtual absl::StatusOr<std::unique_ptr<Work>> AllToAll(ConstBuffer send, Buffer recv,
                                                         const OpOptions& options = {}) = 0;
  // Variable splits (see AllToAllCounts); the counts must sum to send.count
  // and recv.count.
  virtual absl::StatusOr<std::unique_ptr<Work>> AllToAllV(ConstBuffer send, Buffer recv,
                                                          const AllToAllCounts& counts,
                                                          const OpOptions& options = {}) = 0;
  virtual absl::StatusOr<std::unique_ptr<Work>> Barrier(const OpOptions& options = {}) = 0;

  // ---- point to point (peer is a rank of this group) ----------------------
  virtual absl::StatusOr<std::unique_ptr<Work>> Send(ConstBuffer buffer, int peer,
                                                     const OpOptions& options = {}) = 0;
  virtual absl::StatusOr<std::unique_ptr<Work>> Recv(Buffer buffer, int peer,
                                                     const OpOptions& options = {}) = 0;

  // ---- structure ----------------------------------------------------------
  // Collective over this communicator: ranks with the same color form a new
  // communicator, ordered by key (ties by rank). A negative color takes no
  // part and gets nullptr.
  virtual absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key,
                                                              const CommOptions& options) = 0;

  // ---- fault handling -----------------------------------------------------
  // Stops this rank's use of the communicator in bounded time: pending Work
  // fails with Aborted, later calls fail with FailedPrecondition. Peers are
  // not told (see Revoke). Safe to call from any thread, and more than once.
  virtual absl::Status Abort() = 0;
  // Makes pending and future operations fail with Aborted on every rank of
  // the group (ULFM MPIX_Comm_revoke, ncclCommRevoke), so survivors stop
  // waiting on a failed peer. The communicator may still be shrunk.
  virtual absl::Status Revoke() = 0;
  // Collective over the surviving ranks: a new communicator without
  // `excluded` (ranks of this group: failed ones, or live ones being
  // evicted). Ranks keep their relative order.
  virtual absl::StatusOr<std::unique_ptr<Communicator>> Shrink(absl::Span<const int> excluded,
                                                               const CommOptions& options) = 0;
  // OK while healthy; otherwise the error that broke the communicator (a
  // peer failure reported by the backend, a passed deadline, an abort or a
  // revocation), naming rank, group and operation where known.
  virtual absl::Status AsyncError() = 0;
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
