// Structure and fault handling of the MPI backend: the root communicator,
// Split, Shrink, Abort, Revoke and AsyncError (see mpi_communicator.h for
// the design of Shrink).
#include <algorithm>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "comm/common/host_share.h"
#include "comm/mpi/mpi_communicator.h"
#include "strata/base/status.h"

#ifdef STRATA_HAVE_ULFM
#include <mpi-ext.h>
#endif

namespace strata::mpi {
namespace {

// Tags on the control communicator. Each Shrink uses its own tag (by its
// survivors and attempt, ShrinkPlan), so that messages of an attempt that
// timed out cannot be taken for those of the next one.
constexpr int kShrinkTagBase = 1000;
constexpr int kShrinkTagSpan = 8192;

// A nonblocking MPI call whose output handle MPI writes at completion: the
// handle lives in the op's scratch until then.
std::shared_ptr<Op> NewOp(Engine& engine, std::string what, absl::Time deadline) {
  return std::make_shared<Op>(std::move(what), nullptr, deadline, absl::ZeroDuration(),
                              engine.wakeup());
}

MPI_Comm* CommSlot(Op& op) {
  op.scratch.emplace_back(sizeof(MPI_Comm));
  return reinterpret_cast<MPI_Comm*>(op.scratch.back().data());
}

// Makes `comm` return errors instead of aborting the job and duplicates it
// for the control communicator. The duplication also makes creation safe
// to revoke: MPI_Comm_idup completes on a rank only once every member has
// joined it, i.e. has finished creating `comm` (Open MPI 5.0.11 crashes in
// ompi_comm_revoke_local when a revocation reaches a process still inside
// the creating call). No other collective may be started on `comm` while
// the idup is pending: its internal agreement issues nonblocking
// collectives lazily, which then pair up with the wrong ones on other ranks
// (seen as MPI_ERR_TRUNCATE in a libnbc schedule).
absl::StatusOr<MPI_Comm> FinishCreation(Engine& engine, MPI_Comm comm, absl::Time deadline,
                                        absl::string_view what) {
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  auto op = NewOp(engine, absl::StrCat(what, ": duplicating the new communicator"), deadline);
  MPI_Comm* ctrl = CommSlot(*op);
  MPI_Request r;
  int rc = MPI_Comm_idup(comm, ctrl, &r);
  if (rc != MPI_SUCCESS) return FromMpi(rc, comm, op->description());
  op->requests.push_back(r);
  STRATA_RETURN_IF_ERROR(WaitRequests(engine, op, deadline, comm));
  MPI_Comm_set_errhandler(*ctrl, MPI_ERRORS_RETURN);
  return *ctrl;
}

#ifdef STRATA_HAVE_ULFM
// True once MPI reports every rank of `excluded` (ranks of `comm`) as
// failed in this process's view, polled until `until`.
bool ExcludedReportedFailed(MPI_Comm comm, const std::vector<int>& excluded, absl::Time until) {
  absl::Duration pause = absl::Milliseconds(1);
  while (true) {
    std::vector<int> failed = FailedRanks(comm);
    std::sort(failed.begin(), failed.end());
    if (std::includes(failed.begin(), failed.end(), excluded.begin(), excluded.end())) return true;
    if (absl::Now() >= until) return false;
    // Lets MPI handle the failure notices that arrived (a probe of a tag
    // nobody sends; its result does not matter).
    int flag = 0;
    (void)MPI_Iprobe(MPI_ANY_SOURCE, kShrinkTagBase - 1, comm, &flag, MPI_STATUS_IGNORE);
    absl::SleepFor(std::min(pause, until - absl::Now()));
    pause = std::min(pause * 2, absl::Milliseconds(10));
  }
}
#endif

}  // namespace

absl::StatusOr<std::unique_ptr<MpiCommunicator>> MpiCommunicator::CreateRoot(
    const RootOptions& options, int expected_rank, int expected_size) {
  if (options.mpi.busy_poll < absl::ZeroDuration() ||
      options.mpi.max_poll_interval < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("MpiOptions: busy_poll ", absl::FormatDuration(options.mpi.busy_poll),
                     " and max_poll_interval ", absl::FormatDuration(options.mpi.max_poll_interval),
                     " must not be negative"));
  }
  if (!options.mpi.oversubscribed.has_value()) {
    const comm_internal::HostShare share = comm_internal::DetectHostShare();
    if (!share.invalid_env.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cannot tell how many ranks share this host (to know whether they outnumber its "
          "cores): ",
          share.invalid_env, "; set STRATA_OVERSUBSCRIBED=1 or 0 to say it"));
    }
  }
  STRATA_ASSIGN_OR_RETURN(const RuntimeInfo* info, EnsureInitialized());
  if (info->world_rank != expected_rank || info->world_size != expected_size) {
    return absl::FailedPreconditionError(absl::StrCat(
        "MPI sees this process as rank ", info->world_rank, " of ", info->world_size,
        " but the launch environment says rank ", expected_rank, " of ", expected_size,
        " (under Slurm, launch with srun --mpi=pmix; torchrun jobs need a store-bootstrapped "
        "backend)"));
  }
  auto engine = std::make_shared<Engine>(options.mpi);
  const absl::Time deadline = absl::Now() + options.comm.timeout;
  const std::string what =
      absl::StrCat("creating the root communicator '", options.comm.name, "' (world rank ",
                   info->world_rank, " of ", info->world_size, ")");
  auto op = NewOp(*engine, what, deadline);
  MPI_Comm* comm = CommSlot(*op);
  MPI_Request r;
  int rc = MPI_Comm_idup(MPI_COMM_WORLD, comm, &r);
  if (rc != MPI_SUCCESS) return FromMpi(rc, MPI_COMM_WORLD, what);
  op->requests.push_back(r);
  STRATA_RETURN_IF_ERROR(WaitRequests(*engine, op, deadline, MPI_COMM_WORLD));
  STRATA_ASSIGN_OR_RETURN(MPI_Comm ctrl, FinishCreation(*engine, *comm, deadline, what));
  // The root's id: random on rank 0, shared with the others, so that roots
  // created one after another in a process never share an id.
  auto id_op = NewOp(*engine, absl::StrCat(what, ": sharing its id"), deadline);
  id_op->scratch.emplace_back(sizeof(uint64_t));
  uint64_t* id = reinterpret_cast<uint64_t*>(id_op->scratch.back().data());
  *id = (static_cast<uint64_t>(std::random_device()()) << 32) ^ std::random_device()();
  rc = MPI_Ibcast(id, 1, MPI_UINT64_T, 0, *comm, &r);
  if (rc != MPI_SUCCESS) return FromMpi(rc, *comm, id_op->description());
  id_op->requests.push_back(r);
  STRATA_RETURN_IF_ERROR(WaitRequests(*engine, id_op, deadline, *comm));
  auto state = std::make_shared<CommState>(*comm, ctrl, options.comm.name, info->world_rank,
                                           absl::StrCat("r", absl::Hex(*id)));
  return std::make_unique<MpiCommunicator>(std::move(engine), std::move(state), options.comm);
}

std::unique_ptr<MpiCommunicator> MpiCommunicator::Wrap(MPI_Comm comm, MPI_Comm ctrl,
                                                       const CommOptions& options,
                                                       std::string uid) {
  auto state =
      std::make_shared<CommState>(comm, ctrl, options.name, state_->world_rank(), std::move(uid));
  return std::make_unique<MpiCommunicator>(engine_, std::move(state), options);
}

absl::StatusOr<std::unique_ptr<Communicator>> MpiCommunicator::DoSplit(
    int color, int key, const CommOptions& options, const ResolvedOptions& resolved) {
  const absl::Time deadline = resolved.deadline;
  const std::string& what = resolved.description;
  // MPI_Comm_split blocks without a deadline; a barrier that has one first
  // makes sure every rank has arrived. It is part of the split, not an
  // operation of its own: the hook, unrecorded.
  ResolvedOptions barrier_options;
  barrier_options.deadline = deadline;
  barrier_options.timeout = resolved.timeout;
  barrier_options.description = absl::StrCat(what, ": barrier");
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Work> barrier, DoBarrier(barrier_options));
  STRATA_RETURN_IF_ERROR_CTX(barrier->Wait(deadline), what);
  MPI_Comm comm = MPI_COMM_NULL;
  std::string uid;
  {
    std::lock_guard<std::mutex> lock(state_->issue_mu());
    STRATA_RETURN_IF_ERROR(state_->CheckUsable(what));  // `what` names the group
    uid = absl::StrCat(state_->uid(), "/s", state_->next_split_seq(), "c", color);
    int rc = MPI_Comm_split(state_->comm(), color < 0 ? MPI_UNDEFINED : color, key, &comm);
    if (rc != MPI_SUCCESS) return FromMpi(rc, state_->comm(), what);
  }
  if (comm == MPI_COMM_NULL) return std::unique_ptr<Communicator>();
  STRATA_ASSIGN_OR_RETURN(MPI_Comm ctrl, FinishCreation(*engine_, comm, deadline, what));
  return std::unique_ptr<Communicator>(Wrap(comm, ctrl, options, std::move(uid)));
}

absl::StatusOr<std::unique_ptr<Communicator>> MpiCommunicator::DoShrink(
    const ShrinkPlan& plan, const CommOptions& options, const ResolvedOptions& resolved) {
  const std::string& what = resolved.description;
  const std::vector<int>& survivors = plan.survivors;
  const int m = static_cast<int>(survivors.size());
  const int me = plan.new_rank;
  const absl::Time deadline = resolved.deadline;
  // Numbered alike by every survivor (the excluded ranks' count of shrinks
  // may differ), and differently from an earlier attempt whose messages may
  // still be in flight.
  const int64_t seq = plan.attempt;
  const int tag =
      kShrinkTagBase +
      static_cast<int>((plan.survivors_hash + static_cast<uint64_t>(seq)) % kShrinkTagSpan);
  const int64_t hash = static_cast<int64_t>(plan.survivors_hash >> 1);
  const MPI_Comm ctrl = state_->ctrl();

  absl::StatusOr<const RuntimeInfo*> info = EnsureInitialized();
  const bool fault_tolerant = info.ok() && (*info)->fault_tolerant;

  // 0. Under ULFM, with excluded ranks that are dead or going
  // (options.excluded_exit_wait), wait a bounded time for MPI to report
  // them failed: then MPIX_Comm_shrink, ULFM's own way, builds the new
  // communicator (step 2).
  int64_t gone = 0;
#ifdef STRATA_HAVE_ULFM
  if (fault_tolerant && m < size() && options.excluded_exit_wait > absl::ZeroDuration()) {
    gone = ExcludedReportedFailed(ctrl, plan.excluded,
                                  std::min(deadline, absl::Now() + options.excluded_exit_wait))
               ? 1
               : 0;
  }
#endif

  // 1. Rendezvous of the survivors (a dissemination barrier) on the control
  // communicator, bounded by the deadline: after it, every survivor is
  // known to be alive and inside this Shrink with the same survivor set.
  // The messages also spread whether any survivor knows of a failed rank
  // and whether all of them saw every excluded rank fail, so that all
  // choose the same way to create the communicator.
  int64_t failures = FailedRanks(ctrl).empty() && FailedRanks(state_->comm()).empty() ? 0 : 1;
  for (int distance = 1; distance < m; distance *= 2) {
    const int to = survivors[static_cast<size_t>((me + distance) % m)];
    const int from = survivors[static_cast<size_t>((me - distance + m) % m)];
    auto op = NewOp(*engine_, absl::StrCat(what, ": meeting survivor ranks ", to, " and ", from),
                    deadline);
    op->scratch.emplace_back(8 * sizeof(int64_t));
    int64_t* msg = reinterpret_cast<int64_t*>(op->scratch.back().data());
    msg[0] = seq;
    msg[1] = hash;
    msg[2] = failures;
    msg[3] = gone;
    MPI_Request r[2];
    int rc = MPI_Irecv(msg + 4, 4, MPI_INT64_T, from, tag, ctrl, &r[0]);
    if (rc == MPI_SUCCESS) {
      op->requests.push_back(r[0]);
      rc = MPI_Isend(msg, 4, MPI_INT64_T, to, tag, ctrl, &r[1]);
      if (rc == MPI_SUCCESS) op->requests.push_back(r[1]);
    }
    if (rc != MPI_SUCCESS) {
      engine_->Adopt(op);
      return FromMpi(rc, ctrl, op->description());
    }
    absl::Status met = WaitRequests(*engine_, op, deadline, ctrl);
    if (!met.ok()) {
      if (met.GetPayload(kRankFailurePayload).has_value()) {
        return internal::Annotate(met, "a survivor has failed; exclude it too");
      }
      return met;
    }
    if (msg[4] != seq || msg[5] != hash) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": survivor rank ", from,
          " passed a different list of excluded ranks (every survivor must pass the same list)"));
    }
    failures |= msg[6];
    gone &= msg[7];
  }
  const std::string uid =
      absl::StrCat(state_->uid(), "/k", absl::Hex(plan.survivors_hash), "-", seq);

  // 2. Create the communicator among the survivors only, all of them the
  // same way.
  MPI_Comm comm = MPI_COMM_NULL;
  int rc = MPI_SUCCESS;
#ifdef STRATA_HAVE_ULFM
  if (gone != 0) {
    // Every excluded rank is failed in every survivor's view, so the
    // survivors are the live ranks and MPIX_Comm_shrink (no deadline, but
    // it tolerates ranks failing inside it) needs no one else. A survivor
    // lost meanwhile leaves a smaller communicator: an error, so that the
    // caller shrinks again without it.
    rc = MPIX_Comm_shrink(ctrl, &comm);
    if (rc != MPI_SUCCESS) return FromMpi(rc, ctrl, absl::StrCat(what, ": MPIX_Comm_shrink"));
    int got_size = 0, got_rank = -1;
    MPI_Comm_size(comm, &got_size);
    MPI_Comm_rank(comm, &got_rank);
    if (got_size != m || got_rank != me) {
      MPI_Comm_free(&comm);
      return absl::UnavailableError(
          absl::StrCat(what, ": MPIX_Comm_shrink kept ", got_size, " ranks (this one as rank ",
                       got_rank, ") where ", m, " survivors were expected (this one as rank ", me,
                       "): a survivor failed during the shrink; exclude it too"));
    }
    STRATA_ASSIGN_OR_RETURN(MPI_Comm new_ctrl, FinishCreation(*engine_, comm, deadline, what));
    return std::unique_ptr<Communicator>(Wrap(comm, new_ctrl, options, uid));
  }
#endif
  // Otherwise (excluded ranks that may be alive, or MPI still reports one
  // of them alive): MPI_Comm_create_group on the control communicator
  // (only the group's members take part) fails under ULFM with
  // MPI_ERR_PROC_FAILED on a rank that knows of a failed rank in the
  // parent, even one outside the group, while the members that do not know
  // yet wait in it for the ones that failed out, without a deadline. What a
  // rank knows can change after the rendezvous (a strata heartbeat or
  // probe may find a death before ULFM does, and ULFM then reports it to
  // each rank at its own moment), so when ranks are excluded under fault
  // tolerance, or when any survivor knows of a failure, the communicator is
  // built from the group alone with MPI_Comm_create_from_group (PMIx),
  // which does not look at the parent, named by the uid that every
  // survivor computes alike. Without fault tolerance a failure ends the
  // job, and create_group (which also works in a singleton) is used.
  const bool from_group = failures != 0 || (fault_tolerant && m < size());
  MPI_Group parent = MPI_GROUP_NULL, group = MPI_GROUP_NULL;
  rc = MPI_Comm_group(ctrl, &parent);
  if (rc == MPI_SUCCESS) rc = MPI_Group_incl(parent, m, plan.survivors.data(), &group);
  if (rc == MPI_SUCCESS) {
    rc = from_group ? MPI_Comm_create_from_group(group, uid.c_str(), MPI_INFO_NULL,
                                                 MPI_ERRORS_RETURN, &comm)
                    : MPI_Comm_create_group(ctrl, group, tag, &comm);
  }
  if (group != MPI_GROUP_NULL) MPI_Group_free(&group);
  if (parent != MPI_GROUP_NULL) MPI_Group_free(&parent);
  if (rc != MPI_SUCCESS) return FromMpi(rc, ctrl, what);
  STRATA_ASSIGN_OR_RETURN(MPI_Comm new_ctrl, FinishCreation(*engine_, comm, deadline, what));
  return std::unique_ptr<Communicator>(Wrap(comm, new_ctrl, options, uid));
}

absl::Status MpiCommunicator::DoAbort() {
  // Pending operations first, so that they fail with this message rather
  // than with the engine's "the communicator broke".
  engine_->FailPending(state_.get(),
                       absl::AbortedError("the communicator was aborted by this rank"));
  state_->SetAborted();
  return absl::OkStatus();
}

absl::Status MpiCommunicator::DoRevoke() {
#ifdef STRATA_HAVE_ULFM
  if (Finalized()) {
    return absl::FailedPreconditionError(
        absl::StrCat("revoke on ", state_->where(), ": MPI is already finalised"));
  }
  // Without fault tolerance on, MPIX_Comm_revoke returns but the other
  // ranks never hear of it: refuse rather than revoke this rank alone.
  absl::StatusOr<const RuntimeInfo*> info = EnsureInitialized();
  if (size() > 1 && info.ok() && !(*info)->fault_tolerant) {
    return absl::FailedPreconditionError(absl::StrCat(
        "revoke on ", state_->where(),
        ": this job runs without MPI fault tolerance, so a revocation would not reach the other "
        "ranks; launch with mpirun --with-ft ulfm, or abort instead"));
  }
  int rc = MPIX_Comm_revoke(state_->comm());
  if (rc != MPI_SUCCESS) {
    return FromMpi(rc, state_->comm(), absl::StrCat("revoke on ", state_->where()));
  }
  engine_->FailPending(state_.get(),
                       absl::AbortedError("the communicator was revoked by this rank"));
  state_->SetRevoked(absl::AbortedError(absl::StrCat(state_->where(), ": revoked by this rank")));
  return absl::OkStatus();
#else
  return absl::UnimplementedError(absl::StrCat(
      "revoke on ", state_->where(),
      ": this build's MPI has no ULFM extension (MPIX_Comm_revoke); use Open MPI 5 with ftmpi"));
#endif
}

absl::Status MpiCommunicator::DoAsyncError() {
  STRATA_RETURN_IF_ERROR(state_->Health());
  const std::vector<int> failed = FailedRanks(state_->comm());
  if (failed.empty()) return absl::OkStatus();
  absl::Status s = absl::UnavailableError(absl::StrCat(
      state_->where(), ": MPI reports failed peer ranks ", absl::StrJoin(failed, ", ")));
  s.SetPayload(kRankFailurePayload, absl::Cord(absl::StrJoin(failed, ",")));
  return s;
}

}  // namespace strata::mpi
