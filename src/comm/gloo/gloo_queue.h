// The operation queue of one Gloo communicator: Gloo's collectives block,
// so each communicator runs them on a worker thread of its own, in issue
// order, and operations are reported done in issue order too.
//
//   auto queue = std::make_shared<GlooQueue>(&health, on_error);
//   auto op = std::make_shared<QueuedOp>();
//   op->pending = std::make_shared<PendingOp>(description, deadline);
//   op->run = [&](absl::Duration left) { return context->AllReduce(...); };
//   std::unique_ptr<Work> work = queue->Submit(op);
//
// The worker runs an operation only while the communicator is healthy and
// the operation's deadline has not passed; Gloo's own timeout for it is the
// time left. A point-to-point transfer is only posted by `run` (so that a
// receive never blocks later operations); its `finish` waits for it.
//
// Who runs `finish`: a thread waiting for the operation's Work claims it
// (with every unfinished operation before it, to keep the order) and runs
// it itself, so that Gloo's thread wakes the waiter directly, as it does in
// torch.distributed; nobody else is woken. The completer thread runs what
// nobody claims: at once for collectives and for operations someone tests
// for, dropped or waits for without claiming; a claimable operation after a
// grace period (kGrace) in which a waiter usually comes. While claims go on
// the completer also keeps time: when a claiming wait's deadline passes
// (Python waits in slices of 100 ms so that Ctrl-C gets through) it asks
// the finish in progress to suspend (`suspend`, which makes `finish`
// return a status for which IsSuspended holds), and the operations go back
// to the queue, to be claimed again or finished by the completer.
//
// Failures go through `on_error`, which may mark the communicator failed
// and rewrite the status (a revoked communicator's "connection closed"
// becomes Aborted).
//
// Thread-safety: thread-safe. Both threads are owned by the queue and
// joined by Stop() (or the destructor). Works returned by Submit keep the
// queue alive; after Stop they only report the status their operation
// ended with.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "comm/common/health.h"
#include "comm/common/pending_op.h"
#include "strata/comm/communicator.h"

namespace strata::gloo {

struct QueuedOp {
  std::shared_ptr<comm_internal::PendingOp> pending;
  // On the worker thread: the collective, or posting a transfer. `left` is
  // the time until the operation's deadline (positive).
  std::function<absl::Status(absl::Duration left)> run;
  // After `run` succeeded, on the completer or a waiting thread: waits for
  // transfers until `deadline`, finishes results. May be empty.
  std::function<absl::Status(absl::Time deadline)> finish;
  // Called (from any thread) to make a `finish` in progress fail early.
  std::function<void()> interrupt;
  // Set when `finish` may run on a waiting thread: then it must be
  // resumable, and `suspend` (called from any thread) makes a finish in
  // progress, or the next one, return Suspended() without losing progress.
  std::function<void()> suspend;

  // Queue state, under the queue's lock.
  uint64_t seq = 0;         // its place in issue order
  absl::Time ready_since;   // when it was handed on to be finished
  absl::Status run_status;  // what `run` returned
};

// The status a suspended `finish` returns, and its test.
absl::Status Suspended();
bool IsSuspended(const absl::Status& s);

class GlooQueue : public std::enable_shared_from_this<GlooQueue> {
 public:
  // How long a claimable operation waits for a thread to claim it before
  // the completer finishes it, and the completer's clock tick while
  // operations come (it sleeps without a timeout after kIdleAfter without
  // any, and is then woken by the next).
  static constexpr absl::Duration kGrace = absl::Milliseconds(10);
  static constexpr absl::Duration kTick = absl::Milliseconds(50);
  static constexpr absl::Duration kIdleAfter = absl::Seconds(1);

  // `on_error(status)` is called for every failed run/finish and returns
  // the status the operation fails with.
  GlooQueue(comm_internal::CommHealth* health,
            std::function<absl::Status(const absl::Status&)> on_error);
  ~GlooQueue();
  GlooQueue(const GlooQueue&) = delete;
  GlooQueue& operator=(const GlooQueue&) = delete;

  // Queues `op` and returns its Work. With `inline_ok` (a `run` that only
  // posts and does not block: point-to-point transfers), the calling thread
  // runs `run` itself when nothing is queued or running, saving the hop to
  // the worker; the order of operations is the same either way.
  std::unique_ptr<Work> Submit(std::shared_ptr<QueuedOp> op, bool inline_ok = false);
  // Fails every operation not yet done with `status`, now, and interrupts
  // the ones being finished.
  void FailAll(const absl::Status& status);
  // True while the worker runs an operation.
  bool busy() const;
  // Fails what is left with `status`, joins both threads and waits until no
  // waiting thread runs a claimed `finish` (which uses the communicator).
  // The caller first unblocks an operation stuck in Gloo
  // (Context::CloseConnections).
  void Stop(const absl::Status& status);

  // For the Works: waits for operation `seq` (QueuedOp::seq) until
  // `deadline`, claiming it when it can (see above).
  absl::Status Wait(const std::shared_ptr<comm_internal::PendingOp>& pending, uint64_t seq,
                    absl::Time deadline);
  // Asks the completer to finish operation `seq` (and the operations
  // before it) without waiting for a claim.
  void Hurry(uint64_t seq);

 private:
  using Ready = std::deque<std::shared_ptr<QueuedOp>>;

  void WorkerLoop();
  // Runs `op` (on the worker, or inline on the submitting thread) and hands
  // it on to be finished. Called with running_ set, without the lock.
  void RunOne(std::shared_ptr<QueuedOp> op);
  void CompleterLoop();
  // Runs `op`'s finish (when its run succeeded) and reports it done; false
  // when the finish was suspended (nothing reported).
  bool FinishOne(QueuedOp& op);
  void Forget(const QueuedOp* op);
  // When the completer should finish `op` if nobody claims it. Lock held.
  absl::Time Due(const QueuedOp& op) const;
  // Whether the completer must be woken for an operation due at `due`
  // (InfinitePast: now) to be finished in time. Lock held.
  bool NeedsCompleter(absl::Time due, absl::Time now) const;
  // Finishes the claimed operations in order; returns those not finished
  // because the claim's time ran out or a finish was suspended.
  Ready FinishClaimed(Ready claimed);

  comm_internal::CommHealth* const health_;
  const std::function<absl::Status(const absl::Status&)> on_error_;
  mutable std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<std::shared_ptr<QueuedOp>> to_run_;
  // Run and waiting to be finished, in issue order.
  Ready to_finish_;
  // Every submitted operation not yet completed, by seq, for FailAll.
  std::map<uint64_t, std::shared_ptr<QueuedOp>> live_;
  uint64_t next_seq_ = 0;
  // Operations before this one are due at once (Hurry).
  uint64_t hurried_upto_ = 0;
  bool running_ = false;
  // Operations handed on to be finished and not yet completed.
  int finishing_ = 0;
  // The completer is finishing an operation.
  bool completer_busy_ = false;
  // When the sleeping completer wakes by itself (InfiniteFuture: not
  // before it is notified; InfinitePast: it is awake).
  absl::Time completer_wakes_ = absl::InfinitePast();
  // Until when the completer ticks (the last claimable operation + kIdleAfter).
  absl::Time ticking_until_ = absl::InfinitePast();
  // The claim in progress, if any: only one thread claims at a time. Stop
  // waits on claim_cv_ for it to end.
  bool claimed_ = false;
  std::condition_variable claim_cv_;
  absl::Time claim_until_;
  QueuedOp* claim_current_ = nullptr;  // whose finish runs on the claiming thread
  bool claim_expired_ = false;
  bool stop_ = false;
  std::thread worker_;
  std::thread completer_;
};

}  // namespace strata::gloo
