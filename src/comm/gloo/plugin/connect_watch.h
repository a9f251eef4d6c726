// Ending a Gloo connect that waits for a peer which will never come (the
// Gloo plugin's Connect, gloo_plugin.cc).
//
// Gloo's TCP pair connect blocks until the peer connects, for up to five
// times the context's timeout, and nothing outside it ends the wait but a
// failed pair. A survivor that shrinks a communicator while another
// survivor dies sat there long after the elastic layer knew and had
// aborted the old communicator (tests/python/test_elastic_repeat.py under
// torchrun: survivors stuck in one regroup for about two minutes). While a
// ConnectWatch lives, a thread asks `stop` every kWatchEvery and, the first
// time it answers true or the deadline passes, calls `fail` once, which
// fails every pair: the connect in progress throws, and so does the next.
//
//   ConnectWatch watch(timeout_ms, [&] { return rv.Cancelled(); },
//                      [transport] { FailPairs(transport.get(), "..."); });
//   ... pair->connect(...) for each peer ...
//   watch.Stop();
//   if (watch.why() != ConnectWatch::Why::kNone) ... (gave up)
//
// Thread-safety: `stop` and `fail` run on the watch's thread; why() may be
// called from any thread.
#pragma once

#include <gloo/transport/context.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace strata::gloo_plugin {

inline constexpr std::chrono::milliseconds kWatchEvery{1};

// Fails every pair of `transport` with `message` (Gloo's TCP
// signalException): a connect, send or receive waiting on one throws it,
// and so does the next; peers see the connection close. False where this
// Gloo lacks the means (the caller then closes the sockets). Thread-safe
// once every pair of `transport` has been created.
bool FailPairs(::gloo::transport::Context* transport, const std::string& message);

class ConnectWatch {
 public:
  // Watches until destroyed: `stop()` true (the caller gave up: aborted)
  // or `timeout_ms` passed (a peer did not come) makes the watch call
  // `fail()` once.
  ConnectWatch(int64_t timeout_ms, std::function<bool()> stop, std::function<void()> fail);
  ~ConnectWatch();  // Stop()
  ConnectWatch(const ConnectWatch&) = delete;
  ConnectWatch& operator=(const ConnectWatch&) = delete;

  // Ends the watch (waits for its thread); why() is final after it.
  void Stop();

  enum class Why { kNone, kCancelled, kDeadline };
  // Why the watch failed the pairs (kNone: it did not, so far).
  Why why() const;

 private:
  void Run(std::chrono::steady_clock::time_point deadline);

  const std::function<bool()> stop_;
  const std::function<void()> fail_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  Why why_ = Why::kNone;
  std::thread thread_;
};

}  // namespace strata::gloo_plugin
