// The operation queue of one Gloo communicator: Gloo's collectives block,
// so each communicator runs them on a worker thread of its own, in issue
// order, and a completer thread finishes them (waits for point-to-point
// transfers, divides averages) and reports them done, also in issue order.
//
//   GlooQueue queue(&health, on_error);
//   auto op = std::make_shared<QueuedOp>();
//   op->pending = std::make_shared<PendingOp>(description, deadline);
//   op->run = [&](absl::Duration left) { return context->AllReduce(...); };
//   queue.Submit(op);
//
// The worker runs an operation only while the communicator is healthy and
// the operation's deadline has not passed; Gloo's own timeout for it is the
// time left. A point-to-point transfer is only posted by the worker (so that
// a receive never blocks later operations) and waited for by the completer.
// Failures go through `on_error`, which may mark the communicator failed
// and rewrite the status (a revoked communicator's "connection closed"
// becomes Aborted).
//
// Thread-safety: thread-safe. Both threads are owned by the queue and
// joined by Stop() (or the destructor).
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "comm/common/health.h"
#include "comm/common/pending_op.h"

namespace strata::gloo {

struct QueuedOp {
  std::shared_ptr<comm_internal::PendingOp> pending;
  // On the worker thread: the collective, or posting a transfer. `left` is
  // the time until the operation's deadline (positive).
  std::function<absl::Status(absl::Duration left)> run;
  // On the completer thread, after `run` succeeded: waits for transfers
  // until `deadline`, finishes results. May be empty.
  std::function<absl::Status(absl::Time deadline)> finish;
  // Called (from any thread) to make a `finish` in progress return early.
  std::function<void()> interrupt;
};

class GlooQueue {
 public:
  // `on_error(status)` is called for every failed run/finish and returns
  // the status the operation fails with.
  GlooQueue(comm_internal::CommHealth* health,
            std::function<absl::Status(const absl::Status&)> on_error);
  ~GlooQueue();
  GlooQueue(const GlooQueue&) = delete;
  GlooQueue& operator=(const GlooQueue&) = delete;

  // With `inline_ok` (a `run` that only posts and does not block: point-to-
  // point transfers), the calling thread runs `run` itself when nothing is
  // queued or running, saving the hop to the worker; the order of
  // operations is the same either way.
  void Submit(std::shared_ptr<QueuedOp> op, bool inline_ok = false);
  // Fails every operation not yet done with `status`, now, and interrupts
  // the one being finished.
  void FailAll(const absl::Status& status);
  // True while the worker runs an operation.
  bool busy() const;
  // Fails what is left with `status` and joins both threads. The caller
  // first unblocks an operation stuck in Gloo (Context::CloseConnections).
  void Stop(const absl::Status& status);

 private:
  void Work();
  // Runs `op` (on the worker, or inline on the submitting thread) and hands
  // it on to be finished. Called with running_ set, without the lock.
  void RunOne(std::shared_ptr<QueuedOp> op);
  void Complete();
  void Forget(const QueuedOp* op);

  comm_internal::CommHealth* const health_;
  const std::function<absl::Status(const absl::Status&)> on_error_;
  mutable std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<std::shared_ptr<QueuedOp>> to_run_;
  std::deque<std::pair<std::shared_ptr<QueuedOp>, absl::Status>> to_finish_;
  // Every submitted operation not yet completed, for FailAll.
  std::vector<std::shared_ptr<QueuedOp>> live_;
  bool running_ = false;
  // Operations handed to the completer and not yet completed by it.
  int finishing_ = 0;
  bool stop_ = false;
  std::thread worker_;
  std::thread completer_;
};

}  // namespace strata::gloo
