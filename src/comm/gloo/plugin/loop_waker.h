// Keeping Gloo's TCP event loop turning while strata connects, closes or
// destroys pairs (the Gloo plugin, gloo_plugin.cc).
//
// Gloo's TCP event loop sleeps in epoll_wait for up to 10 ms at a time,
// and a thread that takes a socket off it waits for the loop's next turn:
// a pair that connects as the client gives up its listening socket that
// way, and closing a pair does. Pair by pair, that made connecting a group
// of 4 ranks take 7-25 ms and destroying a World's communicators 14 ms
// (timestamps across the processes of benchmarks/run_rejoin.py), on the
// path of every regroup. A LoopWaker is an eventfd on the device's loop;
// while a Ticking lives, a thread writes to it every kTickEvery, so each
// such wait ends within about that.
//
//   auto waker = std::make_shared<LoopWaker>(tcp_device);  // one per device
//   { Ticking ticking(waker.get()); pair->connect(peer); }
//
// Thread-safety: Wake may be called from any thread while the waker lives;
// the handler runs on the loop's thread. A Ticking must not outlive its
// waker.
#pragma once

#include <gloo/transport/tcp/device.h>
#include <gloo/transport/tcp/loop.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

namespace strata::gloo_plugin {

inline constexpr std::chrono::microseconds kTickEvery{200};

class LoopWaker final : public ::gloo::transport::tcp::Handler {
 public:
  // Registers an eventfd on `device`'s loop; throws std::runtime_error
  // when the eventfd cannot be made.
  explicit LoopWaker(std::shared_ptr<::gloo::transport::tcp::Device> device);
  ~LoopWaker() override;
  LoopWaker(const LoopWaker&) = delete;
  LoopWaker& operator=(const LoopWaker&) = delete;

  // On the loop's thread: drains the eventfd.
  void handleEvents(int events) override;
  // Makes the loop take a turn.
  void Wake();

 private:
  std::shared_ptr<::gloo::transport::tcp::Device> device_;
  const int fd_;
  std::mutex mu_;  // held by the handler
};

// Keeps the loop of `waker` turning while it lives (null: does nothing).
class Ticking {
 public:
  explicit Ticking(LoopWaker* waker);
  ~Ticking();
  Ticking(const Ticking&) = delete;
  Ticking& operator=(const Ticking&) = delete;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace strata::gloo_plugin
