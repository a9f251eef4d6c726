#include "comm/nccl/nccl_watchdog.h"

#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "strata/base/status.h"

namespace strata::nccl {

using comm_internal::PendingOp;

CommTracker::CommTracker(std::string where, TrackerHooks hooks)
    : health_(std::move(where)), hooks_(std::move(hooks)) {}

CommTracker::~CommTracker() { Close(); }

void CommTracker::Close() {
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;
  FailPendingLocked(absl::CancelledError(absl::StrCat(
      health_.where(), ": the communicator was destroyed with the operation pending")));
}

void CommTracker::Add(std::shared_ptr<PendingOp> op, void* event) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!health_.healthy() || closed_) {
    // Failed between the caller's check and now: the work fails at once.
    absl::Status h = closed_ ? absl::CancelledError(absl::StrCat(health_.where(), " was destroyed"))
                             : health_.Health();
    op->Complete(absl::Status(h.code(), absl::StrCat(op->description(), ": ", h.message())));
    if (hooks_.release_event) hooks_.release_event(event);
    return;
  }
  entries_.push_back(Entry{std::move(op), event});
}

absl::Status CommTracker::FindFailureLocked(absl::Time now) {
  // Completions first, in issue order: an operation whose event fired has
  // completed even if the communicator fails afterwards.
  while (!entries_.empty()) {
    Entry& e = entries_.front();
    absl::StatusOr<bool> fired = hooks_.query_event(e.event);
    if (!fired.ok()) {
      return absl::Status(fired.status().code(), absl::StrCat(e.op->description(),
                                                              ": CUDA reported an error while it "
                                                              "ran: ",
                                                              fired.status().message()));
    }
    if (!*fired) break;
    e.op->Complete(absl::OkStatus());
    if (hooks_.release_event) hooks_.release_event(e.event);
    entries_.pop_front();
  }
  if (hooks_.async_error) {
    absl::Status async = hooks_.async_error();
    if (!async.ok()) {
      std::string in_flight =
          entries_.empty()
              ? std::string("no operation in flight")
              : absl::StrCat("while ", entries_.front().op->description(), " was in flight");
      absl::Status s(async.code(), absl::StrCat(health_.where(),
                                                ": NCCL reported an "
                                                "asynchronous error ",
                                                in_flight, ": ", async.message()));
      async.ForEachPayload(
          [&](absl::string_view url, const absl::Cord& payload) { s.SetPayload(url, payload); });
      return s;
    }
  }
  for (const Entry& e : entries_) {
    if (now > e.op->deadline()) {
      return absl::DeadlineExceededError(absl::StrCat(
          e.op->description(), ": did not complete by its deadline (",
          absl::FormatTime(e.op->deadline()),
          "); a peer may have failed or stopped issuing operations. The communicator is "
          "marked failed: abort or revoke it, then shrink it or build a new one"));
    }
  }
  return absl::OkStatus();
}

absl::Status CommTracker::Check(absl::Time now) {
  std::lock_guard<std::mutex> lock(mu_);
  // Already failed (and reported), or closed: the hooks must not run.
  if (closed_ || !health_.healthy()) return absl::OkStatus();
  absl::Status failure = FindFailureLocked(now);
  if (failure.ok()) return failure;
  health_.SetFailed(failure);
  FailPendingLocked(failure);
  if (hooks_.on_failure) hooks_.on_failure(failure);
  return failure;
}

void CommTracker::Fail(const absl::Status& status) {
  std::lock_guard<std::mutex> lock(mu_);
  const bool first = health_.healthy();
  health_.SetFailed(status);
  FailPendingLocked(health_.Health());
  if (first && hooks_.on_failure) hooks_.on_failure(status);
}

void CommTracker::AbortPending() {
  std::lock_guard<std::mutex> lock(mu_);
  health_.SetAborted();
  FailPendingLocked(absl::AbortedError(
      absl::StrCat(health_.where(), ": the communicator was aborted by this rank")));
}

void CommTracker::FailPendingLocked(const absl::Status& status) {
  for (Entry& e : entries_) {
    absl::Status s(status.code(), absl::StrCat(e.op->description(), ": ", status.message()));
    status.ForEachPayload(
        [&](absl::string_view url, const absl::Cord& payload) { s.SetPayload(url, payload); });
    e.op->Complete(s);
    // The event may never fire now; destroying it is still safe (CUDA
    // releases it once the stream passes it).
    if (hooks_.release_event) hooks_.release_event(e.event);
  }
  entries_.clear();
}

size_t CommTracker::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

// ---- Watchdog -----------------------------------------------------------------

void ReportFailureToStderr(const absl::Status& status) {
  std::fprintf(stderr, "strata: NCCL watchdog: %s\n", std::string(status.message()).c_str());
}

Watchdog::Watchdog(WatchdogOptions options) : options_(std::move(options)) {
  STRATA_CHECK(options_.interval > absl::ZeroDuration(), "watchdog interval ",
               absl::FormatDuration(options_.interval));
  if (options_.start_thread) thread_ = std::thread([this] { Loop(); });
}

Watchdog::~Watchdog() {
  STRATA_CHECK(!thread_.joinable() || thread_.get_id() != std::this_thread::get_id(),
               "the NCCL watchdog's thread dropped the last owner of its watchdog");
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Watchdog::Add(const std::shared_ptr<CommTracker>& tracker) {
  std::lock_guard<std::mutex> lock(mu_);
  trackers_.push_back(tracker);
}

size_t Watchdog::watched() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& t : trackers_) n += t.expired() ? 0 : 1;
  return n;
}

std::vector<absl::Status> Watchdog::PollOnce() {
  std::vector<std::shared_ptr<CommTracker>> live;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::weak_ptr<CommTracker>> keep;
    for (auto& weak : trackers_) {
      if (std::shared_ptr<CommTracker> t = weak.lock()) {
        live.push_back(std::move(t));
        keep.push_back(std::move(weak));
      }
    }
    trackers_.swap(keep);
  }
  // Outside the lock: a check queries CUDA and NCCL, and a report may log.
  std::vector<absl::Status> reported;
  const absl::Time now = options_.now ? options_.now() : absl::Now();
  for (const auto& t : live) {
    absl::Status s = t->Check(now);
    if (s.ok()) continue;
    if (options_.report) {
      options_.report(s);
    } else {
      ReportFailureToStderr(s);
    }
    reported.push_back(std::move(s));
  }
  return reported;
}

void Watchdog::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, absl::ToChronoNanoseconds(options_.interval));
    if (stop_) break;
    lock.unlock();
    PollOnce();
    lock.lock();
  }
}

}  // namespace strata::nccl
