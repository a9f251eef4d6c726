// The keep-alive side of the communication bindings (comm_bindings.cc):
// the Python objects an operation uses, held until the backend is done
// with their memory (PyKeep), the owner of a world's or split group's
// communicators that keeps those of failed or dropped operations (Owner),
// and the Python-facing Work (PyWork). Included by comm_bindings.cc only.
#pragma once

#include <pybind11/pybind11.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "status_map.h"
#include "strata/base/status.h"
#include "strata/comm/communicator.h"
#include "strata/parallel/world.h"

namespace strata::bindings::comm_keep {

namespace py = pybind11;

// A Python object (the tensors of an operation) held from C++ until the
// backend is done with their memory. Dropped on whatever thread lets go
// last: with the GIL at once when this thread holds it, else through a
// pending call that the interpreter runs on its main thread (so a backend
// thread never waits for the GIL); at exit, once the interpreter is
// finalizing, it is left alone (nothing is freed then anyway).
inline bool Finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

class PyKeep {
 public:
  explicit PyKeep(py::object object) : object_(object.release().ptr()) {}
  ~PyKeep() {
    if (object_ == nullptr || !Py_IsInitialized() || Finalizing()) return;
    if (PyGILState_Check() != 0) {
      Py_DECREF(object_);
    } else if (Py_AddPendingCall(&DecRef, object_) != 0) {
      // The pending-call queue is full: take the GIL after all.
      PyGILState_STATE gil = PyGILState_Ensure();
      Py_DECREF(object_);
      PyGILState_Release(gil);
    }
  }
  PyKeep(const PyKeep&) = delete;
  PyKeep& operator=(const PyKeep&) = delete;

 private:
  static int DecRef(void* object) {
    Py_DECREF(static_cast<PyObject*>(object));
    return 0;
  }
  PyObject* object_;
};

// Owns what a group's communicator lives in: a World, or a communicator
// made by Split/Shrink. Groups and works hold it; destroy() ends it. The
// lock keeps destroy() and rebuilds from running while a communicator is
// used; `abort_mu_` lets AbortAll reach the world without that lock (it
// must not wait for the operations it is meant to end).
//
// It also owns the tensors of its operations that failed or whose Work was
// dropped before they completed: the backend may still use their memory.
// Each is released when its operation completes, or, once the owner's
// communicators are destroyed, handed to the operation
// (Work::KeepBuffersAlive), which keeps it exactly as long as the backend
// may touch it (MPI: until requests it cannot cancel complete, or exit).
// Nothing is kept by the process beyond its owner.
class Owner {
 public:
  explicit Owner(std::unique_ptr<World> world)
      : is_world_(true), trace_dir_(world->trace_dir()), world_(std::move(world)) {}
  explicit Owner(std::unique_ptr<Communicator> comm) : is_world_(false), comm_(std::move(comm)) {}
  ~Owner() {
    // Without destroy(): the communicators go first, then what their
    // operations may still use is handed to them (see the class comment).
    world_.reset();
    comm_.reset();
    HandOff();
  }

  // Lock held (shared) while alive.
  World* world() { return world_.get(); }
  Communicator* comm() { return comm_.get(); }
  bool owns_world() const { return is_world_; }
  std::shared_mutex& mu() { return mu_; }
  bool alive() const { return alive_.load(); }
  // The world's generation; 1 for a communicator owner. Lock held.
  uint64_t generation() const { return world_ != nullptr ? world_->generation() : 1; }
  // `s` with the world's flight-recorder folder named, when `s` is a
  // failure that dumps it (a deadline, a backend error); payloads kept.
  absl::Status WithTraceNote(const absl::Status& s) const {
    const absl::StatusCode c = s.code();
    if (trace_dir_.empty() ||
        (c != absl::StatusCode::kDeadlineExceeded && c != absl::StatusCode::kUnavailable &&
         c != absl::StatusCode::kInternal && c != absl::StatusCode::kUnknown &&
         c != absl::StatusCode::kDataLoss)) {
      return s;
    }
    absl::Status out(c, absl::StrCat(s.message(), "; flight recorder dumps of every rank: ",
                                     trace_dir_, " (strata-trace ", trace_dir_,
                                     " names the operation a rank never entered)"));
    s.ForEachPayload(
        [&](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
    return out;
  }

  // Why the owner is gone, for the errors of its groups.
  absl::Status Gone(absl::string_view group) const {
    std::lock_guard<std::mutex> lock(abort_mu_);
    return absl::FailedPreconditionError(absl::StrCat("group '", group, "': ", gone_));
  }

  // Called with the GIL released.
  void Destroy() {
    std::unique_lock<std::shared_mutex> lock(mu_);
    std::lock_guard<std::mutex> abort(abort_mu_);
    if (alive_.load()) {
      gone_ = is_world_ ? "its world was destroyed; create a new one with strata.init"
                        : "this group was destroyed";
    }
    alive_.store(false);
    world_.reset();
    comm_.reset();
    HandOff();
  }
  // Hands the communicator over (to become a world's root); the owner's
  // groups then fail with `why`. Called with the GIL released.
  std::unique_ptr<Communicator> Release(const std::string& why) {
    std::unique_lock<std::shared_mutex> lock(mu_);
    std::lock_guard<std::mutex> abort(abort_mu_);
    alive_.store(false);
    gone_ = why;
    return std::move(comm_);
  }
  // From any thread, without waiting for operations in progress.
  void AbortAll() {
    std::lock_guard<std::mutex> lock(abort_mu_);
    if (world_ != nullptr) world_->AbortAll();
    if (comm_ != nullptr) (void)comm_->Abort();
  }

  // Python objects whose memory an unfinished or failed operation may still
  // use, kept until it completes (or, after the communicators are
  // destroyed, as long as the operation says: HandOff). GIL held.
  void KeepUntilDone(std::shared_ptr<Work> work, py::object keep) {
    auto held = std::make_shared<PyKeep>(std::move(keep));
    Purge();
    std::unique_lock<std::mutex> lock(kept_mu_);
    if (!alive_.load()) {
      // The communicators are gone already: the operation decides now.
      lock.unlock();
      work->KeepBuffersAlive(std::move(held));
      return;
    }
    kept_.emplace_back(std::move(work), std::move(held));
  }
  // Releases what operations that completed no longer need. A failed one
  // keeps its tensors (the backend may still write into them) until HandOff.
  void Purge() {
    std::vector<std::pair<std::shared_ptr<Work>, std::shared_ptr<PyKeep>>> still, done;
    {
      std::lock_guard<std::mutex> lock(kept_mu_);
      for (auto& [work, held] : kept_) {
        absl::StatusOr<bool> finished = work->Test();
        (finished.ok() && *finished ? done : still).emplace_back(std::move(work), std::move(held));
      }
      kept_.swap(still);
    }
    // `done` is released here, outside the lock.
  }
  // Number of operations whose tensors are kept now (for tests). GIL held.
  size_t kept() {
    Purge();
    std::lock_guard<std::mutex> lock(kept_mu_);
    return kept_.size();
  }

 private:
  std::shared_mutex mu_;
  mutable std::mutex abort_mu_;
  std::atomic<bool> alive_{true};
  const bool is_world_;
  const std::string trace_dir_;  // the world's flight-recorder folder; "" when off
  std::string gone_;
  std::unique_ptr<World> world_;
  std::unique_ptr<Communicator> comm_;

  // After the communicators are destroyed: each kept object goes to its
  // operation, which holds it while the backend may use the memory.
  void HandOff() {
    std::vector<std::pair<std::shared_ptr<Work>, std::shared_ptr<PyKeep>>> kept;
    {
      std::lock_guard<std::mutex> lock(kept_mu_);
      kept.swap(kept_);
    }
    for (auto& [work, held] : kept) work->KeepBuffersAlive(std::move(held));
  }

  std::mutex kept_mu_;
  std::vector<std::pair<std::shared_ptr<Work>, std::shared_ptr<PyKeep>>> kept_;  // kept_mu_
};

class PyWork {
 public:
  PyWork(std::shared_ptr<Owner> owner, std::shared_ptr<Work> work, py::object keep)
      : owner_(std::move(owner)), work_(std::move(work)), keep_(std::move(keep)) {}
  ~PyWork() {
    // Never block here: hand the buffers to the owner until MPI is done.
    if (work_ != nullptr && keep_ && !keep_.is_none()) {
      absl::StatusOr<bool> done = work_->Test();
      if (!(done.ok() && *done)) owner_->KeepUntilDone(work_, std::move(keep_));
    }
  }

  // Waits in slices so that Ctrl-C reaches Python; `timeout` in seconds
  // (None: until the operation completes or fails, which its own timeout
  // bounds). A Work outlives its communicator safely (it then fails with
  // Aborted).
  bool Wait(std::optional<double> timeout) {
    const absl::Time deadline =
        timeout ? absl::Now() + absl::Seconds(*timeout) : absl::InfiniteFuture();
    while (true) {
      const absl::Time slice = std::min(deadline, absl::Now() + absl::Milliseconds(100));
      absl::Status s;
      {
        py::gil_scoped_release release;
        s = work_->Wait(slice);
      }
      if (s.ok()) {
        Done();
        return true;
      }
      if (s.code() == absl::StatusCode::kDeadlineExceeded) {
        absl::StatusOr<bool> done = work_->Test();
        if (done.ok() && !*done) {
          if (absl::Now() >= deadline) RaiseStatus(owner_->WithTraceNote(s), ErrorArea::kComm);
          if (PyErr_CheckSignals() != 0) throw py::error_already_set();
          continue;
        }
        if (done.ok()) {
          // It completed between the slice's end and the test: success, not
          // the slice's DeadlineExceeded (a race the demo hit under load).
          Done();
          return true;
        }
        s = done.status();
      }
      Failed();
      RaiseStatus(owner_->WithTraceNote(s), ErrorArea::kComm);
    }
  }

  bool IsCompleted() {
    absl::StatusOr<bool> done = work_->Test();
    if (!done.ok()) {
      Failed();
      RaiseStatus(owner_->WithTraceNote(done.status()), ErrorArea::kComm);
    }
    if (*done) Done();
    return *done;
  }

  std::string Describe() const { return work_->Describe(); }

 private:
  void Done() { keep_ = py::none(); }
  // The backend may still use the memory: its owner keeps it.
  void Failed() {
    if (keep_ && !keep_.is_none()) owner_->KeepUntilDone(work_, std::move(keep_));
    keep_ = py::none();
  }

  std::shared_ptr<Owner> owner_;
  std::shared_ptr<Work> work_;
  py::object keep_;
};

}  // namespace strata::bindings::comm_keep
