// ElasticLoop: in-process recovery for a training loop. It runs the user's
// steps; when a rank fails it aborts this rank's communicators, agrees with
// the other survivors on the failed set and a new epoch, shrinks the root
// communicator and rebuilds the World on a smaller mesh (dp shrinks by the
// replicas that lost a rank), lets the caller restore its state to the last
// committed step, and goes on with the step that failed.
//
//   auto loop = strata::elastic::ElasticLoop::Create(*world, store, options);
//   strata::elastic::LoopCallbacks cb;
//   cb.step = [&](const strata::elastic::StepContext& ctx) { ...forward, backward,
//                                                          reductions...; return status; };
//   cb.apply = [&](const strata::elastic::StepContext& ctx) { ...optimizer step...; };
//   cb.restore = [&](strata::elastic::RecoveryEvent& e) { ...zero grads...; };
//   absl::StatusOr<strata::elastic::LoopResult> r = (*loop)->Run(cb, 0, num_steps);
//
// A loop written by hand uses the same steps: BeginStep(n); run the step;
// on an error ReportFailure(error); Commit(n, ok) -> apply the step when
// true; otherwise Recover() and redo step n (docs/elastic.md).
//
// Detection (every source bounded and reported in the event): an error of
// the step (ReportFailure), the heartbeat monitor (a hung or dead rank), the
// epoch's alarm raised by any other rank (the loop's aborter thread aborts
// this rank's World at once, so a step blocked in a collective returns; the
// monitor's heartbeats never wait for that abort), the commit
// aborted. Agreement: agreement.h. Commit: step_commit.h. Regroup:
// World::root().Shrink(ranks not in the new epoch), World::Rebuild(new root,
// new mesh), and a barrier over the new world. A failure during a recovery
// starts it again with the next epoch (at most options.max_attempts).
//
// Spares (a World with WorldOptions::spares): the spares are members of
// every epoch (they heartbeat, check in and agree) but not of the mesh, and
// do not vote on steps. A spare calls StandBy(), which waits cheaply (a
// sleep and one store read per `heartbeat_interval`) until a recovery
// places it or the job finishes. When a member fails, the agreement
// (PlanChange) gives its mesh position to a live spare, so the replica
// stays whole and dp stays; only when the spares run out are replicas
// dropped. The regroup shrinks World::job() and, when a spare moved in,
// splits it once more so that every rank has its mesh position; the
// members whose dp group gained a spare then send it the state of their
// position (the `restore` callback: event.replaced names the pairs) and
// the placed spare learns the step to run. A member that finishes Run (or
// calls Finish) ends the spares' StandBy with kFinished.
//
// Live ranks of a dropped replica leave: they take no part in the shrink;
// with LeavePolicy::kExit (the default) Recover ends their process, with
// kReturn it returns kLeave and the caller must end it soon, without
// MPI_Finalize (the survivors' shrink waits for them to be gone). A rank the decision takes as
// failed (it was hung and resumed) gets Aborted from Recover; a minority partition gets
// FailedPrecondition naming the counts; so does a mesh without a complete
// replica, and a rank that cannot reach the store (from Commit or Recover,
// naming the store and the epoch's members: it cannot learn the decision).
//
// Growing back (Join): a process started later with the same job (and
// ElasticOptions::config) asks to join through the store; the last voter
// of the next step's commit sees the request, every member applies that
// step and admits it (joiners_waiting, Admit, Recover), the agreement adds
// it as a spare (or, while dp is below the job's first dp and spares
// complete a replica, dp grows back: PlanGrow), and the regroup makes a
// fresh job communicator through the store instead of a shrink.
//
// Thread-safety: one thread drives the loop (BeginStep, Commit, Recover,
// Run); ReportFailure, RequestChange, alarmed() and events() may be called
// from any thread. The World must outlive the loop; nobody else may rebuild
// it meanwhile.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "strata/base/export.h"
#include "strata/comm/store.h"
#include "strata/elastic/agreement.h"
#include "strata/elastic/event.h"
#include "strata/elastic/heartbeat.h"
#include "strata/elastic/membership.h"
#include "strata/elastic/options.h"
#include "strata/elastic/step_commit.h"
#include "strata/parallel/world.h"

namespace strata::elastic {

// What a step sees.
struct STRATA_EXPORT StepContext {
  int64_t step = 0;
  World* world = nullptr;
  const Membership* membership = nullptr;
};

struct STRATA_EXPORT LoopCallbacks {
  // Forward, backward and every gradient reduction of `ctx.step`, without
  // applying the update. An error (a peer lost, an abort) starts a recovery.
  std::function<absl::Status(const StepContext& ctx)> step;
  // Applies the step's update (the optimizer), once every rank committed it.
  std::function<absl::Status(const StepContext& ctx)> apply;
  // Brings the state back to the last committed step after a regroup
  // (zero the gradients, restore what a failed step may have touched, or
  // load a checkpoint: set event.restored_from). Optional.
  std::function<absl::Status(RecoveryEvent& event)> restore;
  // After every recovery (rescale the learning rate, rebuild a pipeline
  // schedule, log). Optional.
  std::function<void(const RecoveryEvent& event)> on_world_changed;
};

struct STRATA_EXPORT LoopResult {
  // The next step to run: end_step when the loop finished.
  int64_t next_step = 0;
  // True when this rank left (its replica was dropped).
  bool left = false;
  // True on a spare that was never placed before the job finished.
  bool stood_by = false;
  std::vector<RecoveryEvent> events;
};

// Hooks into the owner of the World (the Python bindings' lock) and of the
// store.
struct STRATA_EXPORT ElasticHooks {
  // Aborts every communicator of the World, from any thread, at once.
  // Default: World::AbortAll.
  std::function<void()> abort_all;
  // A second connection to the same store for the monitor thread. Needed
  // where a store's client serialises its operations (torch's TCPStore
  // holds one lock per client across a blocking wait): otherwise the main
  // thread's wait for a step commit or a decision holds this rank's
  // heartbeat back and the others take it as hung. Default (null): `store`.
  std::shared_ptr<Store> monitor_store;
  // Makes a fresh job communicator of `size` ranks (this one `rank`)
  // through `rendezvous`: the regroup that admits joiners (a shrink cannot
  // add a process). Default: CreateRootCommunicator on the backend of the
  // World's job communicator, recording into its sink.
  std::function<absl::StatusOr<std::unique_ptr<Communicator>>(std::shared_ptr<Store> rendezvous,
                                                              int rank, int size)>
      connect;
};

// What a joining process needs besides the elastic options (Join).
struct STRATA_EXPORT JoinOptions {
  // The World it builds once admitted: operation timeouts, trace, backend
  // settings, the sink. Join sets root.backend (the job's), root.store,
  // spares and on_root.
  WorldOptions world;
  // This process's launch environment; Join replaces rank and world_size
  // with the place it is given.
  LaunchEnv env;
};

class ElasticLoop;

// A process that joined a running job: its World (rank and mesh as the
// admitting decision says: a spare, or a member of a new replica) and the
// loop over it. Destroy the loop before the World (the declaration order).
struct STRATA_EXPORT Joined {
  // Null when the job finished before admitting the joiner (finished()).
  std::unique_ptr<World> world;
  std::unique_ptr<ElasticLoop> loop;
  RecoveryEvent event;
  bool finished() const { return loop == nullptr; }
};

class STRATA_EXPORT ElasticLoop {
 public:
  // Starts the monitor for epoch 1 over `world` (generation 1, the whole
  // job: its root ranks are the job ranks). InvalidArgument for bad options
  // or a null `store` (every agreement goes through a store).
  static absl::StatusOr<std::unique_ptr<ElasticLoop>> Create(World& world,
                                                             std::shared_ptr<Store> store,
                                                             const ElasticOptions& options,
                                                             ElasticHooks hooks = {});
  ~ElasticLoop();
  ElasticLoop(const ElasticLoop&) = delete;
  ElasticLoop& operator=(const ElasticLoop&) = delete;

  // Joins the running job `options.job` (ElasticOptions::config must match
  // the job's) from a process that was not part of it: a restarted rank or
  // a new one. Asks through the store, waits (at most join_timeout) until
  // the members admit it at a step boundary, takes part in their regroup
  // (a fresh job communicator through the store: Gloo and NCCL jobs; an MPI
  // job refuses) and returns the World and the loop. A joiner stands by as
  // a spare (then StandBy, or Run) unless dp was below the job's first dp
  // and it completed a replica: then event.placed, event.step is the step
  // to run and its position's state comes from its dp group (restore).
  // A job whose members finished (ElasticLoop::Finish, before the request
  // or while it waits for its answer) gives a Joined without a World
  // (finished()): nothing to join, not an error. FailedPrecondition naming
  // why for a refusal (another config, an MPI job, a job that stops),
  // DeadlineExceeded when nobody answered in time, and the regroup's error
  // when it failed (the members then go on without it).
  static absl::StatusOr<Joined> Join(std::shared_ptr<Store> store, const ElasticOptions& options,
                                     JoinOptions join, ElasticHooks hooks = {});

  // This rank's job rank, and the current epoch's membership.
  int rank() const { return rank_; }
  const Membership& membership() const { return membership_; }
  const ElasticOptions& options() const { return options_; }

  // Marks the start of `step`: what an alarm aborts. Aborted when the
  // epoch's alarm is already known (recover first).
  absl::Status BeginStep(int64_t step);
  // Votes for `step` (step_commit.h). True: apply it. False: abandon it,
  // Recover, and run it again.
  absl::StatusOr<bool> Commit(int64_t step, bool ok = true);
  // An operation of this rank failed: raises the epoch's alarm (unless
  // raised), which aborts this rank's World, and remembers the failed ranks
  // the error names (kRankFailurePayload).
  void ReportFailure(const absl::Status& error);
  // A planned membership change: `evict` (job ranks, alive) leave with
  // their replicas, as if they had failed; empty: the survivors regroup
  // onto the same mesh. Raises the alarm like a failure; with
  // `abort_at_once` false, communicators are aborted only if the epoch is
  // still current `heartbeat_timeout` later (Detection::abort: for a
  // decision every rank takes at the same point of its loop).
  absl::Status RequestChange(const std::vector<int>& evict, const std::string& why,
                             bool abort_at_once = true);
  // True once this rank knows of the current epoch's alarm.
  bool alarmed() const;
  // Whether the step just committed said that processes wait to join (the
  // same answer on every member). Then, after applying it, every member
  // calls Admit(next step) and Recover(): the joiners come in at this step
  // boundary.
  bool joiners_waiting() const;
  // Raises the epoch's alarm for the waiting joiners (communicators are not
  // aborted: every member is between steps); `next_step` is the step the
  // job runs after the regroup (the joiners learn it).
  absl::Status Admit(int64_t next_step);

  enum class Outcome : uint8_t { kContinue, kLeave, kFinished };
  struct Recovery {
    Outcome outcome = Outcome::kContinue;
    RecoveryEvent event;
  };
  // Agrees, regroups and returns the event (restore not yet done: the
  // caller restores and may set event.restore / restored_from; Run does).
  absl::StatusOr<Recovery> Recover();

  // On a spare: waits until a recovery places this rank in the mesh
  // (kContinue; event.placed, event.step is the step to run, the World is
  // rebuilt with this rank in its groups), the job's members finish
  // (kFinished), or this rank must leave (kLeave). Returns at once with
  // kContinue on a member. Errors as Recover's.
  absl::StatusOr<Recovery> StandBy();
  // This rank's members finished the job: spares standing by return
  // kFinished. Run calls it at its end.
  absl::Status Finish();

  // Runs steps [first_step, end_step) with recovery (see LoopCallbacks);
  // a spare stands by first and, once placed, restores (the callback) and
  // runs from the step it was told.
  absl::StatusOr<LoopResult> Run(const LoopCallbacks& callbacks, int64_t first_step,
                                 int64_t end_step);

  // Every recovery so far on this rank, oldest first.
  std::vector<RecoveryEvent> events() const;
  // Replaces ElasticHooks::abort_all (a joiner's World taken over by an
  // owner that aborts it its own way). From the thread that drives the loop.
  void SetAbortAll(std::function<void()> abort_all);
  // Records the restore phase of the last event (Python's State does it).
  void RecordRestore(absl::Time restored_at, const std::string& restored_from);

 private:
  ElasticLoop(World* world, std::shared_ptr<Store> store, ElasticOptions options,
              ElasticHooks hooks, int rank, Membership membership);
  // The default ElasticHooks::connect, and the store prefix of the fresh
  // job communicator of `next`.
  absl::StatusOr<std::unique_ptr<Communicator>> ConnectJob(std::shared_ptr<Store> rendezvous,
                                                           int rank, int size);
  std::shared_ptr<Store> RendezvousOf(const Membership& next) const;
  // Writes the job's facts for joiners (size, config, backend, whether it
  // admits them) once (the first writer wins).
  absl::Status WriteJobInfo();
  // Every member of a recovery for joiners (Admit) waits here until all
  // are between steps (an optimizer's collective of the last step's apply
  // may still run on another member), before any aborts its communicators.
  void MeetBeforeJoin();
  // The monitor's reaction to an alarm: hands the abort to the aborter's
  // thread and returns at once.
  void OnAlarm(const Detection& alarm, uint64_t epoch);
  // The aborter's thread: aborts the World (and the step being voted on)
  // for each alarm OnAlarm hands it. An abort may wait (MPI's waits up to
  // seconds for pending receives to be cancelled), and the monitor's
  // heartbeats must never wait behind it: a rank whose heartbeat stalls is
  // taken as hung by the others.
  void RunAborter();
  // The epoch this rank is in (membership_.epoch), for the aborter's thread.
  std::atomic<uint64_t> epoch_{1};
  // Held by the aborter while it aborts the World, and by the loop while it
  // moves to a new epoch: an alarm of an epoch that ended never aborts the
  // World of the next.
  std::mutex epoch_mu_;
  std::mutex abort_mu_;
  std::condition_variable abort_cv_;
  std::optional<uint64_t> abort_epoch_;  // guarded by abort_mu_: an abort to do
  absl::Time abort_at_;                  // guarded by abort_mu_: when to do it
  bool abort_stop_ = false;              // guarded by abort_mu_
  std::thread aborter_;
  // One attempt; `decided` gets the event of its decision (before the
  // regroup), so that a later attempt's event can name what this one found.
  absl::StatusOr<Recovery> RecoverOnce(int attempt, std::vector<RecoveryEvent>& decided);
  // After the shrink of the regroup to `next`: true when every member's
  // shrink succeeded; returns only once every member is past its shrink (or
  // the epoch's alarm says one was lost), so that no member starts the
  // next attempt's shrink while another is still inside this one.
  [[noreturn]] void ExitLeavingRank(const RecoveryEvent& event);
  absl::StatusOr<bool> AllShrunk(const Membership& next, bool shrunk);

  World* world_;  // null on a joiner until its World exists
  const std::shared_ptr<Store> store_;
  const ElasticOptions options_;
  ElasticHooks hooks_;
  const int rank_;
  Membership membership_;
  // Job ranks of the current World root's ranks (differs from the
  // membership while a regroup is incomplete).
  std::vector<int> root_members_;
  std::unique_ptr<Agreement> agreement_;
  std::unique_ptr<StepCommit> commit_;
  std::atomic<int64_t> current_step_{0};
  mutable std::mutex mu_;
  std::vector<int> suspects_;  // guarded by mu_
  std::vector<RecoveryEvent> events_;
  // A joiner placed in the mesh at once: Run restores its state first.
  bool joined_placed_ = false;
  // Last: stopped first on destruction (its thread calls OnAlarm).
  std::unique_ptr<HeartbeatMonitor> monitor_;
};

}  // namespace strata::elastic
