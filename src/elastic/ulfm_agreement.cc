// The ULFM path of the agreement (agreement.h): MPIX_Comm_iagree over an
// elastic control communicator of the epoch's members.
//
// Every live member contributes a bit mask of the members it takes as
// alive: all but those ULFM reported failed and this rank acknowledged
// (MPIX_Comm_failure_ack / MPIX_Comm_failure_get_acked), those its backend
// reported (`suspects`) and those a planned change evicts. The agreement's
// result is the bitwise AND over the live members, the same on all of them
// (ULFM's guarantee); a member that dies before contributing makes the
// agreement fail with MPI_ERR_PROC_FAILED at every participant alike, and
// they all acknowledge and agree again. 31 members per agreement (an int
// flag): a world of W members takes ceil(W / 31) agreements.
//
// The next epoch's control communicator is made among the next members
// only, with MPI_Comm_create_from_group (ULFM refuses a parent that holds a
// failed rank), so the live ranks that leave take no part.
//
// What it cannot do: a member that hangs (SIGSTOP) is neither failed for
// ULFM (its failure detector is off by default: --mca mpi_ft_detector true)
// nor taking part, so the agreement does not complete; every member then
// fails with DeadlineExceeded after `decision_timeout`, saying so. The store
// agreement handles that case (its leader decides without the silent rank).
#include <algorithm>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "elastic/internal/keys.h"
#include "strata/base/status.h"
#include "strata/elastic/agreement.h"
#include "strata/elastic/heartbeat.h"

#if defined(STRATA_HAVE_ULFM)
#include <mpi.h>
// After mpi.h, which it needs.
#include <mpi-ext.h>

#include "comm/mpi/mpi_runtime.h"
#endif

namespace strata::elastic {

#if defined(STRATA_HAVE_ULFM)
namespace {

constexpr int kBitsPerAgreement = 31;  // of the int flag, keeping it positive

std::string MpiText(int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  return std::string(text, static_cast<size_t>(len));
}

bool IsProcessFailure(int rc) {
  int cls = rc;
  MPI_Error_class(rc, &cls);
  return cls == MPIX_ERR_PROC_FAILED || cls == MPIX_ERR_PROC_FAILED_PENDING ||
         cls == MPIX_ERR_REVOKED;
}

class UlfmAgreement final : public Agreement {
 public:
  UlfmAgreement(MPI_Comm ctl, std::vector<int> members, std::shared_ptr<Store> store,
                ElasticOptions options)
      : ctl_(ctl),
        members_(std::move(members)),
        store_(std::move(store)),
        options_(std::move(options)) {}

  // The control communicators are not freed: one that held a failed
  // process is left to MPI_Finalize (one per epoch and process), since
  // freeing it is where a run was seen to hang at exit (1 of 5 runs).
  ~UlfmAgreement() override = default;

  const char* name() const override { return "ulfm"; }

  absl::StatusOr<Decision> Agree(const Membership& current, int rank,
                                 const std::vector<int>& suspects) override {
    const std::string where = absl::StrCat("the ULFM agreement (MPIX_Comm_iagree) of epoch ",
                                           current.epoch, " on rank ", rank);
    if (current.members != members_) {
      return absl::InternalError(absl::StrCat(where, ": the control communicator holds [",
                                              absl::StrJoin(members_, ", "), "], the epoch [",
                                              absl::StrJoin(current.members, ", "), "]"));
    }
    const absl::Time deadline = absl::Now() + options_.decision_timeout;
    Decision d;
    d.epoch = current.epoch;
    d.next_epoch = current.epoch + 1;
    // The cause, for the event (and a planned change's evictions): the
    // epoch's alarm, when the store has it already.
    const internal::Keys keys(options_.job, current.epoch);
    absl::StatusOr<std::string> alarm = store_->Get(keys.Alarm(), absl::InfinitePast());
    if (alarm.ok()) {
      absl::StatusOr<Detection> cause = DecodeDetection(*alarm);
      if (cause.ok()) d.cause = *cause;
    }
    const int n = static_cast<int>(members_.size());
    std::vector<bool> alive(static_cast<size_t>(n), true);
    std::vector<std::string> why(static_cast<size_t>(n));
    int rounds = 0;
    while (true) {
      ++rounds;
      // This rank's view: acknowledged failures, the backend's reports,
      // evictions.
      MPIX_Comm_failure_ack(ctl_);
      std::vector<bool> mine(static_cast<size_t>(n), true);
      for (int r : AckedFailed()) {
        mine[static_cast<size_t>(r)] = false;
        why[static_cast<size_t>(r)] = "failed (ULFM: MPI_ERR_PROC_FAILED, agreed)";
      }
      for (int job : suspects) {
        const int r = current.RootRankOf(job);
        if (r >= 0 && mine[static_cast<size_t>(r)]) {
          mine[static_cast<size_t>(r)] = false;
          why[static_cast<size_t>(r)] =
              "reported failed by a survivor's backend (agreed over ULFM)";
        }
      }
      if (d.cause.source == DetectionSource::kRequest) {
        for (int job : d.cause.evict) {
          const int r = current.RootRankOf(job);
          if (r >= 0) {
            mine[static_cast<size_t>(r)] = false;
            why[static_cast<size_t>(r)] =
                absl::StrCat("evicted by rank ", d.cause.reporter, ": ", d.cause.detail);
          }
        }
      }
      bool failed_round = false;
      for (int base = 0; base < n && !failed_round; base += kBitsPerAgreement) {
        int flag = 0;
        for (int b = 0; b < kBitsPerAgreement && base + b < n; ++b) {
          if (mine[static_cast<size_t>(base + b)]) flag |= 1 << b;
        }
        MPI_Request req = MPI_REQUEST_NULL;
        int rc = MPIX_Comm_iagree(ctl_, &flag, &req);
        absl::Duration pause = absl::Microseconds(50);
        int done = 0;
        while (rc == MPI_SUCCESS && !done) {
          rc = MPI_Test(&req, &done, MPI_STATUS_IGNORE);
          if (rc != MPI_SUCCESS || done) break;
          if (absl::Now() >= deadline) {
            // The request cannot be cancelled; it is left to MPI.
            return absl::DeadlineExceededError(absl::StrCat(
                where, ": not complete after ", absl::FormatDuration(options_.decision_timeout),
                " (ElasticOptions::decision_timeout): a member of [", absl::StrJoin(members_, ", "),
                "] neither took part nor was reported failed by ULFM (a hung or stopped rank: "
                "ULFM's failure detector is off by default, --mca mpi_ft_detector true; the store "
                "agreement, ElasticOptions::agreement = store, decides without it)"));
          }
          absl::SleepFor(pause);
          pause = std::min(pause * 2, absl::Milliseconds(2));
        }
        if (rc != MPI_SUCCESS) {
          if (!IsProcessFailure(rc))
            return absl::InternalError(absl::StrCat(where, ": ", MpiText(rc)));
          failed_round = true;  // raised at every participant alike: all go round again
          break;
        }
        for (int b = 0; b < kBitsPerAgreement && base + b < n; ++b) {
          alive[static_cast<size_t>(base + b)] = (flag >> b) & 1;
        }
      }
      if (!failed_round) break;
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat(where, ": members kept failing for ", rounds, " rounds"));
      }
    }
    d.known_by_all_at = absl::Now();
    int live = 0;
    for (int r = 0; r < n; ++r) {
      if (alive[static_cast<size_t>(r)]) {
        ++live;
        continue;
      }
      d.failed.push_back(members_[static_cast<size_t>(r)]);
      d.failed_why.push_back(why[static_cast<size_t>(r)].empty()
                                 ? "taken as failed by another survivor (agreed over ULFM)"
                                 : why[static_cast<size_t>(r)]);
    }
    // Failed job ranks sorted, as Decision says (root order is job order
    // only in the first epoch).
    std::vector<size_t> order(d.failed.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(),
              [&](size_t a, size_t b) { return d.failed[a] < d.failed[b]; });
    std::vector<int> sorted_failed;
    std::vector<std::string> sorted_why;
    for (size_t i : order) {
      sorted_failed.push_back(d.failed[i]);
      sorted_why.push_back(d.failed_why[i]);
    }
    d.failed = std::move(sorted_failed);
    d.failed_why = std::move(sorted_why);
    // The majority is of the members not evicted by a planned change (alive,
    // leaving by a decision every rank took).
    int voters = n;
    if (d.cause.source == DetectionSource::kRequest) {
      for (int job : d.cause.evict) voters -= current.RootRankOf(job) >= 0 ? 1 : 0;
    }
    if (live * 2 <= voters) {
      d.kind = Decision::Kind::kStop;
      d.stop_reason =
          absl::StrCat("only ", live, " of the ", n, " members of epoch ", current.epoch,
                       " are alive (agreed over ULFM), not a majority: the job stops");
    } else {
      d.Plan(current);
    }
    d.decided_at = absl::Now();
    if (d.kind == Decision::Kind::kContinue) {
      const Membership next = d.Next();
      if (std::find(next.members.begin(), next.members.end(), rank) != next.members.end()) {
        STRATA_RETURN_IF_ERROR(NextControl(current, next, where));
      }
    }
    return d;
  }

 private:
  // Control-communicator ranks whose failure this rank acknowledged.
  std::vector<int> AckedFailed() {
    std::vector<int> ranks;
    MPI_Group failed = MPI_GROUP_NULL, all = MPI_GROUP_NULL;
    if (MPIX_Comm_failure_get_acked(ctl_, &failed) != MPI_SUCCESS) return ranks;
    int k = 0;
    MPI_Group_size(failed, &k);
    if (k > 0 && MPI_Comm_group(ctl_, &all) == MPI_SUCCESS) {
      std::vector<int> in(static_cast<size_t>(k));
      for (int i = 0; i < k; ++i) in[static_cast<size_t>(i)] = i;
      ranks.resize(static_cast<size_t>(k));
      MPI_Group_translate_ranks(failed, k, in.data(), all, ranks.data());
      MPI_Group_free(&all);
    }
    MPI_Group_free(&failed);
    return ranks;
  }

  // The next epoch's control communicator, among its members only.
  absl::Status NextControl(const Membership& current, const Membership& next,
                           const std::string& where) {
    std::vector<int> ranks;
    for (int job : next.members) ranks.push_back(current.RootRankOf(job));
    const std::string tag = absl::StrCat("strata/elastic/", options_.job, "/ulfm/", next.epoch);
    MPI_Group parent = MPI_GROUP_NULL, group = MPI_GROUP_NULL;
    MPI_Comm comm = MPI_COMM_NULL;
    int rc = MPI_Comm_group(ctl_, &parent);
    if (rc == MPI_SUCCESS) {
      rc = MPI_Group_incl(parent, static_cast<int>(ranks.size()), ranks.data(), &group);
    }
    if (rc == MPI_SUCCESS) {
      rc = MPI_Comm_create_from_group(group, tag.c_str(), MPI_INFO_NULL, MPI_ERRORS_RETURN, &comm);
    }
    if (group != MPI_GROUP_NULL) MPI_Group_free(&group);
    if (parent != MPI_GROUP_NULL) MPI_Group_free(&parent);
    if (rc != MPI_SUCCESS) {
      // Not retried as a later epoch (Aborted, not Unavailable): the
      // members would not agree on which control communicator they hold.
      return absl::AbortedError(absl::StrCat(
          where, ": making the control communicator of epoch ", next.epoch,
          " (MPI_Comm_create_from_group) failed, a member was lost meanwhile: ", MpiText(rc)));
    }
    ctl_ = comm;  // the old one is left to MPI_Finalize (see the destructor)
    members_ = next.members;
    return absl::OkStatus();
  }

  MPI_Comm ctl_;
  std::vector<int> members_;
  const std::shared_ptr<Store> store_;
  const ElasticOptions options_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Agreement>> MakeUlfmAgreement(std::shared_ptr<Store> store,
                                                             const ElasticOptions& options,
                                                             const Membership& initial) {
  absl::StatusOr<const mpi::RuntimeInfo*> info = mpi::EnsureInitialized();
  if (!info.ok()) return info.status();
  if (!(*info)->fault_tolerant) {
    return absl::FailedPreconditionError(
        "ElasticOptions::agreement is ulfm, and this job runs without MPI fault tolerance: "
        "launch it with mpirun --with-ft ulfm, or use the store agreement");
  }
  if (static_cast<int>(initial.members.size()) != (*info)->world_size || initial.epoch != 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("ElasticOptions::agreement is ulfm: the World must be the whole MPI job (",
                     (*info)->world_size, " processes) at epoch 1; it has ", initial.members.size(),
                     " members at epoch ", initial.epoch));
  }
  MPI_Comm ctl = MPI_COMM_NULL;
  int rc = MPI_Comm_dup(MPI_COMM_WORLD, &ctl);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_set_errhandler(ctl, MPI_ERRORS_RETURN);
  if (rc != MPI_SUCCESS) {
    return absl::UnavailableError(
        absl::StrCat("the ULFM agreement's control communicator (MPI_Comm_dup): ", MpiText(rc)));
  }
  return std::unique_ptr<Agreement>(
      new UlfmAgreement(ctl, initial.members, std::move(store), options));
}

#else

absl::StatusOr<std::unique_ptr<Agreement>> MakeUlfmAgreement(std::shared_ptr<Store> /*store*/,
                                                             const ElasticOptions& /*options*/,
                                                             const Membership& /*initial*/) {
  return absl::UnimplementedError(
      "ElasticOptions::agreement is ulfm, and this build of strata has no MPI with the ULFM "
      "extension (MPIX_Comm_agree): use the store agreement");
}

#endif

}  // namespace strata::elastic
