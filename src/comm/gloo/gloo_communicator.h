// The Gloo backend of strata::Communicator (host memory, bootstrapped from a
// Store): what CPU jobs use under torchrun, where there is no MPI world.
//
// Gloo itself runs in a plugin (plugin_api.h says why); this class holds
// no gloo:: reference. Each communicator has a Gloo context (a full mesh of
// TCP connections among its ranks, made through the store) and a queue
// (gloo_queue.h) whose worker thread runs its operations in issue order.
//
// Structure and faults:
//   root     every rank draws the next root number from the store (a
//            counter per rank, so the k-th root of every rank meets under
//            the same keys), then the ranks connect through the store.
//   Split    an allgather of (color, key) on the parent, then a new context
//            among the ranks of each color, through the store.
//   Shrink   the survivors only (Communicator keeps the excluded ranks
//            out and works out the survivors): each publishes a hash of its survivor list
//            and checks its neighbour's (different lists are an
//            InvalidArgument), then a new context among them through the
//            store. Works after failures and on a revoked communicator:
//            the old connections are not used.
//   Abort    local and immediate: pending operations fail with Aborted, and
//            the connections are closed, which wakes this rank's blocked
//            operation (and fails the peers' operations on it).
//   Revoke   a flag in the store, then Abort's closing: peers' operations
//            fail on the closed connections, find the flag, and report
//            Aborted ("revoked by a peer").
//
// Thread-safety: as Communicator.
#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/common/health.h"
#include "comm/gloo/gloo_loader.h"
#include "comm/gloo/gloo_queue.h"
#include "comm/gloo/plugin_api.h"
#include "strata/comm/backend.h"
#include "strata/comm/communicator.h"
#include "strata/comm/store.h"

namespace strata::gloo {

// What a root communicator shares with every communicator made from it.
struct GlooRuntime {
  std::shared_ptr<GlooPlugin> plugin;
  std::shared_ptr<gloo_plugin::Device> device;
  std::shared_ptr<Store> store;
  int world_rank = 0;
};

class GlooCommunicator final : public Communicator {
 public:
  // Collective over every rank of the job: connects a root communicator of
  // `size` ranks through `store`. options.comm has been checked
  // (CreateRootCommunicator).
  static absl::StatusOr<std::unique_ptr<GlooCommunicator>> CreateRoot(const RootOptions& options,
                                                                      std::shared_ptr<Store> store,
                                                                      int rank, int size);

  GlooCommunicator(std::shared_ptr<GlooRuntime> runtime,
                   std::unique_ptr<gloo_plugin::Context> context, const CommOptions& options,
                   std::string uid);
  ~GlooCommunicator() override;

  absl::string_view backend() const override { return "gloo"; }
  std::string transport() const override { return host_copy() ? "gloo, host copies" : "gloo, tcp"; }
  MemoryKind memory() const override { return MemoryKind::kHost; }
  bool progresses_independently() const override { return true; }

  // The plugin in use (for reports and tests).
  const GlooPlugin& plugin() const { return *runtime_->plugin; }
  // True when the ranks share this host and collectives copy directly
  // between their buffers (gloo_plugin::Context::HostCopy).
  bool host_copy() const { return context_->HostCopy(); }

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
  // What an operation does on the worker thread: `tag` is the same on
  // every rank, `timeout_ms` the time left before its deadline.
  struct Step {
    uint32_t tag;
    int64_t timeout_ms;
    const std::string& description;
  };
  using RunFn = std::function<absl::Status(const Step& step)>;
  // Collectives take the next tag (every rank issues the same collectives,
  // so tags agree); point-to-point operations, which only some ranks issue,
  // take none.
  enum class Kind { kCollective, kPointToPoint };
  // Queues an operation; `finish` (optional) runs after `run` with the
  // operation's deadline, on the completer or a waiting thread (GlooQueue),
  // `interrupt` (optional) makes it fail, `suspend` (point-to-point only)
  // makes it return Suspended() and resumable.
  absl::StatusOr<std::unique_ptr<Work>> Start(Kind kind, const ResolvedOptions& options, RunFn run,
                                              std::function<absl::Status(absl::Time)> finish = {},
                                              std::function<void()> interrupt = {},
                                              std::function<void()> suspend = {});
  // Send and Recv between ranks of one host (host_copy(); `send`: a send,
  // which only reads the buffer).
  absl::StatusOr<std::unique_ptr<Work>> StartHost(bool send, Buffer buffer, int peer,
                                                  const ResolvedOptions& options);
  // Classifies a failure: marks the communicator failed (or revoked, when
  // the store says a peer revoked it) and returns the status to report.
  absl::Status OnError(const absl::Status& status);
  // Connects a new communicator of `size` ranks (this one is `rank`)
  // through the store under `uid`; its waits for peers end with Aborted as
  // soon as `cancelled` (when set) returns true.
  absl::StatusOr<std::unique_ptr<GlooCommunicator>> Connect(
      const std::string& uid, int rank, int size, const CommOptions& options,
      const std::function<bool()>& cancelled = {});
  // Runs a collective of this communicator and waits for it (for Split).
  absl::Status RunNow(absl::StatusOr<std::unique_ptr<Work>> work, absl::Time deadline);
  void CloseConnections();
  // Keeps a failed transfer's buffers alive until the connections are closed.
  void Bury(std::shared_ptr<void> transfer);
  // Takes completed Gloo transfers (see retired_).
  void Retire(std::unique_ptr<gloo_plugin::Pending> first,
              std::vector<std::unique_ptr<gloo_plugin::Pending>> chunks);

  const std::shared_ptr<GlooRuntime> runtime_;
  const std::unique_ptr<gloo_plugin::Context> context_;
  const std::string uid_;
  comm_internal::CommHealth health_;
  // Serialises the starting of operations so that tags and queue order
  // agree; guards the counters.
  std::mutex issue_mu_;
  uint32_t next_tag_ = 0;
  int split_seq_ = 0;
  std::atomic<bool> closed_{false};
  // Closes the connections (CloseConnections); joined by the destructor,
  // before the buffers the connections may still write are freed.
  std::mutex closer_mu_;
  std::thread closer_;
  // Abort() calls so far: a Shrink in progress gives up when another comes
  // (a survivor died during it; the caller starts again without it) rather
  // than wait for the dead rank's keys until its deadline.
  std::atomic<uint64_t> aborts_{0};
  // Point-to-point messages posted to / from each group rank: a message's
  // number names the slot of its chunks. Only touched while posting, which
  // the queue serialises.
  std::vector<uint32_t> sent_to_;
  std::vector<uint32_t> received_from_;
  std::mutex graveyard_mu_;
  std::vector<std::shared_ptr<void>> graveyard_;
  // Gloo transfers that completed, destroyed only after kRetired later
  // ones: Gloo's thread holds a transfer for a moment after signalling its
  // completion, and destroying it then makes the destroying thread wait
  // for Gloo's (gloo::ShareableNonOwningPtr yields in a loop), which on a
  // loaded machine costs the waiter a time slice per message.
  static constexpr size_t kRetired = 32;
  std::mutex retired_mu_;
  std::deque<std::unique_ptr<gloo_plugin::Pending>> retired_;
  // Last member: stopped (joined) first on destruction. Shared with the
  // Works, which may outlive the communicator.
  std::shared_ptr<GlooQueue> queue_;
};

// Connects a context of `size` ranks through `store` under `uid` (also used
// for the root). `cancelled` (when set) ends Gloo's waits (a peer's connect)
// and the store's, which then block in the store for at most 50 ms at a
// time between looks at it.
absl::StatusOr<std::unique_ptr<gloo_plugin::Context>> ConnectContext(
    const GlooRuntime& runtime, const std::string& uid, int rank, int size, absl::Time deadline,
    const std::function<bool()>& cancelled = {});

// A plugin error as a status whose message starts with `description`.
absl::Status FromPlugin(const gloo_plugin::Error& e, absl::string_view description);

// What this backend moves and reduces (every dtype; reductions of all but
// bool).
const CommCapabilities& GlooCapabilities();

}  // namespace strata::gloo
