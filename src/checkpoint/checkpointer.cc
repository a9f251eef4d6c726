#include "strata/checkpoint/checkpointer.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <mutex>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/internal/file_util.h"
#include "checkpoint/internal/rank_writer.h"
#include "checkpoint/internal/save_protocol.h"
#include "checkpoint/internal/staging.h"
#include "strata/base/status.h"

namespace strata {

using checkpoint_internal::JoinPath;

std::string StepDirectoryName(int64_t step) { return absl::StrCat("step-", step); }

namespace {

double Seconds(absl::Time since) { return absl::ToDoubleSeconds(absl::Now() - since); }

// Lowest best-effort I/O priority for the calling thread; ignored where the
// kernel or the scheduler does not allow it.
void LowerIoPriority() {
  constexpr int kWhoProcess = 1;  // IOPRIO_WHO_PROCESS: with id 0, this thread
  constexpr int kClassBestEffort = 2;
  constexpr int kClassShift = 13;
  (void)::syscall(SYS_ioprio_set, kWhoProcess, 0, (kClassBestEffort << kClassShift) | 7);
}

absl::Status ValidateOptions(const CheckpointOptions& o) {
  if (o.version != CheckpointOptions::kVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("CheckpointOptions version ", o.version,
                     " is not supported (this build: ", CheckpointOptions::kVersion, ")"));
  }
  if (o.directory.empty()) return absl::InvalidArgumentError("checkpoint directory is empty");
  if (o.keep_last < 0) {
    return absl::InvalidArgumentError(absl::StrCat("keep_last ", o.keep_last, " is negative"));
  }
  if (o.chunk_bytes < kMinChunkBytes || o.chunk_bytes > kMaxChunkBytes) {
    return absl::InvalidArgumentError(absl::StrCat("chunk_bytes ", o.chunk_bytes, " is outside [",
                                                   kMinChunkBytes, ", ", kMaxChunkBytes, "]"));
  }
  if (o.staging_threads < 0 || o.staging_threads > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("staging_threads ", o.staging_threads, " is outside [0, 256]"));
  }
  if (!o.group.empty() && !o.split_from.empty()) {
    return absl::InvalidArgumentError(
        "CheckpointOptions: set group (a dedicated communicator) or split_from (a group to split "
        "a dedicated communicator from), not both");
  }
  if (o.group.has_world()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CheckpointOptions::group is group '", o.group.name(),
        "' of a World, whose communicators training uses too: the checkpointer's agreements "
        "would interleave with training's collectives. Set split_from to it instead (the "
        "checkpointer splits a communicator of its own off it and follows the World's "
        "rebuilds)"));
  }
  if (o.busy_timeout < absl::ZeroDuration() || o.commit_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("busy_timeout must be >= 0 and commit_timeout > 0");
  }
  return absl::OkStatus();
}

// The communicator split off `parent` for a checkpointer.
absl::StatusOr<std::unique_ptr<Communicator>> SplitCheckpointComm(Communicator& parent,
                                                                  absl::Duration timeout) {
  CommOptions co;
  co.name = "checkpoint";
  co.timeout = timeout;
  absl::StatusOr<std::unique_ptr<Communicator>> split = parent.Split(0, parent.rank(), co);
  if (!split.ok())
    return internal::Annotate(split.status(), "creating the checkpoint communicator");
  return split;
}

}  // namespace

class Checkpointer::Impl {
 public:
  // `comm`: the communicator the writer uses (null: one process);
  // `owned_comm`: the one split off split_from (then comm is it), made at
  // world generation `generation`.
  Impl(const CheckpointOptions& options, Communicator* comm,
       std::unique_ptr<Communicator> owned_comm, uint64_t generation)
      : opts_(options),
        multi_rank_(comm != nullptr),
        owned_comm_(std::move(owned_comm)),
        generation_(generation) {
    if (comm != nullptr) {
      rank_ = comm->rank();
      world_ = comm->size();
    }
    if (!opts_.warn) {
      opts_.warn = [](const absl::Status& s) {
        std::fprintf(stderr, "strata checkpoint warning: %s\n", s.ToString().c_str());
      };
    }
    threads_ = opts_.staging_threads > 0
                   ? opts_.staging_threads
                   : static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 4u));
    ctx_.root = opts_.directory;
    ctx_.comm = comm;
    ctx_.rank = rank_;
    ctx_.world_size = world_;
    ctx_.keep_last = opts_.keep_last;
    ctx_.commit_timeout = opts_.commit_timeout;
    ctx_.hook = opts_.test_hook;
    ctx_.cancel = &cancel_;
    ctx_.warn = opts_.warn;
    writer_ = std::thread([this] { WriterLoop(); });
  }

  ~Impl() {
    if (!Close(absl::Now() + opts_.commit_timeout).ok()) {
      // Still in flight past the deadline: cancel it (it will not commit)
      // and wait for the writer to notice, bounded by one write or one
      // agreement deadline per queued job.
      cancel_.store(true);
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l, [this] { return Idle(); });
      stop_ = true;
      cv_.notify_all();
    }
    if (writer_.joinable()) writer_.join();
    // The owned communicator goes after the writer that used it.
  }

  absl::Status Save(const SaveRequest& request) {
    const absl::Time start = absl::Now();
    std::lock_guard<std::mutex> follow(follow_mu_);
    STRATA_RETURN_IF_ERROR(Follow());
    // A failure reported as a warning goes to the callback on every way out,
    // after mu_ is released (the callback is user code).
    absl::Status to_warn;
    auto warn_on_exit = absl::MakeCleanup([&] {
      if (!to_warn.ok()) opts_.warn(to_warn);
    });
    {
      std::unique_lock<std::mutex> l(mu_);
      if (closed_) return absl::FailedPreconditionError(Closed());
      if (!comm_failure_.ok()) return CommFailedLocked();
      if (absl::Status s = ReportPendingLocked(&to_warn); !s.ok()) {
        return VoteLocked(request.step, s);
      }
      if (in_flight_) {
        if (opts_.on_busy == BusyPolicy::kRefuse) {
          return VoteLocked(request.step,
                            absl::FailedPreconditionError(absl::StrCat(
                                "save of step ", request.step, " refused: the save of step ",
                                step_in_flight_, " is still in flight (on_busy = refuse)")));
        }
        if (!WaitUntil(l, absl::Now() + opts_.busy_timeout, [this] { return IdleOrClosed(); })) {
          return VoteLocked(request.step,
                            absl::DeadlineExceededError(absl::StrCat(
                                "save of step ", request.step, ": the save of step ",
                                step_in_flight_, " was still in flight after busy_timeout ",
                                absl::FormatDuration(opts_.busy_timeout))));
        }
        if (closed_) return absl::FailedPreconditionError(Closed());
        if (!comm_failure_.ok()) return CommFailedLocked();
        if (absl::Status s = ReportPendingLocked(&to_warn); !s.ok()) {
          return VoteLocked(request.step, s);
        }
      }
      in_flight_ = true;
      state_ = SaveStatus::State::kStaging;
      step_in_flight_ = request.step;
    }
    // The staging buffer is ours: no write from it is in flight.
    auto plan = std::make_unique<checkpoint_internal::SavePlan>();
    absl::Status st = Stage(request, plan.get());
    std::lock_guard<std::mutex> l(mu_);
    cv_.notify_all();
    if (!st.ok()) {
      in_flight_ = false;
      state_ = SaveStatus::State::kIdle;
      step_in_flight_ = -1;
      return VoteLocked(request.step, st);
    }
    Job job;
    job.step = request.step;
    job.plan = std::move(plan);
    queue_.push_back(std::move(job));
    state_ = SaveStatus::State::kWriting;
    last_ = SaveStats{};
    last_.step = request.step;
    last_.staging_seconds = Seconds(start);
    return absl::OkStatus();
  }

  absl::Status Abandon(int64_t step, const absl::Status& reason) {
    const absl::Status why =
        reason.ok() ? absl::UnknownError(absl::StrCat("save of step ", step, " abandoned"))
                    : reason;
    std::lock_guard<std::mutex> follow(follow_mu_);
    STRATA_RETURN_IF_ERROR(Follow());
    std::lock_guard<std::mutex> l(mu_);
    if (closed_) return absl::FailedPreconditionError(Closed());
    if (!comm_failure_.ok()) return CommFailedLocked();
    return VoteLocked(step, why);
  }

  absl::Status Wait(absl::Time deadline) {
    std::unique_lock<std::mutex> l(mu_);
    if (!WaitUntil(l, deadline, [this] { return Idle(); })) {
      return absl::DeadlineExceededError(absl::StrCat("the save of step ", step_in_flight_, " to '",
                                                      opts_.directory,
                                                      "' is still in flight at the deadline"));
    }
    absl::Status s = pending_;
    pending_ = absl::OkStatus();
    return s;
  }

  SaveStatus status() const {
    std::lock_guard<std::mutex> l(mu_);
    SaveStatus s;
    s.state = state_;
    s.step_in_flight = step_in_flight_;
    s.last_committed_step = last_committed_;
    s.pending_error = pending_;
    s.last = last_;
    s.staging_capacity = staging_capacity_;
    s.staging_allocations = staging_allocations_;
    return s;
  }

  absl::Status Close(absl::Time deadline) {
    {
      std::unique_lock<std::mutex> l(mu_);
      if (!WaitUntil(l, deadline, [this] { return Idle(); })) {
        return absl::DeadlineExceededError(absl::StrCat("cannot close: the save of step ",
                                                        step_in_flight_, " is still in flight"));
      }
      closed_ = true;
      stop_ = true;
      cv_.notify_all();
    }
    if (writer_.joinable()) writer_.join();
    std::lock_guard<std::mutex> l(mu_);
    absl::Status s = pending_;
    pending_ = absl::OkStatus();
    return s;
  }

 private:
  // A save for the writer: a staged plan, or (plan null) a failing vote.
  struct Job {
    int64_t step = 0;
    std::unique_ptr<checkpoint_internal::SavePlan> plan;
    absl::Status vote;
  };

  // Predicates; called with mu_ held.
  bool Idle() const { return !in_flight_ && queue_.empty() && !running_; }
  bool IdleOrClosed() const { return !in_flight_ || closed_; }
  bool JobOrStop() const { return !queue_.empty() || stop_; }

  // Waits on cv_ until `pred` holds (true) or `deadline` passes (false).
  template <typename Pred>
  bool WaitUntil(std::unique_lock<std::mutex>& l, absl::Time deadline, Pred pred) {
    if (deadline == absl::InfiniteFuture()) {
      cv_.wait(l, pred);
      return true;
    }
    const absl::Duration left = std::max(absl::ZeroDuration(), deadline - absl::Now());
    return cv_.wait_for(l, absl::ToChronoNanoseconds(left), pred);
  }

  std::string Closed() const {
    return absl::StrCat("the checkpointer for '", opts_.directory, "' is closed");
  }

  absl::Status CommFailedLocked() const {
    return absl::FailedPreconditionError(absl::StrCat(
        "the checkpoint communicator failed in an earlier save (", comm_failure_.message(),
        "); its ranks may no longer agree on the order of collectives: create a new "
        "Checkpointer with a new communicator"));
  }

  // With split_from a World's handle: when the World was rebuilt since the
  // communicator was split (or the last split failed), abandons a save of
  // the old generation still in flight and splits a new communicator off
  // the current generation's group. Collective over that group when it
  // splits; called by Save and Abandon with follow_mu_ held, which every
  // rank calls in the same order.
  absl::Status Follow() {
    if (!opts_.split_from.has_world()) return absl::OkStatus();
    uint64_t generation = 0;
    absl::StatusOr<Communicator*> parent = opts_.split_from.Resolve(&generation);
    if (!parent.ok()) {
      return internal::Annotate(parent.status(),
                                absl::StrCat("the checkpointer for '", opts_.directory,
                                             "' (last at world generation ", generation_, ")"));
    }
    if (generation == generation_ && owned_comm_ != nullptr) return absl::OkStatus();
    std::unique_ptr<Communicator> old;
    {
      std::unique_lock<std::mutex> l(mu_);
      if (!Idle() && owned_comm_ != nullptr) {
        // Its ranks are the old generation's: end its agreements now rather
        // than at commit_timeout.
        superseded_ = absl::StrCat("it was in flight at world generation ", generation_,
                                   " when the world was rebuilt to generation ", generation,
                                   " (abandoned: it committed only if every rank of generation ",
                                   generation_, " had agreed before)");
        (void)owned_comm_->Abort();
      }
      if (!WaitUntil(l, absl::Now() + opts_.commit_timeout, [this] { return Idle(); })) {
        return absl::DeadlineExceededError(absl::StrCat(
            "the checkpointer for '", opts_.directory, "' cannot follow the world to generation ",
            generation, ": the save of step ", step_in_flight_, " (generation ", generation_,
            ") was still in flight after commit_timeout"));
      }
      superseded_.clear();
      // The writer is idle: nothing uses the old communicator any more.
      old = std::move(owned_comm_);
      ctx_.comm = nullptr;
    }
    if (old != nullptr) {
      (void)old->Abort();
      old.reset();
    }
    absl::StatusOr<std::unique_ptr<Communicator>> split =
        SplitCheckpointComm(**parent, opts_.commit_timeout);
    if (!split.ok()) {
      return internal::Annotate(
          split.status(),
          absl::StrCat("the checkpointer for '", opts_.directory,
                       "' following the world from generation ", generation_, " to ", generation));
    }
    std::lock_guard<std::mutex> l(mu_);
    owned_comm_ = std::move(split).value();
    generation_ = generation;
    rank_ = owned_comm_->rank();
    world_ = owned_comm_->size();
    ctx_.comm = owned_comm_.get();
    ctx_.rank = rank_;
    ctx_.world_size = world_;
    // A failed agreement of the old communicator says nothing of the new one.
    comm_failure_ = absl::OkStatus();
    return absl::OkStatus();
  }

  // With a communicator, queues this rank's failing vote for `step` (cast by
  // the writer after the jobs before it); returns `why`.
  absl::Status VoteLocked(int64_t step, const absl::Status& why) {
    if (multi_rank_) {
      Job job;
      job.step = step;
      job.vote = why;
      queue_.push_back(std::move(job));
      cv_.notify_all();
    }
    return why;
  }

  // Reports a failed background save per on_failure: an error return means
  // "do not start this save"; under kWarn the failure goes to *to_warn.
  absl::Status ReportPendingLocked(absl::Status* to_warn) {
    if (pending_.ok()) return absl::OkStatus();
    absl::Status s = pending_;
    pending_ = absl::OkStatus();
    if (opts_.on_failure == FailurePolicy::kReturnError) return s;
    *to_warn = s;
    return absl::OkStatus();
  }

  absl::Status Stage(const SaveRequest& request, checkpoint_internal::SavePlan* plan) {
    if (checkpoint_internal::PathExists(
            JoinPath(opts_.directory, StepDirectoryName(request.step)))) {
      return absl::AlreadyExistsError(
          absl::StrCat("step ", request.step, " is already committed in '", opts_.directory, "'"));
    }
    checkpoint_internal::PlanOptions po;
    po.rank = rank_;
    po.world_size = world_;
    po.max_file_bytes = opts_.max_file_bytes;
    po.checksum = opts_.checksum;
    po.chunk_bytes = opts_.chunk_bytes;
    STRATA_ASSIGN_OR_RETURN(*plan, checkpoint_internal::PlanRankSave(request, po));
    STRATA_RETURN_IF_ERROR_CTX(staging_.Reserve(plan->arena_bytes).status(), "saving step ",
                               request.step);
    if (plan->any_device) {
      STRATA_RETURN_IF_ERROR_CTX(staging_.PinForDevice(), "saving step ", request.step);
    }
    STRATA_RETURN_IF_ERROR_CTX(
        checkpoint_internal::StageRankSave(request, *plan, staging_.data(), threads_),
        "staging step ", request.step);
    std::lock_guard<std::mutex> l(mu_);
    staging_capacity_ = staging_.capacity();
    staging_allocations_ = staging_.allocations();
    return absl::OkStatus();
  }

  void WriterLoop() {
    if (opts_.io_priority == IoPriority::kLow) LowerIoPriority();
    while (true) {
      Job job;
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [this] { return JobOrStop(); });
        if (queue_.empty()) return;  // stop_ and nothing left to do
        job = std::move(queue_.front());
        queue_.pop_front();
        running_ = true;
      }
      if (job.plan == nullptr) {
        const checkpoint_internal::ProtocolResult r =
            checkpoint_internal::CastFailureVote(ctx_, job.step, job.vote);
        std::lock_guard<std::mutex> l(mu_);
        if (r.comm_failed) comm_failure_ = r.status;
        running_ = false;
        cv_.notify_all();
        continue;
      }
      SaveStats stats;
      const checkpoint_internal::ProtocolResult r =
          checkpoint_internal::RunSaveProtocol(ctx_, *job.plan, staging_.data(), &stats);
      std::lock_guard<std::mutex> l(mu_);
      cv_.notify_all();
      last_.write_seconds = stats.write_seconds;
      last_.commit_seconds = stats.commit_seconds;
      last_.bytes_written = stats.bytes_written;
      last_.files_written = stats.files_written;
      if (r.status.ok()) {
        last_committed_ = job.step;
      } else {
        if (r.comm_failed) comm_failure_ = r.status;
        pending_ = internal::Annotate(r.status, absl::StrCat("background save of step ", job.step,
                                                             " to '", opts_.directory, "' failed"));
        if (!superseded_.empty()) {
          pending_ = absl::AbortedError(absl::StrCat("background save of step ", job.step, " to '",
                                                     opts_.directory, "' failed: ", superseded_,
                                                     ": ", r.status.message()));
        }
      }
      in_flight_ = false;
      running_ = false;
      state_ = SaveStatus::State::kIdle;
      step_in_flight_ = -1;
    }
  }

  CheckpointOptions opts_;
  const bool multi_rank_;
  // Held by Save and Abandon: one Follow at a time.
  std::mutex follow_mu_;
  // The communicator split off opts_.split_from (destroyed after the
  // writer thread is joined), replaced by Follow; guarded by mu_.
  std::unique_ptr<Communicator> owned_comm_;
  // The world generation owned_comm_ was split at (1 for a fixed handle).
  uint64_t generation_ = 0;
  // Set by Follow while it abandons a save of an old generation: why.
  std::string superseded_;
  int rank_ = 0;
  int world_ = 1;
  int threads_ = 1;
  checkpoint_internal::ProtocolContext ctx_;
  std::atomic<bool> cancel_{false};

  // std::mutex rather than absl::Mutex: the system abseil is not built with
  // TSan, which then cannot see its happens-before edges.
  mutable std::mutex mu_;
  std::condition_variable cv_;  // notified whenever the fields below change
  // Guarded by mu_:
  bool closed_ = false;
  bool stop_ = false;
  bool in_flight_ = false;  // a save between Save() and the end of its write
  bool running_ = false;    // the writer is working on a job
  SaveStatus::State state_ = SaveStatus::State::kIdle;
  int64_t step_in_flight_ = -1;
  int64_t last_committed_ = -1;
  absl::Status pending_;
  // Set when an agreement itself failed (deadline, lost peer).
  absl::Status comm_failure_;
  SaveStats last_;
  uint64_t staging_capacity_ = 0;
  int staging_allocations_ = 0;
  std::deque<Job> queue_;

  // Used by Save() while staging and by the writer while writing; never at
  // once (in_flight_ hands it over under mu_).
  checkpoint_internal::StagingBuffer staging_;
  std::thread writer_;
};

absl::StatusOr<std::unique_ptr<Checkpointer>> Checkpointer::Create(
    const CheckpointOptions& options) {
  STRATA_RETURN_IF_ERROR(ValidateOptions(options));
  std::unique_ptr<Communicator> owned;
  Communicator* comm = nullptr;
  uint64_t generation = 0;
  if (!options.group.empty()) {
    STRATA_ASSIGN_OR_RETURN(comm, options.group.Resolve(&generation));
  } else if (!options.split_from.empty()) {
    STRATA_ASSIGN_OR_RETURN(Communicator * parent, options.split_from.Resolve(&generation));
    STRATA_ASSIGN_OR_RETURN(owned, SplitCheckpointComm(*parent, options.commit_timeout));
    comm = owned.get();
  }
  return std::unique_ptr<Checkpointer>(
      new Checkpointer(std::make_unique<Impl>(options, comm, std::move(owned), generation)));
}

Checkpointer::Checkpointer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Checkpointer::~Checkpointer() = default;

absl::Status Checkpointer::Save(const SaveRequest& request) { return impl_->Save(request); }
absl::Status Checkpointer::Abandon(int64_t step, const absl::Status& reason) {
  return impl_->Abandon(step, reason);
}
absl::Status Checkpointer::Wait(absl::Time deadline) { return impl_->Wait(deadline); }
SaveStatus Checkpointer::status() const { return impl_->status(); }
absl::Status Checkpointer::Close(absl::Time deadline) { return impl_->Close(deadline); }

}  // namespace strata
