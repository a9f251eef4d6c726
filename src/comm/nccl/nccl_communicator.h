// The NCCL backend: a Communicator over one ncclComm_t, for CUDA device
// memory, one GPU per rank.
//
// Every communicator is nonblocking (ncclConfig_t::blocking = 0), so no NCCL
// call blocks past a deadline: initialisation, split and shrink poll
// ncclCommGetAsyncError until done or until CommOptions::timeout passes.
// Operations are enqueued on the caller's stream (OpOptions::stream, else
// the communicator's own stream) and complete through a CUDA event recorded
// after them; Work::Wait / Test query that event. The family's watchdog
// (nccl_watchdog.h) polls each communicator for asynchronous NCCL errors and
// operations past their deadline.
//
// Split children and shrunk communicators belong to their root's family
// (NcclFamily), which owns the watchdog: one thread per root, polling at the
// root's NcclOptions::watchdog_interval, joined when the last member of the
// family is destroyed. Nothing is shared between the families of two roots
// in one process. Once any member has failed or been aborted, every member
// is released with ncclCommAbort, never ncclCommDestroy (which can block on
// a dead peer). A healthy communicator is finalized (within its timeout)
// and destroyed.
//
//   STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> world,
//                           nccl::CreateNcclRoot(env, options, store));
//
// Thread-safety: as strata::Communicator. Operations from several threads
// are enqueued one at a time; Abort() may be called from any thread.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "comm/nccl/nccl_config.h"
#include "comm/nccl/nccl_library.h"
#include "comm/nccl/nccl_watchdog.h"
#include "strata/comm/backend.h"

namespace strata::nccl {

// The number of CUDA devices visible to this process (0 without a driver or
// a device).
int VisibleDeviceCount();

// Creates the root communicator (every rank of the job); see
// strata/comm/backend.h for where the unique id comes from. Collective.
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclRoot(const LaunchEnv& env,
                                                             const RootOptions& options,
                                                             std::shared_ptr<Store> store);

// What every communicator of one root's family shares (the root and every
// communicator split or shrunk from it, each holding a reference).
struct NcclFamily {
  // A family whose watchdog polls every `options.watchdog_interval`, on a
  // thread of its own that lives as long as the family. InvalidArgument
  // when the interval is not positive (it could not be honoured).
  static absl::StatusOr<std::shared_ptr<NcclFamily>> Create(const NcclOptions& options,
                                                            int world_rank);

  const NcclApi* api = nullptr;
  int device = 0;
  int world_rank = 0;
  NcclOptions options;
  // The topology profile's config fields, for the family's communicators.
  NcclConfigFields profile;
  // Owned here, so its thread is joined when the last member goes. Its
  // thread never holds the family (tracker hooks reach it through a weak
  // reference, and a tracker's Close waits for a check in progress).
  std::unique_ptr<Watchdog> watchdog;
  // Set when any member failed or was aborted: members are then released
  // with ncclCommAbort.
  std::atomic<bool> failed{false};
};

// InvalidArgument naming the setting when `options` holds one that cannot
// be honoured (a watchdog interval that is not positive, a device index
// below -1). `who`: "rank 3 of 8".
absl::Status CheckNcclOptions(const NcclOptions& options, absl::string_view who);

// Makes `device` current for the life of the guard, restoring the caller's.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();

 private:
  int previous_ = -1;
};

// A CUDA runtime error as a status naming the call.
absl::Status CudaError(cudaError_t err, absl::string_view call);

// Polls ncclCommGetAsyncError(comm) until it is no longer ncclInProgress or
// `deadline` passes (DeadlineExceeded naming `what`), or `stop` turns true
// (Aborted). NCCL's error otherwise.
absl::Status WaitNcclReady(const NcclApi& api, ncclComm_t comm, absl::Time deadline,
                           absl::string_view what, const std::atomic<bool>* stop = nullptr);

class NcclCommunicator final : public Communicator {
 public:
  // Wraps an initialised communicator. `comm` is owned from here on.
  // `options` has been checked (CreateRootCommunicator, Split, Shrink).
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Wrap(std::shared_ptr<NcclFamily> family,
                                                                ncclComm_t comm,
                                                                const CommOptions& options);
  ~NcclCommunicator() override;

  absl::string_view backend() const override { return "nccl"; }
  MemoryKind memory() const override { return MemoryKind::kCuda; }

  // The NCCL in use, for reports: "NCCL 2.30.7 (/path/libnccl.so.2)".
  std::string LibraryDescription() const;
  // The family's watchdog (shared with the root's splits and shrinks).
  const Watchdog& watchdog() const { return *family_->watchdog; }

 protected:
  absl::StatusOr<std::unique_ptr<Work>> DoAllReduce(ConstBuffer send, Buffer recv, ReduceOp op,
                                                    const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> DoBroadcast(Buffer buffer, int root,
                                                    const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> DoReduce(ConstBuffer send, Buffer recv, ReduceOp op,
                                                 int root, const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> DoAllGather(ConstBuffer send, Buffer recv,
                                                    const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> DoReduceScatter(ConstBuffer send, Buffer recv, ReduceOp op,
                                                        const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> DoAllToAll(ConstBuffer send, Buffer recv,
                                                   const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> DoAllToAllV(ConstBuffer send, Buffer recv,
                                                    const AllToAllCounts& counts,
                                                    const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> DoBarrier(const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> DoSend(ConstBuffer buffer, int peer,
                                               const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Work>> DoRecv(Buffer buffer, int peer,
                                               const ResolvedOptions& options) override;
  absl::StatusOr<std::unique_ptr<Communicator>> DoSplit(int color, int key,
                                                        const CommOptions& options,
                                                        const ResolvedOptions& resolved) override;
  absl::StatusOr<std::unique_ptr<Communicator>> DoShrink(const ShrinkPlan& plan,
                                                         const CommOptions& options,
                                                         const ResolvedOptions& resolved) override;
  absl::Status DoAbort() override;
  absl::Status DoRevoke() override;
  absl::Status DoAsyncError() override;

 private:
  NcclCommunicator(std::shared_ptr<NcclFamily> family, ncclComm_t comm, int rank, int size,
                   const CommOptions& options);

  // Enqueues `enqueue` (the NCCL calls) on the stream, records the
  // completion event and returns the Work.
  absl::StatusOr<std::unique_ptr<Work>> Launch(
      const ResolvedOptions& options,
      const std::function<ncclResult_t(ncclComm_t, cudaStream_t)>& enqueue);
  // All-to-all as NCCL does it: a group of sends and receives.
  absl::StatusOr<std::unique_ptr<Work>> LaunchAllToAll(ConstBuffer send, Buffer recv,
                                                       const AllToAllCounts& counts,
                                                       const ResolvedOptions& options);
  // The config of a new child communicator.
  NcclConfig ChildConfig(const CommOptions& options) const;
  // Waits for a child made by split/shrink; wraps or aborts it.
  absl::StatusOr<std::unique_ptr<Communicator>> AdoptChild(ncclResult_t started, ncclComm_t child,
                                                           const CommOptions& options,
                                                           const ResolvedOptions& resolved);
  void Release();

  const std::shared_ptr<NcclFamily> family_;
  const NcclApi& api_;
  std::shared_ptr<CommTracker> tracker_;
  // Serialises enqueueing (every rank must issue in the same order) and
  // guards comm_ against Abort.
  mutable std::mutex mu_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  float* barrier_buffer_ = nullptr;  // one float of device memory
  std::atomic<bool> aborting_{false};
  // Revoked and quiescent: a shrink needs no NCCL_SHRINK_ABORT.
  std::atomic<bool> revoked_{false};
};

// What NCCL moves (every dtype, as bytes where NCCL has no type) and
// reduces (all but int16 and bool).
const CommCapabilities& NcclCapabilities();

}  // namespace strata::nccl
