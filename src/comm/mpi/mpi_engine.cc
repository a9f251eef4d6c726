#include "comm/mpi/mpi_engine.h"

#include <algorithm>
#include <climits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "comm/common/host_share.h"
#include "strata/base/status.h"

namespace strata::mpi {
namespace {

// Errors after which the communicator cannot be used any more: a lost
// peer, a revocation, a passed deadline.
bool BreaksCommunicator(const absl::Status& status) {
  return status.GetPayload(kRankFailurePayload).has_value() ||
         status.code() == absl::StatusCode::kAborted ||
         status.code() == absl::StatusCode::kUnavailable ||
         status.code() == absl::StatusCode::kDeadlineExceeded;
}

bool AllNull(const std::vector<MPI_Request>& requests) {
  return std::all_of(requests.begin(), requests.end(),
                     [](MPI_Request r) { return r == MPI_REQUEST_NULL; });
}

// The first error among the statuses of a failed MPI_Testall.
int FirstError(int rc, const std::vector<MPI_Status>& statuses) {
  if (rc != MPI_ERR_IN_STATUS) return rc;
  for (const MPI_Status& s : statuses) {
    if (s.MPI_ERROR != MPI_SUCCESS && s.MPI_ERROR != MPI_ERR_PENDING) return s.MPI_ERROR;
  }
  return rc;
}

std::string Readable(absl::Duration d) {
  return absl::FormatDuration(absl::Trunc(d, absl::Milliseconds(1)));
}

}  // namespace

// ---- CommState --------------------------------------------------------------

namespace {

int RankIn(MPI_Comm comm) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  return rank;
}

int SizeOf(MPI_Comm comm) {
  int size = 1;
  MPI_Comm_size(comm, &size);
  return size;
}

}  // namespace

CommState::CommState(MPI_Comm comm, MPI_Comm ctrl, std::string name, int world_rank,
                     std::string uid)
    : comm_(comm),
      ctrl_(ctrl),
      name_(std::move(name)),
      rank_(RankIn(comm_)),
      size_(SizeOf(comm_)),
      world_rank_(world_rank),
      uid_(std::move(uid)),
      health_(absl::StrCat("group ", name_, " (rank ", rank_, " of ", size_, ", world rank ",
                           world_rank_, ")")) {}

CommState::~CommState() {
  // MPI_Comm_free is local in Open MPI and lets pending operations finish;
  // after MPI_Finalize no MPI call is allowed at all.
  if (Finalized()) return;
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  if (ctrl_ != MPI_COMM_NULL) MPI_Comm_free(&ctrl_);
}

// ---- Wakeup -----------------------------------------------------------------

void Wakeup::AddWaiter() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++waiters_;
    ++kicks_;
  }
  cv_.notify_all();
}

void Wakeup::RemoveWaiter() {
  std::lock_guard<std::mutex> lock(mu_);
  --waiters_;
}

void Wakeup::Kick() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++kicks_;
  }
  cv_.notify_all();
}

bool Wakeup::HasWaiters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return waiters_ > 0;
}

void Wakeup::Sleep(absl::Duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout), [this] { return kicks_ != seen_; });
  seen_ = kicks_;
}

// ---- Op ---------------------------------------------------------------------

Op::Op(std::string description, std::shared_ptr<CommState> comm, absl::Time deadline,
       absl::Duration timeout, std::shared_ptr<Wakeup> wakeup)
    : description_(std::move(description)),
      comm_(std::move(comm)),
      deadline_(deadline),
      timeout_(timeout),
      wakeup_(std::move(wakeup)) {}

bool Op::Complete(const absl::Status& status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return false;
    done_ = true;
    status_ = status;
    // Under the lock: whoever sees the operation done sees it recorded.
    if (trace != nullptr) trace->Completed(status);
  }
  cv_.notify_all();
  return true;
}

bool Op::RequestFailure(const absl::Status& status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return false;
    if (!failure_request_) failure_request_ = status;
    has_failure_request_.store(true, std::memory_order_release);
  }
  wakeup_->Kick();
  return true;
}

bool Op::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

void Op::Keep(std::shared_ptr<void> holder) {
  std::lock_guard<std::mutex> lock(mu_);
  kept_.push_back(std::move(holder));
}

absl::Status Op::Wait(absl::Time deadline) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return status_;
  }
  const absl::Time start = absl::Now();
  wakeup_->AddWaiter();
  bool done;
  absl::Status status;
  {
    std::unique_lock<std::mutex> lock(mu_);
    // In slices, since the deadline may be infinitely far away.
    while (!done_) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) break;
      cv_.wait_for(lock, absl::ToChronoNanoseconds(std::min(left, absl::Hours(1))));
    }
    done = done_;
    status = status_;
  }
  wakeup_->RemoveWaiter();
  if (done) return status;
  return absl::DeadlineExceededError(
      absl::StrCat(description_, ": not complete when the wait's deadline passed (waited ",
                   Readable(absl::Now() - start),
                   "); the operation is still in flight and may be waited for again"));
}

absl::StatusOr<bool> Op::Test() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!done_) return false;
  if (!status_.ok()) return status_;
  return true;
}

// ---- Engine -----------------------------------------------------------------

Engine::Engine(const MpiOptions& options)
    : options_(options),
      oversubscribed_(
          options.oversubscribed.value_or(comm_internal::DetectHostShare().oversubscribed())),
      max_elements_(options.max_elements_per_call == 0
                        ? static_cast<size_t>(INT_MAX)
                        : std::min(options.max_elements_per_call, static_cast<size_t>(INT_MAX))),
      wakeup_(std::make_shared<Wakeup>()) {
  RegisterExitHook(this);
  thread_ = std::thread([this] { Run(); });
}

Engine::~Engine() {
  UnregisterExitHook(this);
  Stop();
}

void Engine::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return;
    stopped_ = true;
    stop_ = true;
  }
  wakeup_->Kick();
  idle_.notify_all();
  if (thread_.joinable()) thread_.join();
  std::deque<std::shared_ptr<Op>> active;
  {
    std::lock_guard<std::mutex> lock(mu_);
    active.swap(active_);
  }
  // MPI may still write into these operations' buffers (it cannot cancel a
  // collective), so their scratch memory is kept until the process exits.
  for (const std::shared_ptr<Op>& op : active) {
    // The engine thread is gone: receives are cancelled here.
    if (op->cancel_on_failure && !Finalized()) CancelRequests(*op);
    op->Complete(absl::AbortedError(absl::StrCat(
        op->description(),
        ": the communicator's progress engine stopped with the operation in flight (the "
        "root communicator was destroyed, or the process is exiting)")));
    if (!AllNull(op->requests)) KeepUntilExit(op);
  }
  std::vector<std::shared_ptr<Op>> adopted;
  {
    std::lock_guard<std::mutex> lock(mu_);
    adopted.swap(adopted_);
  }
  for (const std::shared_ptr<Op>& op : orphans_) KeepUntilExit(op);
  for (const std::shared_ptr<Op>& op : adopted) KeepUntilExit(op);
  orphans_.clear();
}

void Engine::Submit(std::shared_ptr<Op> op) {
  op->statuses_.resize(op->requests.size());
  {
    std::lock_guard<std::mutex> lock(mu_);
    active_.push_back(std::move(op));
  }
  wakeup_->Kick();
  idle_.notify_all();
}

void Engine::Adopt(std::shared_ptr<Op> op) {
  if (AllNull(op->requests)) return;
  op->statuses_.resize(op->requests.size());
  {
    std::lock_guard<std::mutex> lock(mu_);
    adopted_.push_back(std::move(op));
  }
  wakeup_->Kick();
  idle_.notify_all();
}

void Engine::FailPending(const CommState* comm, const absl::Status& status) {
  std::vector<std::shared_ptr<Op>> cancelled;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const std::shared_ptr<Op>& op : active_) {
      if (op->comm_.get() != comm) continue;
      absl::Status failed(status.code(), absl::StrCat(op->description(), ": ", status.message()));
      if (op->cancel_on_failure) {
        // The engine thread cancels the receive, then completes it.
        if (op->RequestFailure(failed)) cancelled.push_back(op);
      } else {
        op->Complete(failed);
      }
    }
  }
  // Bounded: cancelling a receive is local (MPI 4.0, 3.8.4), and the
  // engine gives up on a request after kCancelWait.
  for (const std::shared_ptr<Op>& op : cancelled) {
    (void)op->Wait(absl::Now() + kCancelWait + absl::Seconds(1));
  }
}

void Engine::CancelRequests(Op& op) {
  bool any = false;
  for (MPI_Request& r : op.requests) {
    if (r != MPI_REQUEST_NULL) {
      MPI_Cancel(&r);
      any = true;
    }
  }
  if (!any) return;
  // A cancelled receive completes locally; one that had already matched a
  // message completes when the message is in. Either way MPI then no
  // longer touches the buffer. Should it not complete in time (a sender
  // stopped inside a transfer), the requests go to the orphans.
  const absl::Time until = absl::Now() + kCancelWait;
  std::vector<MPI_Status> statuses(op.requests.size());
  while (true) {
    int flag = 0;
    int rc = MPI_Testall(static_cast<int>(op.requests.size()), op.requests.data(), &flag,
                         statuses.data());
    if (flag || (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS) || AllNull(op.requests)) return;
    if (absl::Now() > until) return;
    absl::SleepFor(absl::Microseconds(50));
  }
}

void Engine::Orphan(std::shared_ptr<Op> op) {
  if (!AllNull(op->requests)) orphans_.push_back(std::move(op));
}

constexpr absl::Duration kOversubscribedPause = absl::Microseconds(200);

void Engine::Run() {
  absl::Time last_activity = absl::Now();
  absl::Duration pause = absl::Microseconds(20);
  while (true) {
    std::vector<std::shared_ptr<Op>> ops;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (stop_) return;
      for (std::shared_ptr<Op>& op : adopted_) orphans_.push_back(std::move(op));
      adopted_.clear();
      if (active_.empty() && orphans_.empty()) {
        idle_.wait(lock, [this] { return stop_ || !active_.empty() || !adopted_.empty(); });
        last_activity = absl::Now();
        pause = absl::Microseconds(20);
        continue;
      }
      ops.assign(active_.begin(), active_.end());
    }
    bool completed = Pass(ops);
    ReapOrphans();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      active_.erase(std::remove_if(active_.begin(), active_.end(),
                                   [](const std::shared_ptr<Op>& op) { return op->retired_; }),
                    active_.end());
    }
    const absl::Time now = absl::Now();
    if (completed) {
      last_activity = now;
      pause = absl::Microseconds(20);
    }
    if (wakeup_->HasWaiters()) {
      // Oversubscribed, a tight poll would take the core from a rank that
      // computes; a short pause costs the waiter a little latency instead.
      if (oversubscribed_) wakeup_->Sleep(kOversubscribedPause);
      continue;
    }
    if (!oversubscribed_ && now - last_activity < options_.busy_poll) continue;
    wakeup_->Sleep(pause);
    pause = std::min(pause * 2, std::max(options_.max_poll_interval, absl::Microseconds(20)));
  }
}

bool Engine::Pass(const std::vector<std::shared_ptr<Op>>& ops) {
  bool completed = false;
  const absl::Time now = absl::Now();
  // Communicators with an earlier operation still in flight: their later
  // operations wait, so that each communicator completes in issue order.
  std::vector<const CommState*> blocked;
  auto is_blocked = [&](const CommState* c) {
    return std::find(blocked.begin(), blocked.end(), c) != blocked.end();
  };
  // Ends the engine's interest in `op`: anything MPI still holds goes to the
  // orphans, and the op leaves the active list.
  auto retire = [&](const std::shared_ptr<Op>& op) {
    Orphan(op);
    op->retired_ = true;
  };
  for (const std::shared_ptr<Op>& op : ops) {
    CommState* comm = op->comm_.get();
    if (op->done()) {  // failed from outside: Abort, Revoke
      retire(op);
      continue;
    }
    std::optional<absl::Status> failure;
    if (op->has_failure_request_.load(std::memory_order_acquire)) {
      std::lock_guard<std::mutex> lock(op->mu_);
      failure.swap(op->failure_request_);
    }
    if (failure) {  // a receive failed from outside: cancelled first
      CancelRequests(*op);
      op->Complete(*failure);
      retire(op);
      completed = true;
      continue;
    }
    if (!op->mpi_done_) {
      absl::Status health = comm->Health();
      if (!health.ok()) {
        absl::Status broke(health.code(), absl::StrCat(op->description(),
                                                       ": not completed because the communicator "
                                                       "broke: ",
                                                       health.message()));
        health.ForEachPayload(
            [&](absl::string_view url, const absl::Cord& p) { broke.SetPayload(url, p); });
        op->Complete(broke);
        retire(op);
        completed = true;
        continue;
      }
      int flag = 1;
      int rc = MPI_SUCCESS;
      if (!op->requests.empty()) {
        rc = MPI_Testall(static_cast<int>(op->requests.size()), op->requests.data(), &flag,
                         op->statuses_.data());
      }
      if (rc != MPI_SUCCESS) {
        op->mpi_done_ = true;
        op->mpi_status_ = FromMpi(FirstError(rc, op->statuses_), comm->comm(), op->description());
      } else if (flag) {
        op->mpi_done_ = true;
      } else if (now > op->deadline_) {
        absl::Status late = absl::DeadlineExceededError(absl::StrCat(
            op->description(), ": did not complete within its timeout of ", Readable(op->timeout_),
            " (a peer may have failed, be stuck, or not have issued the matching call); the "
            "communicator is now unusable: revoke or abort it, then shrink or rebuild"));
        comm->SetFailed(late);
        if (op->cancel_on_failure) CancelRequests(*op);
        op->Complete(late);
        retire(op);
        completed = true;
        continue;
      }
    }
    if (!op->mpi_done_ || is_blocked(comm)) {
      blocked.push_back(comm);
      continue;
    }
    absl::Status status = op->mpi_status_;
    if (status.ok() && op->finish) status = op->finish(op->statuses_);
    if (!status.ok() && BreaksCommunicator(status)) comm->SetFailed(status);
    retire(op);  // an error may leave some requests pending
    op->Complete(status);
    completed = true;
  }
  return completed;
}

void Engine::ReapOrphans() {
  if (orphans_.empty()) return;
  std::vector<MPI_Status> statuses;
  for (std::shared_ptr<Op>& op : orphans_) {
    statuses.resize(op->requests.size());
    int flag = 0;
    int rc = MPI_Testall(static_cast<int>(op->requests.size()), op->requests.data(), &flag,
                         statuses.data());
    // An error other than "see the statuses" leaves nothing we can poll.
    if (flag || (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS) || AllNull(op->requests)) {
      op->requests.clear();
      op.reset();
    }
  }
  orphans_.erase(std::remove(orphans_.begin(), orphans_.end(), nullptr), orphans_.end());
}

absl::Status WaitRequests(Engine& engine, std::shared_ptr<Op> op, absl::Time deadline,
                          MPI_Comm comm) {
  std::vector<MPI_Status> statuses(op->requests.size());
  absl::Duration pause = absl::Microseconds(5);
  const absl::Time start = absl::Now();
  while (true) {
    int flag = 0;
    int rc = MPI_Testall(static_cast<int>(op->requests.size()), op->requests.data(), &flag,
                         statuses.data());
    absl::Status status;
    if (rc != MPI_SUCCESS) {
      status = FromMpi(FirstError(rc, statuses), comm, op->description());
    } else if (flag) {
      return absl::OkStatus();
    } else if (absl::Now() > deadline) {
      status = absl::DeadlineExceededError(absl::StrCat(
          op->description(), ": not complete after ", Readable(absl::Now() - start),
          " (every rank of the group must make the same call; a peer may have failed or be "
          "busy elsewhere)"));
    }
    if (!status.ok()) {
      engine.Adopt(std::move(op));
      return status;
    }
    absl::SleepFor(pause);
    pause = std::min(pause * 2, absl::Milliseconds(1));
  }
}

}  // namespace strata::mpi
