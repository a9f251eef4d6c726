#include "comm/gloo/gloo_queue.h"

#include <pthread.h>

#include <algorithm>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace strata::gloo {
namespace {

constexpr char kSuspendedUrl[] = "strata.gloo/suspended";

bool Claimable(const QueuedOp& op) { return !op.finish || op.suspend; }

// The Work of a queued operation: waits through the queue (which lets the
// waiter finish the operation itself), and asks the completer to finish
// what is tested for or dropped unfinished.
class QueuedWork final : public Work {
 public:
  QueuedWork(std::shared_ptr<GlooQueue> queue, std::shared_ptr<comm_internal::PendingOp> op,
             uint64_t seq)
      : queue_(std::move(queue)), op_(std::move(op)), seq_(seq) {}
  ~QueuedWork() override {
    if (!op_->done()) queue_->Hurry(seq_);
  }
  absl::Status DoWait(absl::Time deadline) override { return queue_->Wait(op_, seq_, deadline); }
  absl::StatusOr<bool> Test() override {
    if (!op_->done()) queue_->Hurry(seq_);
    return op_->Test();
  }
  std::string Describe() const override { return op_->description(); }

 private:
  const std::shared_ptr<GlooQueue> queue_;
  const std::shared_ptr<comm_internal::PendingOp> op_;
  const uint64_t seq_;
};

}  // namespace

absl::Status Suspended() {
  absl::Status s = absl::CancelledError("the wait for this transfer was suspended");
  s.SetPayload(kSuspendedUrl, absl::Cord());
  return s;
}

bool IsSuspended(const absl::Status& s) {
  return s.code() == absl::StatusCode::kCancelled && s.GetPayload(kSuspendedUrl).has_value();
}

GlooQueue::GlooQueue(comm_internal::CommHealth* health,
                     std::function<absl::Status(const absl::Status&)> on_error)
    : health_(health), on_error_(std::move(on_error)) {
  worker_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "strata-gloo-run");
    WorkerLoop();
  });
  completer_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "strata-gloo-fin");
    CompleterLoop();
  });
}

GlooQueue::~GlooQueue() {
  Stop(absl::AbortedError("the communicator was destroyed with the operation pending"));
}

std::unique_ptr<Work> GlooQueue::Submit(std::shared_ptr<QueuedOp> op, bool inline_ok) {
  std::unique_ptr<QueuedWork> work;
  {
    std::unique_lock<std::mutex> lock(mu_);
    op->seq = next_seq_++;
    work = std::make_unique<QueuedWork>(shared_from_this(), op->pending, op->seq);
    live_.emplace(op->seq, op);
    if (!(inline_ok && !stop_ && !running_ && to_run_.empty())) {
      to_run_.push_back(std::move(op));
      lock.unlock();
      work_cv_.notify_one();
      return work;
    }
    running_ = true;  // the worker waits until this run is done
  }
  RunOne(std::move(op));  // wakes the worker for what was submitted meanwhile
  return work;
}

bool GlooQueue::busy() const {
  std::lock_guard<std::mutex> lock(mu_);
  return running_;
}

void GlooQueue::FailAll(const absl::Status& status) {
  std::vector<std::shared_ptr<QueuedOp>> live;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [seq, op] : live_) live.push_back(op);
  }
  for (const auto& op : live) {
    op->pending->Complete(absl::Status(
        status.code(), absl::StrCat(op->pending->description(), ": ", status.message())));
    if (op->interrupt) op->interrupt();
  }
  // Failed operations are due at once (Due): the completer drops them.
  done_cv_.notify_all();
}

void GlooQueue::Stop(const absl::Status& status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_ && !worker_.joinable()) return;
    stop_ = true;
  }
  FailAll(status);
  work_cv_.notify_all();
  done_cv_.notify_all();
  if (worker_.joinable()) worker_.join();
  if (completer_.joinable()) completer_.join();
  {
    // A thread waiting for a Work may be running a claimed `finish`, which
    // uses the communicator (FailAll interrupted it): the communicator may
    // only go once it is out. Later waits cannot claim (stop_).
    std::unique_lock<std::mutex> lock(mu_);
    claim_cv_.wait(lock, [this] { return !claimed_; });
  }
  // What the worker never ran (failed above); Works may keep the queue.
  std::lock_guard<std::mutex> lock(mu_);
  to_run_.clear();
  live_.clear();
}

void GlooQueue::Forget(const QueuedOp* op) {
  std::lock_guard<std::mutex> lock(mu_);
  live_.erase(op->seq);
}

absl::Time GlooQueue::Due(const QueuedOp& op) const {
  if (stop_ || op.seq < hurried_upto_ || !op.run_status.ok() || !Claimable(op) || !op.finish ||
      op.pending->done()) {
    return absl::InfinitePast();
  }
  return op.ready_since + kGrace;
}

bool GlooQueue::NeedsCompleter(absl::Time due, absl::Time now) const {
  if (completer_wakes_ == absl::InfinitePast()) return false;  // awake: it looks again
  if (due <= now) return true;
  return completer_wakes_ > due + kTick;  // a tick late is fine
}

void GlooQueue::WorkerLoop() {
  while (true) {
    std::shared_ptr<QueuedOp> op;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [this] { return stop_ || (!to_run_.empty() && !running_); });
      if (stop_) return;
      op = std::move(to_run_.front());
      to_run_.pop_front();
      running_ = true;
    }
    RunOne(std::move(op));
  }
}

void GlooQueue::RunOne(std::shared_ptr<QueuedOp> op) {
  const comm_internal::PendingOp& p = *op->pending;
  absl::Status s = p.done() ? absl::OkStatus() : health_->CheckUsable(p.description());
  if (s.ok() && !p.done()) {
    const absl::Duration left = p.deadline() - absl::Now();
    if (left <= absl::ZeroDuration()) {
      s = on_error_(absl::DeadlineExceededError(
          absl::StrCat(p.description(),
                       ": its timeout passed before it could start (earlier operations on the "
                       "communicator took the time)")));
    } else {
      op->pending->Started();
      s = op->run(left);
      if (!s.ok()) s = on_error_(s);
    }
  }
  bool wake_completer = false;
  bool wake_worker = false;
  {
    std::unique_lock<std::mutex> lock(mu_);
    running_ = false;
    // Operations submitted while this one ran wait for the worker (which
    // looks again by itself when it ran this one).
    wake_worker = !to_run_.empty();
    // Nothing to finish and no earlier operation still to be finished:
    // complete here, in issue order still, and save the waiter a hop
    // through another thread (on a loaded machine each hop can cost a
    // scheduler time slice).
    if (!op->finish && finishing_ == 0) {
      lock.unlock();
      if (wake_worker) work_cv_.notify_one();
      op->pending->Complete(s);
      Forget(op.get());
      return;
    }
    ++finishing_;
    const absl::Time now = absl::Now();
    op->run_status = std::move(s);
    op->ready_since = now;
    if (op->suspend) ticking_until_ = now + kIdleAfter;
    to_finish_.push_back(op);
    // The completer looks at the first operation only.
    wake_completer = !claimed_ && to_finish_.size() == 1 && NeedsCompleter(Due(*op), now);
  }
  if (wake_worker) work_cv_.notify_one();
  if (wake_completer) done_cv_.notify_one();
}

bool GlooQueue::FinishOne(QueuedOp& op) {
  absl::Status s = op.run_status;
  if (s.ok() && op.finish && !op.pending->done()) {
    s = op.finish(op.pending->deadline());
    if (IsSuspended(s)) return false;
    if (!s.ok()) s = on_error_(s);
  }
  op.pending->Complete(s);
  Forget(&op);
  std::lock_guard<std::mutex> lock(mu_);
  --finishing_;
  return true;
}

void GlooQueue::CompleterLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    completer_wakes_ = absl::InfinitePast();
    const absl::Time now = absl::Now();
    absl::Time wake =
        now < ticking_until_ ? std::min(ticking_until_, now + kTick) : absl::InfiniteFuture();
    if (claimed_) {
      // Keep the claiming waiter's time.
      if (!claim_expired_ && now >= claim_until_) {
        claim_expired_ = true;
        if (claim_current_ != nullptr && claim_current_->suspend) claim_current_->suspend();
      }
      if (!claim_expired_) wake = std::min(wake, claim_until_);
    } else if (!to_finish_.empty()) {
      const absl::Time due = Due(*to_finish_.front());
      if (due <= now) {
        std::shared_ptr<QueuedOp> op = std::move(to_finish_.front());
        to_finish_.pop_front();
        completer_busy_ = true;
        lock.unlock();
        // Only a claiming waiter's finish is suspended; a late request
        // meant for one is dropped by the next wait.
        while (!FinishOne(*op)) {
        }
        lock.lock();
        completer_busy_ = false;
        continue;
      }
      wake = std::min(wake, due);
    } else if (stop_) {
      return;
    }
    completer_wakes_ = wake;
    if (wake == absl::InfiniteFuture()) {
      done_cv_.wait(lock);
    } else {
      done_cv_.wait_until(lock, absl::ToChronoTime(wake));
    }
  }
}

void GlooQueue::Hurry(uint64_t seq) {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (seq < hurried_upto_) return;
    // Operations finish in order: the ones before it are due too.
    hurried_upto_ = seq + 1;
    wake = !claimed_ && !to_finish_.empty() && NeedsCompleter(absl::InfinitePast(), absl::Now());
  }
  if (wake) done_cv_.notify_one();
}

GlooQueue::Ready GlooQueue::FinishClaimed(Ready claimed) {
  while (!claimed.empty()) {
    QueuedOp& op = *claimed.front();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (claim_expired_) break;
      claim_current_ = &op;
    }
    const bool finished = FinishOne(op);
    {
      std::lock_guard<std::mutex> lock(mu_);
      claim_current_ = nullptr;
    }
    if (!finished) break;
    claimed.pop_front();
  }
  return claimed;
}

absl::Status GlooQueue::Wait(const std::shared_ptr<comm_internal::PendingOp>& pending, uint64_t seq,
                             absl::Time deadline) {
  while (!pending->done()) {
    Ready claimed;
    bool wake = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      const absl::Time now = absl::Now();
      // In issue order: each operation is claimed once, so the scans of
      // the claimed prefix cost O(1) per operation.
      auto it = std::lower_bound(to_finish_.begin(), to_finish_.end(), seq,
                                 [](const auto& op, uint64_t s) { return op->seq < s; });
      const bool can_claim =
          !stop_ && !claimed_ && !completer_busy_ && deadline > now && it != to_finish_.end() &&
          (*it)->seq == seq &&
          std::all_of(to_finish_.begin(), it + 1, [](const auto& op) { return Claimable(*op); });
      if (!can_claim) {
        lock.unlock();
        Hurry(seq);  // the completer finishes it
        break;
      }
      claimed.assign(std::make_move_iterator(to_finish_.begin()), std::make_move_iterator(it + 1));
      to_finish_.erase(to_finish_.begin(), it + 1);
      claimed_ = true;
      claim_until_ = deadline;
      claim_expired_ = false;
      // The completer keeps the claim's time.
      wake = completer_wakes_ != absl::InfinitePast() && completer_wakes_ > deadline;
    }
    if (wake) done_cv_.notify_one();
    Ready left = FinishClaimed(std::move(claimed));
    {
      std::lock_guard<std::mutex> lock(mu_);
      to_finish_.insert(to_finish_.begin(), std::make_move_iterator(left.begin()),
                        std::make_move_iterator(left.end()));
      claimed_ = false;
      claim_expired_ = false;
      wake =
          stop_ || (!to_finish_.empty() && NeedsCompleter(Due(*to_finish_.front()), absl::Now()));
    }
    claim_cv_.notify_all();
    if (wake) done_cv_.notify_one();
    // Suspended before the deadline (a request that came late for an
    // earlier wait): claim again.
    if (!left.empty() && absl::Now() >= deadline) break;
  }
  return pending->Wait(deadline);
}

}  // namespace strata::gloo
