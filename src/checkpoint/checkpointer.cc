#include "strata/checkpoint/checkpointer.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/internal/commit.h"
#include "checkpoint/internal/file_util.h"
#include "checkpoint/internal/manifest_internal.h"
#include "checkpoint/internal/rank_writer.h"
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
  if (o.busy_timeout < absl::ZeroDuration() || o.commit_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("busy_timeout must be >= 0 and commit_timeout > 0");
  }
  return absl::OkStatus();
}

}  // namespace

class Checkpointer::Impl {
 public:
  explicit Impl(const CheckpointOptions& options) : opts_(options) {
    if (opts_.comm != nullptr) {
      rank_ = opts_.comm->rank();
      world_ = opts_.comm->size();
    }
    if (!opts_.warn) {
      opts_.warn = [](const absl::Status& s) {
        std::fprintf(stderr, "strata checkpoint warning: %s\n", s.ToString().c_str());
      };
    }
    threads_ = opts_.staging_threads > 0
                   ? opts_.staging_threads
                   : static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 4u));
    writer_ = std::thread([this] { WriterLoop(); });
  }

  ~Impl() {
    if (!Close(absl::Now() + opts_.commit_timeout).ok()) {
      // Still in flight past the deadline: cancel it (it will not commit)
      // and wait for the writer to notice, bounded by one write or one
      // agreement deadline.
      cancel_.store(true);
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l, [this] { return Idle(); });
      stop_ = true;
      cv_.notify_all();
    }
    if (writer_.joinable()) writer_.join();
  }

  absl::Status Save(const SaveRequest& request) {
    const absl::Time start = absl::Now();
    // A failure reported as a warning goes to the callback on every way out,
    // after mu_ is released (the callback is user code).
    absl::Status to_warn;
    auto warn_on_exit = absl::MakeCleanup([&] {
      if (!to_warn.ok()) opts_.warn(to_warn);
    });
    {
      std::unique_lock<std::mutex> l(mu_);
      if (closed_) return absl::FailedPreconditionError(Closed());
      STRATA_RETURN_IF_ERROR(ReportPendingLocked(&to_warn));
      if (!comm_failure_.ok()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "the checkpoint communicator failed in an earlier save (", comm_failure_.message(),
            "); its ranks may no longer agree on the order of collectives: create a new "
            "Checkpointer with a new communicator"));
      }
      if (in_flight_) {
        if (opts_.on_busy == BusyPolicy::kRefuse) {
          return absl::FailedPreconditionError(
              absl::StrCat("save of step ", request.step, " refused: the save of step ",
                           step_in_flight_, " is still in flight (on_busy = refuse)"));
        }
        if (!WaitUntil(l, absl::Now() + opts_.busy_timeout, [this] { return IdleOrClosed(); })) {
          return absl::DeadlineExceededError(
              absl::StrCat("save of step ", request.step, ": the save of step ", step_in_flight_,
                           " was still in flight after busy_timeout ",
                           absl::FormatDuration(opts_.busy_timeout)));
        }
        if (closed_) return absl::FailedPreconditionError(Closed());
        STRATA_RETURN_IF_ERROR(ReportPendingLocked(&to_warn));
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
      return st;
    }
    job_ = std::move(plan);
    state_ = SaveStatus::State::kWriting;
    last_ = SaveStats{};
    last_.step = request.step;
    last_.staging_seconds = Seconds(start);
    return absl::OkStatus();
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
  // Predicates; called with mu_ held.
  bool Idle() const { return !in_flight_; }
  bool IdleOrClosed() const { return !in_flight_ || closed_; }
  bool JobOrStop() const { return job_ != nullptr || stop_; }

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
      std::unique_ptr<checkpoint_internal::SavePlan> job;
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [this] { return JobOrStop(); });
        if (job_ == nullptr) return;  // stop_ and nothing left to write
        job = std::move(job_);
      }
      SaveStats stats;
      absl::Status st = RunSave(*job, &stats);
      std::lock_guard<std::mutex> l(mu_);
      cv_.notify_all();
      last_.write_seconds = stats.write_seconds;
      last_.commit_seconds = stats.commit_seconds;
      last_.bytes_written = stats.bytes_written;
      last_.files_written = stats.files_written;
      if (st.ok()) {
        last_committed_ = job->step;
      } else {
        if (comm_failed_.load()) comm_failure_ = st;
        pending_ = internal::Annotate(st, absl::StrCat("background save of step ", job->step,
                                                       " to '", opts_.directory, "' failed"));
      }
      in_flight_ = false;
      state_ = SaveStatus::State::kIdle;
      step_in_flight_ = -1;
    }
  }

  // An agreement; a failure of the collective itself (not a rank voting
  // "failed") poisons the communicator for later saves.
  absl::StatusOr<checkpoint_internal::Agreement> Agree(bool ok, absl::string_view phase) {
    absl::StatusOr<checkpoint_internal::Agreement> a =
        checkpoint_internal::Agree(opts_.comm, ok, absl::Now() + opts_.commit_timeout, phase);
    if (!a.ok()) comm_failed_.store(true);
    return a;
  }

  absl::Status Hook(absl::string_view point) {
    if (cancel_.load())
      return absl::CancelledError(absl::StrCat("save cancelled (at ", point, ")"));
    return opts_.test_hook ? opts_.test_hook(point) : absl::OkStatus();
  }

  // The writer's part of a save: the protocol of commit.h.
  absl::Status RunSave(const checkpoint_internal::SavePlan& plan, SaveStats* stats) {
    namespace ci = checkpoint_internal;
    const std::string& root = opts_.directory;
    const bool coordinator = rank_ == 0;
    const absl::Time start = absl::Now();

    absl::Status prepared =
        coordinator ? ci::PrepareStepDirectory(root, plan.step) : absl::OkStatus();
    STRATA_ASSIGN_OR_RETURN(ci::Agreement a, Agree(prepared.ok(), "prepare"));
    STRATA_RETURN_IF_ERROR(prepared);
    if (!a.all_ok) {
      return absl::AbortedError(absl::StrCat(
          "rank ", a.first_failed_rank, " could not prepare the directory of step ", plan.step));
    }
    const std::string tmp = JoinPath(root, ci::TmpDirectoryName(plan.step));
    absl::Status wrote = Hook("prepared");
    if (wrote.ok()) {
      ci::WriteControl control;
      control.hook = [this](absl::string_view p) { return Hook(p); };
      control.cancel = &cancel_;
      absl::StatusOr<Manifest> frag = ci::WriteRankFiles(plan, staging_.data(), tmp, control);
      wrote = frag.status();
      if (frag.ok()) {
        for (const ManifestFile& f : frag->files) stats->bytes_written += f.size;
        stats->files_written = static_cast<int>(frag->files.size());
        absl::StatusOr<std::string> text = ci::SerializeManifestUnvalidated(*frag);
        wrote = text.ok() ? ci::WriteNewFile(JoinPath(tmp, ci::FragmentFileName(rank_)), *text)
                          : text.status();
      }
    }
    stats->write_seconds = Seconds(start);
    const absl::Time commit_start = absl::Now();
    STRATA_ASSIGN_OR_RETURN(a, Agree(wrote.ok(), "write"));
    if (!wrote.ok() || !a.all_ok) {
      if (coordinator) (void)ci::RemoveTree(tmp);  // nothing of this save stays
      STRATA_RETURN_IF_ERROR(wrote);
      return absl::AbortedError(absl::StrCat("rank ", a.first_failed_rank,
                                             " failed to write its shards of step ", plan.step,
                                             "; the save was abandoned"));
    }
    absl::Status committed = absl::OkStatus();
    if (coordinator) {
      committed = Hook("agreed");
      if (committed.ok()) {
        committed = ci::CommitStep(root, plan.step, world_,
                                   [this](absl::string_view p) { return Hook(p); });
      }
      if (!committed.ok() && !ci::PathExists(JoinPath(root, StepDirectoryName(plan.step)))) {
        (void)ci::RemoveTree(tmp);
      }
    }
    STRATA_ASSIGN_OR_RETURN(a, Agree(committed.ok(), "commit"));
    STRATA_RETURN_IF_ERROR(committed);
    if (!a.all_ok) {
      return absl::AbortedError(
          absl::StrCat("the commit of step ", plan.step, " failed on rank ", a.first_failed_rank));
    }
    if (coordinator) {
      for (const absl::Status& s : ci::ApplyRetention(root, opts_.keep_last)) opts_.warn(s);
    }
    stats->commit_seconds = Seconds(commit_start);
    return absl::OkStatus();
  }

  CheckpointOptions opts_;
  int rank_ = 0;
  int world_ = 1;
  int threads_ = 1;
  std::atomic<bool> cancel_{false};
  // Set by the writer when an agreement itself failed (deadline, lost peer).
  std::atomic<bool> comm_failed_{false};

  // std::mutex rather than absl::Mutex: the system abseil is not built with
  // TSan, which then cannot see its happens-before edges.
  mutable std::mutex mu_;
  std::condition_variable cv_;  // notified whenever the fields below change
  // Guarded by mu_:
  bool closed_ = false;
  bool stop_ = false;
  bool in_flight_ = false;
  SaveStatus::State state_ = SaveStatus::State::kIdle;
  int64_t step_in_flight_ = -1;
  int64_t last_committed_ = -1;
  absl::Status pending_;
  absl::Status comm_failure_;
  SaveStats last_;
  uint64_t staging_capacity_ = 0;
  int staging_allocations_ = 0;
  std::unique_ptr<checkpoint_internal::SavePlan> job_;

  // Used by Save() while staging and by the writer while writing; never at
  // once (in_flight_ hands it over under mu_).
  checkpoint_internal::StagingBuffer staging_;
  std::thread writer_;
};

absl::StatusOr<std::unique_ptr<Checkpointer>> Checkpointer::Create(
    const CheckpointOptions& options) {
  STRATA_RETURN_IF_ERROR(ValidateOptions(options));
  return std::unique_ptr<Checkpointer>(new Checkpointer(std::make_unique<Impl>(options)));
}

Checkpointer::Checkpointer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Checkpointer::~Checkpointer() = default;

absl::Status Checkpointer::Save(const SaveRequest& request) { return impl_->Save(request); }
absl::Status Checkpointer::Wait(absl::Time deadline) { return impl_->Wait(deadline); }
SaveStatus Checkpointer::status() const { return impl_->status(); }
absl::Status Checkpointer::Close(absl::Time deadline) { return impl_->Close(deadline); }

}  // namespace strata
