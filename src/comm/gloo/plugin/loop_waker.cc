// Keeping Gloo's TCP event loop turning (loop_waker.h).
#include "comm/gloo/plugin/loop_waker.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

namespace strata::gloo_plugin {

LoopWaker::LoopWaker(std::shared_ptr<::gloo::transport::tcp::Device> device)
    : device_(std::move(device)), fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
  if (fd_ < 0) throw std::runtime_error(std::string("eventfd: ") + std::strerror(errno));
  device_->registerDescriptor(fd_, EPOLLIN, this);
}

LoopWaker::~LoopWaker() {
  // Gloo's unregister waits for the loop's next turn (at most 10 ms, once
  // per device); a turn that was in this handler has ended then. The lock
  // makes that order one ThreadSanitizer sees too (Gloo's own wait does
  // not hold the loop's mutex when it signals).
  device_->unregisterDescriptor(fd_, this);
  std::lock_guard<std::mutex> lock(mu_);
  close(fd_);
}

void LoopWaker::handleEvents(int /*events*/) {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t count;
  while (read(fd_, &count, sizeof(count)) == static_cast<ssize_t>(sizeof(count))) {
  }
}

void LoopWaker::Wake() {
  const uint64_t one = 1;
  (void)!write(fd_, &one, sizeof(one));
}

Ticking::Ticking(LoopWaker* waker) {
  if (waker == nullptr) return;
  thread_ = std::thread([this, waker] {
    std::unique_lock<std::mutex> lock(mu_);
    while (!done_) {
      waker->Wake();
      cv_.wait_for(lock, kTickEvery);
    }
  });
}

Ticking::~Ticking() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
  }
  cv_.notify_one();
  thread_.join();
}

}  // namespace strata::gloo_plugin
