// HeartbeatMonitor: one thread per rank that shows this rank is alive and
// notices when another rank is not, through the store.
//
// The monitor
//   1. bumps this rank's heartbeat key (a counter and this process's id:
//      host, boot id, pid, start time) every max(heartbeat_interval,
//      heartbeat_timeout / 10), 0.3 s by default;
//   2. as often, reads the heartbeat of ONE other rank, its ring successor
//      among the epoch's members; a value that has not changed for
//      `heartbeat_timeout` means the successor hangs (SIGSTOP, a deadlock);
//      every `heartbeat_interval`, with `probe_processes`, a successor on
//      this host whose process is gone (or a zombie) is found through /proc;
//      either raises the epoch's alarm and records the evidence under
//      suspect/<rank>;
//   3. learns of the epoch's alarm: where the store serves waits
//      (Store::waits_without_polling, the TCPStore client) a second thread
//      keeps a CancellableWait for the alarm key open (on the client's
//      connection for such waits; Watch and Stop cancel it), and the first
//      thread still looks at the key once a `heartbeat_timeout` in case
//      that wait was lost; elsewhere the first thread looks at the key
//      every `heartbeat_interval`. The first time the alarm is set, calls
//      `on_alarm` (the elastic loop has its own thread abort this rank's
//      communicators then, so a main thread blocked in a collective
//      returns at once) and checks this rank in for the agreement
//      (alive/<rank>).
// That is three store operations per beat, whatever the world size, and
// one per interval on a store that does not serve waits (with the
// defaults 10 a second, or 20: the beats need only resolve the timeout,
// while the alarm is what a recovery waits on).
// Keys carry the epoch (keys.h); Watch() moves to a new epoch. While the
// successor's key of the new epoch is absent, its key of the previous epoch
// counts (it switches a moment later than this rank).
//
// The store being unreachable for `heartbeat_timeout` is an alarm too, of
// this rank only: on_alarm is called with it and store_status() says why.
//
// Thread-safety: every method may be called from any thread; on_alarm runs
// on the thread that first sees the alarm (one of the monitor's, or a
// caller of Raise), must not call back into the monitor, and must return at once:
// the next heartbeat waits for it (work that may block, such as aborting
// communicators, belongs on a thread of the caller's). The destructor stops
// and joins the threads.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "strata/base/export.h"
#include "strata/comm/store.h"
#include "strata/elastic/event.h"
#include "strata/elastic/membership.h"
#include "strata/elastic/options.h"

namespace strata::elastic {

// Encodes and decodes a Detection for the alarm key.
STRATA_EXPORT std::string EncodeDetection(const Detection& d);
STRATA_EXPORT absl::StatusOr<Detection> DecodeDetection(absl::string_view text);

// What /proc says of the process a heartbeat names (the text after the
// heartbeat's sequence number): "alive", "stopped", "gone" (exited, a
// zombie, or its pid reused) or "on another host". InvalidArgument for a
// record that is not a process identity.
STRATA_EXPORT absl::StatusOr<std::string> ProbeHeartbeatProcess(absl::string_view process);

class STRATA_EXPORT HeartbeatMonitor {
 public:
  struct Config {
    std::shared_ptr<Store> store;
    ElasticOptions options;
    int rank = 0;  // this rank's job rank
    // Called once per epoch when the epoch's alarm is first seen (or when
    // the store cannot be reached), with the epoch it is about: by then
    // the caller may have moved on to a later epoch.
    std::function<void(const Detection&, uint64_t epoch)> on_alarm;
  };

  // Starts the thread; it watches nothing until Watch().
  explicit HeartbeatMonitor(Config config);
  ~HeartbeatMonitor();
  HeartbeatMonitor(const HeartbeatMonitor&) = delete;
  HeartbeatMonitor& operator=(const HeartbeatMonitor&) = delete;

  // Watches `membership`'s epoch from now on (this rank must be a member).
  void Watch(const Membership& membership);

  // Raises the current epoch's alarm with `cause` unless one is set (the
  // first cause wins) and returns the winning cause. The monitor then reacts
  // as to any alarm (on_alarm, check-in), on this thread, before returning.
  absl::StatusOr<Detection> Raise(const Detection& cause);

  // The current epoch's alarm once this rank knows it, and when (local
  // wall clock) it first did.
  std::optional<Detection> alarm() const;
  absl::Time known_at() const;
  // OK, or why the store could not be reached.
  absl::Status store_status() const;

  // Checks this rank in for the current epoch's agreement (once per epoch;
  // later calls do nothing). `suspects` are job ranks this rank knows to
  // have failed (a backend's report).
  absl::Status CheckIn(const std::vector<int>& suspects);

  // Job ranks this rank's last regroup could not connect to though they
  // took part in its rendezvous (kUnreachablePayload): sent with this
  // rank's next check-in (the one of the alarm the failed regroup raises),
  // for the leader to weigh against the others' reports (agreement.h).
  void ReportUnreachable(const std::vector<int>& ranks);

  // Stops and joins the thread (idempotent).
  void Stop();

 private:
  struct Epoch;
  void Run();
  // The alarm thread's (when the store waits without polling): waits for
  // each epoch's alarm key and reacts the moment it is set.
  void WaitForAlarms();
  // The successor's part of a pass: reads its heartbeat (when `read`),
  // probes its process, raises the alarm when it is gone or stale.
  void Tick(Epoch& epoch, bool read);
  void OnAlarm(Epoch& epoch, const Detection& alarm);
  absl::StatusOr<Detection> RaiseIn(Epoch& epoch, const Detection& cause);
  // Checks in for `epoch`: store I/O, under checkin_mu_ only (never mu_,
  // which the training thread's Raise and alarm() take).
  absl::Status CheckInOn(Epoch& epoch, const std::vector<int>& suspects);

  const Config config_;
  std::mutex checkin_mu_;  // one check-in at a time
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::shared_ptr<Epoch> epoch_;  // guarded by mu_
  absl::Status store_status_;     // guarded by mu_: not OK once the store is lost
  std::vector<int> unreachable_;  // guarded by mu_: for the next check-in
  std::thread thread_;
  std::thread alarm_thread_;
  WaitCancel wake_;                        // ends the alarm thread's wait: a new epoch, Stop()
  std::atomic<bool> alarm_waited_{false};  // the alarm thread is waiting
};

}  // namespace strata::elastic
