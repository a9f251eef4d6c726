#include "comm/gloo/plugin/connect_watch.h"

#include <utility>

namespace strata::gloo_plugin {

ConnectWatch::ConnectWatch(int64_t timeout_ms, std::function<bool()> stop,
                           std::function<void()> fail)
    : stop_(std::move(stop)), fail_(std::move(fail)) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  thread_ = std::thread([this, deadline] { Run(deadline); });
}

ConnectWatch::~ConnectWatch() { Stop(); }

void ConnectWatch::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

ConnectWatch::Why ConnectWatch::why() const {
  std::lock_guard<std::mutex> lock(mu_);
  return why_;
}

void ConnectWatch::Run(std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  while (!done_) {
    Why why = Why::kNone;
    if (stop_ && stop_()) {
      why = Why::kCancelled;
    } else if (std::chrono::steady_clock::now() >= deadline) {
      why = Why::kDeadline;
    }
    if (why != Why::kNone) {
      why_ = why;
      lock.unlock();
      fail_();
      return;
    }
    cv_.wait_for(lock, kWatchEvery);
  }
}

}  // namespace strata::gloo_plugin
