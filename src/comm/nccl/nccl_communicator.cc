// NcclCommunicator: construction, release, and the operations.
#include "comm/nccl/nccl_communicator.h"

#include <algorithm>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "strata/base/dtype.h"
#include "strata/base/status.h"

namespace strata::nccl {

using comm_internal::PendingOp;
using comm_internal::PendingWork;

namespace {

// How NCCL moves `count` elements of `dtype`: natively, or as bytes when
// NCCL has no type for it (int16 and bool are only ever moved).
struct Moved {
  ncclDataType_t type;
  size_t count;
};
Moved MoveAs(DataType dtype, size_t count) {
  absl::StatusOr<ncclDataType_t> t = ToNcclType(dtype);
  if (t.ok()) return {*t, count};
  return {ncclUint8, count * DataTypeSize(dtype)};
}

// InvalidArgument when `data` (holding `count` elements) is not memory the
// GPU can address directly: NCCL would otherwise fail late or crash.
// `what` is the operation's description.
absl::Status CheckDeviceMemory(absl::string_view what, absl::string_view which, const void* data,
                               size_t count) {
  if (data == nullptr || count == 0) return absl::OkStatus();
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, data) != cudaSuccess) {
    cudaGetLastError();  // clear it
    attributes.type = cudaMemoryTypeUnregistered;
  }
  if (attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      what, ": the ", which, " (", absl::Hex(data),
      ") is host memory; the nccl backend works on CUDA device memory (use the mpi or gloo "
      "backend for host buffers)"));
}

char* At(const void* base, size_t elements, DataType dtype) {
  return static_cast<char*>(const_cast<void*>(base)) + elements * DataTypeSize(dtype);
}

}  // namespace

const CommCapabilities& NcclCapabilities() {
  static const CommCapabilities caps{&NcclCanMove, &NcclCanReduce};
  return caps;
}

absl::Status CheckNcclOptions(const NcclOptions& options, absl::string_view who) {
  if (options.watchdog_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("NcclOptions::watchdog_interval ",
                                                   absl::FormatDuration(options.watchdog_interval),
                                                   " must be positive"));
  }
  if (options.device < -1) {
    return absl::InvalidArgumentError(
        absl::StrCat("NcclOptions::device ", options.device, " on ", who,
                     " must be a device index or -1 (the local rank's device)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<NcclFamily>> NcclFamily::Create(const NcclOptions& options,
                                                               int world_rank) {
  STRATA_RETURN_IF_ERROR(CheckNcclOptions(options, absl::StrCat("world rank ", world_rank)));
  auto family = std::make_shared<NcclFamily>();
  family->world_rank = world_rank;
  family->options = options;
  WatchdogOptions watchdog;
  watchdog.interval = options.watchdog_interval;
  family->watchdog = std::make_unique<Watchdog>(std::move(watchdog));
  return family;
}

int VisibleDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

absl::Status CudaError(cudaError_t err, absl::string_view call) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(call, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

DeviceGuard::DeviceGuard(int device) {
  if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
  if (previous_ != device) cudaSetDevice(device);
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

absl::Status WaitNcclReady(const NcclApi& api, ncclComm_t comm, absl::Time deadline,
                           absl::string_view what, const std::atomic<bool>* stop) {
  absl::Duration pause = absl::Microseconds(20);
  while (true) {
    ncclResult_t state = ncclSuccess;
    ncclResult_t rc = api.CommGetAsyncError(comm, &state);
    if (rc != ncclSuccess) return NcclError(api, rc, absl::StrCat(what, ": ncclCommGetAsyncError"));
    if (state != ncclInProgress) return NcclError(api, state, what, comm);
    if (stop != nullptr && stop->load()) {
      return absl::AbortedError(absl::StrCat(what, ": the communicator was aborted"));
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(what, ": NCCL still in progress when the deadline passed"));
    }
    absl::SleepFor(pause);
    pause = std::min(pause * 2, absl::Milliseconds(1));
  }
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Wrap(
    std::shared_ptr<NcclFamily> family, ncclComm_t comm, const CommOptions& options) {
  const NcclApi& api = *family->api;
  int rank = 0;
  int size = 0;
  absl::Status s = NcclError(api, api.CommUserRank(comm, &rank), "ncclCommUserRank", comm);
  if (s.ok()) s = NcclError(api, api.CommCount(comm, &size), "ncclCommCount", comm);
  if (!s.ok()) {
    api.CommAbort(comm);
    return s;
  }
  std::unique_ptr<NcclCommunicator> c(
      new NcclCommunicator(std::move(family), comm, rank, size, options));
  DeviceGuard device(c->family_->device);
  s = CudaError(cudaStreamCreateWithFlags(&c->stream_, cudaStreamNonBlocking),
                "cudaStreamCreateWithFlags");
  if (s.ok()) {
    s = CudaError(cudaMalloc(reinterpret_cast<void**>(&c->barrier_buffer_), sizeof(float)),
                  "cudaMalloc(barrier)");
  }
  if (s.ok()) s = CudaError(cudaMemset(c->barrier_buffer_, 0, sizeof(float)), "cudaMemset");
  if (!s.ok()) return internal::Annotate(s, c->where());
  return c;
}

NcclCommunicator::NcclCommunicator(std::shared_ptr<NcclFamily> family, ncclComm_t comm, int rank,
                                   int size, const CommOptions& options)
    : Communicator(options, Membership{rank, size, family->world_rank}, NcclCapabilities()),
      family_(std::move(family)),
      api_(*family_->api),
      comm_(comm) {
  TrackerHooks hooks;
  hooks.query_event = [](void* event) -> absl::StatusOr<bool> {
    cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event));
    if (err == cudaSuccess) return true;
    if (err == cudaErrorNotReady) return false;
    return CudaError(err, "cudaEventQuery");
  };
  hooks.release_event = [](void* event) { cudaEventDestroy(static_cast<cudaEvent_t>(event)); };
  // The tracker stops calling this before comm_ goes away (Close, or a
  // failure or abort first), so comm_ is valid whenever it runs.
  hooks.async_error = [this]() -> absl::Status {
    ncclResult_t state = ncclSuccess;
    ncclResult_t rc = api_.CommGetAsyncError(comm_, &state);
    if (rc != ncclSuccess) return NcclError(api_, rc, "ncclCommGetAsyncError");
    if (state == ncclSuccess || state == ncclInProgress) return absl::OkStatus();
    absl::Status s = NcclError(api_, state, "ncclCommGetAsyncError", comm_);
    if (state == ncclRemoteError || state == ncclSystemError) {
      s.SetPayload(kRankFailurePayload, absl::Cord(""));  // NCCL does not say which rank
    }
    return s;
  };
  // A weak reference: the watchdog thread may hold the tracker last, and
  // must never be the one to drop the family (which owns the watchdog).
  hooks.on_failure = [weak = std::weak_ptr<NcclFamily>(family_)](const absl::Status&) {
    if (std::shared_ptr<NcclFamily> family = weak.lock()) family->failed = true;
  };
  tracker_ = std::make_shared<CommTracker>(where(), std::move(hooks));
  family_->watchdog->Add(tracker_);
}

NcclCommunicator::~NcclCommunicator() { Release(); }

void NcclCommunicator::Release() {
  tracker_->Close();  // no hook runs after this, and pending work is failed
  std::lock_guard<std::mutex> lock(mu_);
  DeviceGuard device(family_->device);
  if (comm_ != nullptr) {
    bool abort = family_->failed.load() || !tracker_->health().healthy();
    if (!abort) {
      // Finalize flushes what is in flight; it may wait on peers, so it has
      // the communicator's timeout, after which the communicator is aborted.
      const absl::Time deadline = absl::Now() + timeout();
      ncclResult_t rc = api_.CommFinalize(comm_);
      absl::Status s = rc == ncclInProgress || rc == ncclSuccess
                           ? WaitNcclReady(api_, comm_, deadline, "ncclCommFinalize")
                           : NcclError(api_, rc, "ncclCommFinalize", comm_);
      if (s.ok()) {
        api_.CommDestroy(comm_);
      } else {
        abort = true;
        family_->failed = true;
      }
    }
    if (abort) api_.CommAbort(comm_);
    comm_ = nullptr;
  }
  if (barrier_buffer_ != nullptr) cudaFree(barrier_buffer_);
  barrier_buffer_ = nullptr;
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  stream_ = nullptr;
}

std::string NcclCommunicator::LibraryDescription() const {
  return absl::StrCat("NCCL ", api_.version.ToString(), " (", api_.path, ")");
}

absl::StatusOr<std::unique_ptr<Work>> NcclCommunicator::Launch(
    const ResolvedOptions& options,
    const std::function<ncclResult_t(ncclComm_t, cudaStream_t)>& enqueue) {
  const std::string& description = options.description;
  STRATA_RETURN_IF_ERROR(tracker_->health().CheckUsable(description));
  const absl::Time deadline = options.deadline;
  cudaStream_t stream = options.stream ? static_cast<cudaStream_t>(options.stream) : stream_;

  std::lock_guard<std::mutex> lock(mu_);
  if (comm_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(description, ": the communicator was aborted; shrink it or build a new one"));
  }
  DeviceGuard device(family_->device);
  ncclResult_t rc = enqueue(comm_, stream);
  absl::Status s = rc == ncclInProgress
                       ? WaitNcclReady(api_, comm_, deadline, description, &aborting_)
                       : NcclError(api_, rc, description, comm_);
  if (!s.ok()) {
    // Misuse NCCL caught is the caller's error; anything else breaks the
    // communicator (NCCL says so for nonblocking communicators).
    if (s.code() != absl::StatusCode::kInvalidArgument) tracker_->Fail(s);
    return s;
  }
  cudaEvent_t event = nullptr;
  s = CudaError(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
  if (s.ok()) s = CudaError(cudaEventRecord(event, stream), "cudaEventRecord");
  if (!s.ok()) {
    if (event != nullptr) cudaEventDestroy(event);
    s = internal::Annotate(s, description);
    tracker_->Fail(s);
    return s;
  }
  auto op = std::make_shared<PendingOp>(description, deadline, options.trace);
  tracker_->Add(op, event);
  std::weak_ptr<CommTracker> weak = tracker_;
  return std::unique_ptr<Work>(new PendingWork(op, [weak] {
    if (std::shared_ptr<CommTracker> t = weak.lock()) {
      absl::Status found = t->Check(absl::Now());
      if (!found.ok()) ReportFailureToStderr(found);  // logged once, whoever finds it
    }
  }));
}

absl::StatusOr<std::unique_ptr<Work>> NcclCommunicator::DoAllReduce(
    ConstBuffer send, Buffer recv, ReduceOp op, const ResolvedOptions& options) {
  STRATA_RETURN_IF_ERROR(
      CheckDeviceMemory(options.description, "send buffer", send.data, send.count));
  STRATA_RETURN_IF_ERROR(
      CheckDeviceMemory(options.description, "receive buffer", recv.data, recv.count));
  STRATA_ASSIGN_OR_RETURN(ncclDataType_t type, ToNcclType(recv.dtype));
  return Launch(options, [&](ncclComm_t c, cudaStream_t s) {
    return api_.AllReduce(send.data, recv.data, recv.count, type, ToNcclOp(op), c, s);
  });
}

absl::StatusOr<std::unique_ptr<Work>> NcclCommunicator::DoBroadcast(
    Buffer buffer, int root, const ResolvedOptions& options) {
  STRATA_RETURN_IF_ERROR(
      CheckDeviceMemory(options.description, "buffer", buffer.data, buffer.count));
  const Moved m = MoveAs(buffer.dtype, buffer.count);
  return Launch(options, [&](ncclComm_t c, cudaStream_t s) {
    return api_.Broadcast(buffer.data, buffer.data, m.count, m.type, root, c, s);
  });
}

absl::StatusOr<std::unique_ptr<Work>> NcclCommunicator::DoReduce(ConstBuffer send, Buffer recv,
                                                                 ReduceOp op, int root,
                                                                 const ResolvedOptions& options) {
  STRATA_RETURN_IF_ERROR(
      CheckDeviceMemory(options.description, "send buffer", send.data, send.count));
  STRATA_RETURN_IF_ERROR(CheckDeviceMemory(options.description, "receive buffer", recv.data,
                                           rank() == root ? recv.count : 0));
  STRATA_ASSIGN_OR_RETURN(ncclDataType_t type, ToNcclType(send.dtype));
  return Launch(options, [&](ncclComm_t c, cudaStream_t s) {
    return api_.Reduce(send.data, recv.data, send.count, type, ToNcclOp(op), root, c, s);
  });
}

absl::StatusOr<std::unique_ptr<Work>> NcclCommunicator::DoAllGather(
    ConstBuffer send, Buffer recv, const ResolvedOptions& options) {
  STRATA_RETURN_IF_ERROR(
      CheckDeviceMemory(options.description, "send buffer", send.data, send.count));
  STRATA_RETURN_IF_ERROR(
      CheckDeviceMemory(options.description, "receive buffer", recv.data, recv.count));
  const Moved m = MoveAs(send.dtype, send.count);
  return Launch(options, [&](ncclComm_t c, cudaStream_t s) {
    return api_.AllGather(send.data, recv.data, m.count, m.type, c, s);
  });
}

absl::StatusOr<std::unique_ptr<Work>> NcclCommunicator::DoReduceScatter(
    ConstBuffer send, Buffer recv, ReduceOp op, const ResolvedOptions& options) {
  STRATA_RETURN_IF_ERROR(
      CheckDeviceMemory(options.description, "send buffer", send.data, send.count));
  STRATA_RETURN_IF_ERROR(
      CheckDeviceMemory(options.description, "receive buffer", recv.data, recv.count));
  STRATA_ASSIGN_OR_RETURN(ncclDataType_t type, ToNcclType(recv.dtype));
  return Launch(options, [&](ncclComm_t c, cudaStream_t s) {
    return api_.ReduceScatter(send.data, recv.data, recv.count, type, ToNcclOp(op), c, s);
  });
}

absl::StatusOr<std::unique_ptr<Work>> NcclCommunicator::DoAllToAll(ConstBuffer send, Buffer recv,
                                                                   const ResolvedOptions& options) {
  AllToAllCounts counts;
  counts.send_counts.assign(static_cast<size_t>(size()), send.count / static_cast<size_t>(size()));
  counts.recv_counts = counts.send_counts;
  return LaunchAllToAll(send, recv, counts, options);
}

absl::StatusOr<std::unique_ptr<Work>> NcclCommunicator::DoAllToAllV(
    ConstBuffer send, Buffer recv, const AllToAllCounts& counts, const ResolvedOptions& options) {
  return LaunchAllToAll(send, recv, counts, options);
}

absl::StatusOr<std::unique_ptr<Work>> NcclCommunicator::LaunchAllToAll(
    ConstBuffer send, Buffer recv, const AllToAllCounts& counts, const ResolvedOptions& options) {
  STRATA_RETURN_IF_ERROR(
      CheckDeviceMemory(options.description, "send buffer", send.data, send.count));
  STRATA_RETURN_IF_ERROR(
      CheckDeviceMemory(options.description, "receive buffer", recv.data, recv.count));
  // NCCL's all-to-all is a group of sends and receives, one pair per peer.
  // In place, a receive could overwrite a block before it is sent: the
  // sends then read a copy made on the stream first, freed on the stream
  // after them.
  const int n = size();
  const bool in_place = send.data == recv.data && send.count != 0;
  const size_t bytes = send.count * DataTypeSize(send.dtype);
  return Launch(options, [&](ncclComm_t c, cudaStream_t s) {
    const void* source = send.data;
    void* staged = nullptr;
    if (in_place) {
      if (cudaMallocAsync(&staged, bytes, s) != cudaSuccess ||
          cudaMemcpyAsync(staged, send.data, bytes, cudaMemcpyDeviceToDevice, s) != cudaSuccess) {
        if (staged != nullptr) cudaFreeAsync(staged, s);
        return ncclUnhandledCudaError;
      }
      source = staged;
    }
    ncclResult_t rc = api_.GroupStart();
    if (rc != ncclSuccess) {
      if (staged != nullptr) cudaFreeAsync(staged, s);
      return rc;
    }
    size_t send_offset = 0;
    size_t recv_offset = 0;
    for (int peer = 0; peer < n; ++peer) {
      const size_t p = static_cast<size_t>(peer);
      const Moved out = MoveAs(send.dtype, counts.send_counts[p]);
      const Moved in = MoveAs(recv.dtype, counts.recv_counts[p]);
      if (out.count > 0) {
        rc = api_.Send(At(source, send_offset, send.dtype), out.count, out.type, peer, c, s);
        if (rc != ncclSuccess && rc != ncclInProgress) break;
      }
      if (in.count > 0) {
        rc = api_.Recv(At(recv.data, recv_offset, recv.dtype), in.count, in.type, peer, c, s);
        if (rc != ncclSuccess && rc != ncclInProgress) break;
      }
      send_offset += counts.send_counts[p];
      recv_offset += counts.recv_counts[p];
    }
    ncclResult_t end = api_.GroupEnd();
    if (staged != nullptr) cudaFreeAsync(staged, s);  // after the group, in stream order
    return rc != ncclSuccess && rc != ncclInProgress ? rc : end;
  });
}

absl::StatusOr<std::unique_ptr<Work>> NcclCommunicator::DoBarrier(const ResolvedOptions& options) {
  // NCCL has no barrier: a one-element allreduce orders every rank's stream.
  return Launch(options, [&](ncclComm_t c, cudaStream_t s) {
    return api_.AllReduce(barrier_buffer_, barrier_buffer_, 1, ncclFloat32, ncclSum, c, s);
  });
}

absl::StatusOr<std::unique_ptr<Work>> NcclCommunicator::DoSend(ConstBuffer buffer, int peer,
                                                               const ResolvedOptions& options) {
  STRATA_RETURN_IF_ERROR(
      CheckDeviceMemory(options.description, "buffer", buffer.data, buffer.count));
  const Moved m = MoveAs(buffer.dtype, buffer.count);
  return Launch(options, [&](ncclComm_t c, cudaStream_t s) {
    return api_.Send(buffer.data, m.count, m.type, peer, c, s);
  });
}

absl::StatusOr<std::unique_ptr<Work>> NcclCommunicator::DoRecv(Buffer buffer, int peer,
                                                               const ResolvedOptions& options) {
  STRATA_RETURN_IF_ERROR(
      CheckDeviceMemory(options.description, "buffer", buffer.data, buffer.count));
  const Moved m = MoveAs(buffer.dtype, buffer.count);
  return Launch(options, [&](ncclComm_t c, cudaStream_t s) {
    return api_.Recv(buffer.data, m.count, m.type, peer, c, s);
  });
}

absl::Status NcclCommunicator::DoAsyncError() {
  absl::Status found = tracker_->Check(absl::Now());
  if (!found.ok()) ReportFailureToStderr(found);  // logged once, whoever finds it
  return tracker_->health().Health();
}

}  // namespace strata::nccl
