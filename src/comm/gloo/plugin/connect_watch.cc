#include "comm/gloo/plugin/connect_watch.h"

#include <dlfcn.h>

#include <exception>
#include <typeinfo>
#include <utility>

namespace strata::gloo_plugin {
namespace {

// Failing a context's pairs the way Gloo does when a wait times out:
// tcp::Context::signalException fails every pending operation of every pair
// (waking the threads blocked on them) and closes the sockets, so peers
// fail too. ::gloo::Context::closeConnections only closes the sockets, which
// leaves this rank's blocked thread waiting until its timeout. The member is
// protected and Debian's libgloo-dev lacks a header that tcp/context.h
// needs (gloo/common/memory.h), so it is looked up by its exported name and
// called with the object as the first argument (the Itanium C++ ABI's
// convention for non-virtual members), after checking the object's dynamic
// type. Without it, closing falls back to closing the sockets.
using SignalExceptionFn = void (*)(void* self, const std::string& message);

SignalExceptionFn FindSignalException() {
  void* gloo = dlopen("libgloo.so.0", RTLD_LAZY | RTLD_NOLOAD);
  if (gloo == nullptr) return nullptr;
  void* sym =
      dlsym(gloo,
            "_ZN4gloo9transport3tcp7Context15signalExceptionERKNSt7__cxx1112basic_stringIcSt1"
            "1char_traitsIcESaIcEEE");
  dlclose(gloo);  // still loaded: the plugin depends on it
  return reinterpret_cast<SignalExceptionFn>(sym);
}

}  // namespace

bool FailPairs(::gloo::transport::Context* transport, const std::string& message) {
  static const SignalExceptionFn signal = FindSignalException();
  // tcp::Context derives from transport::Context first: same address.
  if (signal == nullptr ||
      std::string(typeid(*transport).name()) != "N4gloo9transport3tcp7ContextE") {
    return false;
  }
  try {
    signal(transport, message);
    return true;
  } catch (const std::exception&) {
    return false;  // a pair that is already broken may throw
  }
}

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
