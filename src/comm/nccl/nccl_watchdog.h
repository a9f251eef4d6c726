// The NCCL backend's failure detection: each communicator's in-flight
// operations (CommTracker) and the thread that polls them (Watchdog). Each
// root communicator's family owns one Watchdog (nccl_communicator.h), at
// that root's interval; nothing is shared between roots.
//
// NCCL reports a lost peer or a network error only when asked
// (ncclCommGetAsyncError), and a collective stuck on a dead peer never
// completes, so somebody must look. The watchdog thread polls every
// communicator every `interval`: it completes operations whose CUDA event
// has fired, fails the communicator when NCCL reports an asynchronous error
// or when an operation passes its deadline, and reports that once (rank,
// group and operation) through `report`. A caller blocked in Work::Wait
// polls the same way, so completion does not wait for the next tick.
//
// CommTracker sees CUDA and NCCL only through TrackerHooks, so its logic is
// tested on CPU with fake events, a fake async error and a fake clock.
//
//   auto tracker = std::make_shared<CommTracker>(where, hooks);
//   watchdog->Add(tracker);
//   tracker->Add(op, event);                 // after enqueuing the NCCL call
//   ... watchdog thread: tracker->Check(now) ...
//
// Thread-safety: both classes are thread-safe.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "comm/common/health.h"
#include "comm/common/pending_op.h"

namespace strata::nccl {

// How a tracker reaches CUDA and NCCL.
struct TrackerHooks {
  // Whether the completion marker (a cudaEvent_t) has fired; an error when
  // CUDA reports one.
  std::function<absl::StatusOr<bool>(void* event)> query_event;
  // Releases a completion marker.
  std::function<void(void* event)> release_event;
  // ncclCommGetAsyncError: OK while healthy (or still in progress).
  std::function<absl::Status()> async_error;
  // Called once, with the failure, when the communicator fails (the
  // backend marks its split family so that every member is released with
  // abort). May be null.
  std::function<void(const absl::Status&)> on_failure;
};

// One communicator's health and in-flight operations, in issue order.
class CommTracker {
 public:
  // `where`: "group tp (rank 1 of 2, world rank 3)".
  CommTracker(std::string where, TrackerHooks hooks);
  ~CommTracker();

  comm_internal::CommHealth& health() { return health_; }
  const std::string& where() const { return health_.where(); }

  // Tracks `op`, complete when `event` fires. Takes ownership of `event`.
  void Add(std::shared_ptr<comm_internal::PendingOp> op, void* event);
  // Completes the operations whose events fired; then, if the communicator
  // is still healthy, looks for a failure: an error from an event, an
  // asynchronous NCCL error, an operation past its deadline at `now`. On
  // one, marks the communicator failed and fails every pending operation.
  // Returns that failure when this call found it (so it is reported once),
  // OK otherwise.
  absl::Status Check(absl::Time now);
  // Marks the communicator failed with `status` (the first failure wins) and
  // fails every pending operation with the communicator's error.
  void Fail(const absl::Status& status);
  // After an abort: fails every pending operation with Aborted.
  void AbortPending();
  // Before the communicator's NCCL handle goes away: fails every pending
  // operation (Cancelled) and stops every later use of the hooks. Waits for
  // a Check in progress to finish.
  void Close();
  size_t pending() const;

 private:
  struct Entry {
    std::shared_ptr<comm_internal::PendingOp> op;
    void* event;
  };
  absl::Status FindFailureLocked(absl::Time now);
  void FailPendingLocked(const absl::Status& status);

  comm_internal::CommHealth health_;
  const TrackerHooks hooks_;
  mutable std::mutex mu_;
  bool closed_ = false;
  std::deque<Entry> entries_;
};

// The one line a communicator failure is reported with (stderr):
// "strata: NCCL watchdog: <status message>". Used by the watchdog, and by a
// waiter that finds the failure first, so that each failure is logged once
// whoever finds it.
void ReportFailureToStderr(const absl::Status& status);

struct WatchdogOptions {
  // Positive (NcclOptions::watchdog_interval is checked before it gets
  // here).
  absl::Duration interval = absl::Milliseconds(10);
  // The clock (tests inject a fake one); null: absl::Now.
  std::function<absl::Time()> now;
  // Where failures are reported; null: stderr, one line each.
  std::function<void(const absl::Status&)> report;
  // False: no thread; the owner calls PollOnce (tests).
  bool start_thread = true;
};

// Polls every tracker added to it, on its own thread, which the Watchdog
// owns and joins.
class Watchdog {
 public:
  explicit Watchdog(WatchdogOptions options);
  // Stops and joins the thread (never called on that thread: it holds no
  // owner of the Watchdog).
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Watches `tracker` for as long as someone else owns it (a weak reference).
  void Add(const std::shared_ptr<CommTracker>& tracker);
  // One round over every tracker; returns the failures it reported.
  std::vector<absl::Status> PollOnce();
  size_t watched() const;
  absl::Duration interval() const { return options_.interval; }

 private:
  void Loop();

  const WatchdogOptions options_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::vector<std::weak_ptr<CommTracker>> trackers_;
  std::thread thread_;
};

}  // namespace strata::nccl
