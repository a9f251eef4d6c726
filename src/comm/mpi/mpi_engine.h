// The MPI backend's progress engine: one background thread per root
// communicator (shared by every communicator split or shrunk from it) that
// drives MPI's nonblocking operations to completion, so they progress while
// the caller computes, enforces each operation's timeout, and completes the
// operations of each communicator in the order they were issued.
//
//   auto engine = std::make_shared<Engine>(options);
//   auto op = std::make_shared<Op>(description, comm_state, deadline, engine->wakeup());
//   MPI_Iallreduce(..., &request);  op->requests.push_back(request);
//   engine->Submit(op);
//   absl::Status s = op->Wait(absl::Now() + absl::Seconds(5));
//
// Polling policy (see MpiOptions): while a caller waits, the thread polls
// MPI without pause (as a blocking MPI call would; Open MPI yields the CPU
// between polls when ranks outnumber cores); otherwise it polls for
// `busy_poll` after the last start or completion, then sleeps between
// polls, doubling the pause up to `max_poll_interval`. With nothing in
// flight it blocks until an operation is submitted.
//
// Failure handling: an operation past its deadline fails with
// DeadlineExceeded and marks its communicator failed; an MPI error that
// means a lost peer or a revoked communicator does the same. Operations
// failed this way, or by Abort(), may still have MPI requests in flight
// (MPI cannot cancel collectives); the engine keeps polling them, with the
// operation's scratch buffers, until MPI completes them. Their user buffers
// must stay valid until then or until the process exits.
//
// Locks are std::mutex rather than absl::Mutex: the system's abseil is not
// built with ThreadSanitizer, which then cannot see absl::Mutex's ordering.
//
// Thread-safety: Engine, Op and CommState are thread-safe; Op::requests,
// Op::finish, Op::scratch and Op::trace are written by the starting thread before
// Submit and used only by the engine thread afterwards.
#pragma once

#include <mpi.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "comm/common/health.h"
#include "comm/mpi/mpi_runtime.h"
#include "strata/comm/backend.h"
#include "strata/observe/op_record.h"

namespace strata::mpi {

// One communicator's MPI handles and health, shared by the Communicator
// object and its operations (so the handles live until the last operation
// that uses them is gone).
class CommState {
 public:
  // `uid` identifies the communicator identically on all its members and
  // differently from every other communicator of the job (see Uid()).
  CommState(MPI_Comm comm, MPI_Comm ctrl, std::string name, int world_rank, std::string uid);
  ~CommState();  // frees the communicators unless MPI is finalised
  CommState(const CommState&) = delete;
  CommState& operator=(const CommState&) = delete;

  // For operations; revoked by Revoke().
  MPI_Comm comm() const { return comm_; }
  // A duplicate of comm() that is never revoked: the rendezvous of Shrink
  // runs on it after comm() is revoked.
  MPI_Comm ctrl() const { return ctrl_; }
  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  int world_rank() const { return world_rank_; }
  // "group tp (rank 1 of 2, world rank 3)".
  const std::string& where() const { return health_.where(); }

  // Serialises the starting of operations, so that MPI sees them in the
  // order of the engine's queue; held while an operation is started.
  std::mutex& issue_mu() { return issue_mu_; }
  // Counts Split calls, for child uids (guarded by issue_mu).
  int next_split_seq() { return split_seq_++; }
  // "r3f9a.../s0c1/k0": the root's random id (from rank 0), then one step
  // per split (sequence number and color) and shrink (sequence number).
  // Names the PMIx group when Shrink creates a communicator.
  const std::string& uid() const { return uid_; }

  // The communicator's health (comm_internal::CommHealth has the rules):
  // OK while usable; otherwise why not, as the status a new operation fails
  // with (FailedPrecondition after Abort or a failure, Aborted after a
  // revocation). `op` names the operation and the group and starts the
  // message.
  absl::Status CheckUsable(absl::string_view op) const { return health_.CheckUsable(op); }
  // OK while healthy; else the error that broke the communicator.
  absl::Status Health() const { return health_.Health(); }
  // Records the first failure (a passed deadline, a lost peer).
  void SetFailed(const absl::Status& status) { health_.SetFailed(status); }
  void SetAborted() { health_.SetAborted(); }
  void SetRevoked(const absl::Status& status) { health_.SetRevoked(status); }

 private:
  MPI_Comm comm_;
  MPI_Comm ctrl_;
  std::string name_;
  int rank_ = 0;
  int size_ = 1;
  int world_rank_ = 0;
  std::mutex issue_mu_;
  const std::string uid_;
  int split_seq_ = 0;
  comm_internal::CommHealth health_;
};

// How the engine thread learns that a caller waits or an operation
// started. Shared with operations, which may outlive the engine.
class Wakeup {
 public:
  void AddWaiter();
  void RemoveWaiter();
  // Wakes the engine thread if it sleeps.
  void Kick();
  bool HasWaiters() const;
  // Engine side: returns after `timeout`, or earlier on a Kick or a new
  // waiter since the last call.
  void Sleep(absl::Duration timeout);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  int waiters_ = 0;
  uint64_t kicks_ = 0;
  uint64_t seen_ = 0;
};

// One started operation.
class Op {
 public:
  // `description` names the operation, group and rank for messages;
  // `deadline` is when the operation fails with DeadlineExceeded.
  Op(std::string description, std::shared_ptr<CommState> comm, absl::Time deadline,
     absl::Duration timeout, std::shared_ptr<Wakeup> wakeup);

  const std::string& description() const { return description_; }
  CommState& comm() const { return *comm_; }

  // Marks the operation done with `status`; the first call wins. Returns
  // whether this call completed it.
  bool Complete(const absl::Status& status);
  bool done() const;
  // See Work::Wait and Work::Test.
  absl::Status Wait(absl::Time deadline);
  absl::StatusOr<bool> Test();

  // ---- written by the starter before Engine::Submit ----------------------
  std::vector<MPI_Request> requests;
  // Runs on the engine thread after every request completed without error
  // (statuses in request order), before the operation is marked done: the
  // division of avg, the length check of a receive.
  std::function<absl::Status(absl::Span<const MPI_Status>)> finish;
  // Memory MPI reads or writes until the requests complete (count arrays,
  // staging copies).
  std::vector<std::vector<char>> scratch;
  std::vector<std::vector<int>> int_scratch;
  // The operation's record (null unless a sink records it): completed by
  // Complete.
  std::shared_ptr<observe::OpTrace> trace;
  // Receives: when the operation fails (its deadline, Abort, Revoke), the
  // engine cancels its requests and waits (boundedly) for MPI to let go of
  // the buffer before marking it done, so that a caller who frees the
  // buffer after a failed Wait is safe. Collectives cannot be cancelled in
  // MPI: their buffers may be written until MPI completes them.
  bool cancel_on_failure = false;

  // Asks the engine thread to fail the operation with `status` (after
  // cancelling it, for cancel_on_failure); false if it is done already.
  bool RequestFailure(const absl::Status& status);

  // Keeps `holder` until the op is destroyed, i.e. until nothing (the
  // engine, the runtime at exit) keeps it for requests MPI may still
  // complete (Work::KeepBuffersAlive). Thread-safe.
  void Keep(std::shared_ptr<void> holder);

 private:
  friend class Engine;
  const std::string description_;
  const std::shared_ptr<CommState> comm_;
  const absl::Time deadline_;
  const absl::Duration timeout_;
  const std::shared_ptr<Wakeup> wakeup_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  absl::Status status_;
  // Set by RequestFailure (under mu_), taken by the engine thread.
  std::optional<absl::Status> failure_request_;
  // Whether failure_request_ is set: read by the engine on every pass
  // without taking mu_.
  std::atomic<bool> has_failure_request_{false};
  std::vector<std::shared_ptr<void>> kept_;  // guarded by mu_
  // Engine thread only.
  bool retired_ = false;
  bool mpi_done_ = false;
  absl::Status mpi_status_;
  std::vector<MPI_Status> statuses_;
};

class Engine : public ExitHook {
 public:
  explicit Engine(const MpiOptions& options);
  ~Engine() override;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const MpiOptions& options() const { return options_; }
  // The most elements per MPI call (MpiOptions::max_elements_per_call, or
  // INT_MAX).
  size_t max_elements_per_call() const { return max_elements_; }
  std::shared_ptr<Wakeup> wakeup() const { return wakeup_; }

  // Hands a started operation to the engine.
  void Submit(std::shared_ptr<Op> op);
  // Keeps polling `op`'s requests (and its scratch alive) until MPI
  // completes them, without reporting anything: for operations that failed
  // while starting, or requests abandoned at a deadline.
  void Adopt(std::shared_ptr<Op> op);
  // Fails every operation of `comm` that is not done yet with `status`,
  // now, without waiting for MPI.
  void FailPending(const CommState* comm, const absl::Status& status);

  // How long the engine waits for MPI to release a cancelled receive.
  static constexpr absl::Duration kCancelWait = absl::Seconds(5);

  // Stops the thread; pending operations fail with Aborted. Idempotent.
  void Stop();
  void StopBeforeFinalize() override { Stop(); }

 private:
  void Run();
  // One pass over the active operations; returns whether any completed.
  // Completed and failed operations are marked retired.
  bool Pass(const std::vector<std::shared_ptr<Op>>& ops);
  void ReapOrphans();
  // Cancels `op`'s requests and waits up to kCancelWait for them to
  // complete (engine thread).
  static void CancelRequests(Op& op);
  // Moves an op whose requests may still be in flight to the orphans.
  void Orphan(std::shared_ptr<Op> op);

  const MpiOptions options_;
  // More ranks on this host than cores: a waiter's poll pauses between
  // passes and there is no busy polling after starts, so the cores go to
  // ranks that compute (see Run).
  const bool oversubscribed_;
  const size_t max_elements_;
  const std::shared_ptr<Wakeup> wakeup_;
  std::mutex mu_;
  std::condition_variable idle_;  // the thread waits here with nothing to poll
  std::deque<std::shared_ptr<Op>> active_;
  bool stop_ = false;
  bool stopped_ = false;
  // Engine thread only (and Stop after the join).
  std::vector<std::shared_ptr<Op>> orphans_;
  std::vector<std::shared_ptr<Op>> adopted_;
  std::thread thread_;
};

// Polls `op`'s requests from the calling thread until they complete, fail,
// or `deadline` passes (DeadlineExceeded naming the op). For communicator
// creation, which has no Work to return. On a deadline or an error the op,
// with its unfinished requests and its scratch, is handed to `engine`
// (Adopt). `comm` is where MPI reports failed ranks.
absl::Status WaitRequests(Engine& engine, std::shared_ptr<Op> op, absl::Time deadline,
                          MPI_Comm comm);

}  // namespace strata::mpi
