#include "comm/gloo/gloo_queue.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace strata::gloo {

GlooQueue::GlooQueue(comm_internal::CommHealth* health,
                     std::function<absl::Status(const absl::Status&)> on_error)
    : health_(health), on_error_(std::move(on_error)) {
  worker_ = std::thread([this] { Work(); });
  completer_ = std::thread([this] { Complete(); });
}

GlooQueue::~GlooQueue() {
  Stop(absl::AbortedError("the communicator was destroyed with the operation pending"));
}

void GlooQueue::Submit(std::shared_ptr<QueuedOp> op, bool inline_ok) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    live_.push_back(op);
    if (!(inline_ok && !stop_ && !running_ && to_run_.empty())) {
      to_run_.push_back(std::move(op));
      lock.unlock();
      work_cv_.notify_one();
      return;
    }
    running_ = true;  // the worker waits until this run is done
  }
  RunOne(std::move(op));  // wakes the worker for what was submitted meanwhile
}

bool GlooQueue::busy() const {
  std::lock_guard<std::mutex> lock(mu_);
  return running_;
}

void GlooQueue::FailAll(const absl::Status& status) {
  std::vector<std::shared_ptr<QueuedOp>> live;
  {
    std::lock_guard<std::mutex> lock(mu_);
    live = live_;
  }
  for (const auto& op : live) {
    op->pending->Complete(absl::Status(
        status.code(), absl::StrCat(op->pending->description(), ": ", status.message())));
    if (op->interrupt) op->interrupt();
  }
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
}

void GlooQueue::Forget(const QueuedOp* op) {
  std::lock_guard<std::mutex> lock(mu_);
  live_.erase(std::remove_if(live_.begin(), live_.end(),
                             [op](const std::shared_ptr<QueuedOp>& p) { return p.get() == op; }),
              live_.end());
}

void GlooQueue::Work() {
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
      s = op->run(left);
      if (!s.ok()) s = on_error_(s);
    }
  }
  {
    std::unique_lock<std::mutex> lock(mu_);
    running_ = false;
    // Nothing to finish and no earlier operation still with the completer:
    // complete here, in issue order still, and save the waiter a hop
    // through the completer thread (on a loaded machine each hop can cost a
    // scheduler time slice).
    if (!op->finish && finishing_ == 0) {
      lock.unlock();
      work_cv_.notify_one();
      op->pending->Complete(s);
      Forget(op.get());
      return;
    }
    ++finishing_;
    to_finish_.emplace_back(std::move(op), std::move(s));
  }
  work_cv_.notify_one();
  done_cv_.notify_one();
}

void GlooQueue::Complete() {
  while (true) {
    std::shared_ptr<QueuedOp> op;
    absl::Status s;
    {
      std::unique_lock<std::mutex> lock(mu_);
      done_cv_.wait(lock, [this] { return stop_ || !to_finish_.empty(); });
      if (to_finish_.empty()) return;  // stopping, nothing left
      op = std::move(to_finish_.front().first);
      s = std::move(to_finish_.front().second);
      to_finish_.pop_front();
    }
    if (s.ok() && op->finish && !op->pending->done()) {
      s = op->finish(op->pending->deadline());
      if (!s.ok()) s = on_error_(s);
    }
    op->pending->Complete(s);
    Forget(op.get());
    std::lock_guard<std::mutex> lock(mu_);
    --finishing_;
  }
}

}  // namespace strata::gloo
