// The elastic loop (elastic_loop.h).
#include "strata/elastic/elastic_loop.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "elastic/internal/keys.h"
#include "strata/base/status.h"

namespace strata::elastic {
namespace {

absl::Duration NonNegative(absl::Duration d) { return std::max(d, absl::ZeroDuration()); }

bool Contains(const std::vector<int>& v, int x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

// True for an error of the store itself (unreachable, refused), not a
// deadline passed while waiting for other ranks' keys.
bool StoreUnreachable(const absl::Status& s) {
  return !s.ok() && s.code() != absl::StatusCode::kDeadlineExceeded &&
         s.code() != absl::StatusCode::kNotFound && s.code() != absl::StatusCode::kAborted &&
         s.code() != absl::StatusCode::kFailedPrecondition;
}

// A rank that cannot reach the store cannot learn what a majority decides:
// it stops (FailedPrecondition, never retried) rather than train on beside
// the others (no split brain).
absl::Status StoreLost(int rank, const Membership& m, const Store& store, const absl::Status& s,
                       absl::string_view doing) {
  return absl::FailedPreconditionError(absl::StrCat(
      "rank ", rank, " stops: it cannot reach the elastic store ", store.Describe(), " (", doing,
      ": ", s.message(), "), so it cannot learn what a majority of the ", m.members.size(),
      " members of epoch ", m.epoch, " decide; it stops rather than train on beside them"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<ElasticLoop>> ElasticLoop::Create(World& world,
                                                                 std::shared_ptr<Store> store,
                                                                 const ElasticOptions& options,
                                                                 ElasticHooks hooks) {
  STRATA_RETURN_IF_ERROR(options.Validate());
  if (store == nullptr) {
    return absl::InvalidArgumentError(
        "ElasticLoop needs a store for its heartbeat and agreement (the Gloo and NCCL worlds' "
        "bootstrap store, STRATA_STORE=file:/shared/dir, or a file store on one host)");
  }
  if (world.generation() != 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "ElasticLoop starts on a World at generation 1 (its root ranks are the job ranks); this "
        "World is at generation ",
        world.generation()));
  }
  STRATA_RETURN_IF_ERROR(world.status());
  std::unique_ptr<ElasticLoop> loop(
      new ElasticLoop(&world, std::move(store), options, std::move(hooks), world.rank(),
                      InitialMembership(world.mesh().spec(), world.spares())));
  loop->root_members_ = loop->membership_.members;
  if (options.agreement == AgreementKind::kUlfm) {
    STRATA_ASSIGN_OR_RETURN(loop->agreement_,
                            MakeUlfmAgreement(loop->store_, options, loop->membership_));
  }
  STRATA_RETURN_IF_ERROR(loop->WriteJobInfo());
  return loop;
}

ElasticLoop::ElasticLoop(World* world, std::shared_ptr<Store> store, ElasticOptions options,
                         ElasticHooks hooks, int rank, Membership membership)
    : world_(world),
      store_(std::move(store)),
      options_(std::move(options)),
      hooks_(std::move(hooks)),
      rank_(rank),
      membership_(std::move(membership)) {
  if (!hooks_.abort_all) {
    hooks_.abort_all = [this] {
      if (world_ != nullptr) world_->AbortAll();
    };
  }
  if (!hooks_.connect) {
    hooks_.connect = [this](std::shared_ptr<Store> rendezvous, int rank, int size) {
      return ConnectJob(std::move(rendezvous), rank, size);
    };
  }
  agreement_ = MakeStoreAgreement(store_, options_);
  commit_ = MakeStoreStepCommit(store_, options_);
  (void)commit_->Start(membership_);
  HeartbeatMonitor::Config config;
  config.store = hooks_.monitor_store != nullptr ? hooks_.monitor_store : store_;
  config.options = options_;
  config.rank = rank_;
  config.on_alarm = [this](const Detection& d, uint64_t epoch) { OnAlarm(d, epoch); };
  aborter_ = std::thread([this] { RunAborter(); });
  monitor_ = std::make_unique<HeartbeatMonitor>(std::move(config));
  monitor_->Watch(membership_);
}

ElasticLoop::~ElasticLoop() {
  monitor_->Stop();  // no more alarms
  {
    std::lock_guard<std::mutex> lock(abort_mu_);
    abort_stop_ = true;
  }
  abort_cv_.notify_all();
  aborter_.join();
}

void ElasticLoop::OnAlarm(const Detection& alarm, uint64_t epoch) {
  {
    std::lock_guard<std::mutex> lock(abort_mu_);
    abort_epoch_ = std::max(abort_epoch_.value_or(0), epoch);
    abort_at_ = alarm.abort ? absl::InfinitePast() : absl::Now() + options_.heartbeat_timeout;
  }
  abort_cv_.notify_all();
}

void ElasticLoop::RunAborter() {
  std::unique_lock<std::mutex> lock(abort_mu_);
  while (true) {
    abort_cv_.wait(lock, [&] { return abort_stop_ || abort_epoch_.has_value(); });
    if (abort_stop_) return;
    // A deferred abort (Detection::abort false) waits; a newer alarm or
    // the stop wakes it early.
    while (!abort_stop_ && absl::Now() < abort_at_) {
      abort_cv_.wait_for(lock, absl::ToChronoNanoseconds(abort_at_ - absl::Now()));
    }
    if (abort_stop_) return;
    const uint64_t epoch = *abort_epoch_;
    abort_epoch_.reset();
    lock.unlock();
    {
      // Every communicator of this rank fails now, so that a step blocked
      // in a collective returns; and the step being voted on cannot commit.
      std::lock_guard<std::mutex> l(epoch_mu_);
      if (epoch == epoch_.load()) {  // else the loop has moved on
        hooks_.abort_all();
        commit_->Abort(epoch, current_step_.load());
      }
    }
    lock.lock();
  }
}

bool ElasticLoop::alarmed() const { return monitor_->alarm().has_value(); }

bool ElasticLoop::joiners_waiting() const { return commit_->joiners_waiting(); }

absl::Status ElasticLoop::Admit(int64_t next_step) {
  current_step_.store(next_step);
  Detection d;
  d.source = DetectionSource::kJoin;
  d.reporter = rank_;
  d.detail = "processes asked to join the job";
  d.abort = false;  // every member is between steps
  d.found_at = d.failed_at = absl::Now();
  return monitor_->Raise(d).status();
}

absl::Status ElasticLoop::BeginStep(int64_t step) {
  current_step_.store(step);
  if (std::optional<Detection> a = monitor_->alarm(); a.has_value()) {
    return absl::AbortedError(absl::StrCat("step ", step, " of epoch ", membership_.epoch,
                                           " cannot run: the epoch's alarm is raised (",
                                           a->ToString(), "); recover first"));
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> ElasticLoop::Commit(int64_t step, bool ok) {
  if (ok && monitor_->alarm().has_value()) ok = false;
  if (absl::Status lost = monitor_->store_status(); !lost.ok()) {
    // The monitor found the store gone: a vote would wait for it again.
    return StoreLost(rank_, membership_, *store_, lost, absl::StrCat("voting on step ", step));
  }
  absl::StatusOr<bool> committed = commit_->Vote(step, ok);
  if (StoreUnreachable(committed.status())) {
    return StoreLost(rank_, membership_, *store_, committed.status(),
                     absl::StrCat("voting on step ", step));
  }
  if (committed.ok() && !*committed && !monitor_->alarm().has_value()) {
    // Someone aborted the step; the alarm says why (and if it is not set
    // yet, this rank sets it: a commit never aborts without one).
    Detection d;
    d.source = DetectionSource::kCommit;
    d.reporter = rank_;
    d.detail = absl::StrCat("the commit of step ", step, " was aborted");
    d.found_at = d.failed_at = absl::Now();
    (void)monitor_->Raise(d);
  }
  return committed;
}

void ElasticLoop::ReportFailure(const absl::Status& error) {
  // The failed ranks an error names (kRankFailurePayload) are ranks of the
  // communicator that failed, which may be any group: they are not mapped
  // to job ranks here; the agreement finds the failed ranks itself.
  Detection d;
  d.source = DetectionSource::kBackend;
  d.reporter = rank_;
  d.detail = std::string(error.message());
  d.found_at = d.failed_at = absl::Now();
  (void)monitor_->Raise(d);
}

absl::Status ElasticLoop::RequestChange(const std::vector<int>& evict, const std::string& why,
                                        bool abort_at_once) {
  for (int r : evict) {
    if (membership_.RootRankOf(r) < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("RequestChange: rank ", r, " is no member of ", membership_.ToString()));
    }
  }
  Detection d;
  d.source = DetectionSource::kRequest;
  d.reporter = rank_;
  d.evict = evict;
  d.detail = why;
  d.abort = abort_at_once;
  d.found_at = d.failed_at = absl::Now();
  absl::StatusOr<Detection> won = monitor_->Raise(d);
  return won.status();
}

std::vector<RecoveryEvent> ElasticLoop::events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_;
}

void ElasticLoop::RecordRestore(absl::Time restored_at, const std::string& restored_from) {
  std::lock_guard<std::mutex> lock(mu_);
  if (events_.empty()) return;
  RecoveryEvent& e = events_.back();
  e.restored_at = restored_at;
  e.restored_from = restored_from;
  e.restore = NonNegative(restored_at - e.rebuilt_at);
}

namespace {

void AddAll(std::vector<int>& to, const std::vector<int>& from) {
  for (int r : from) {
    if (!Contains(to, r)) to.push_back(r);
  }
}

// One event for a recovery that took several attempts: the failure that
// started it (cause, detection, epoch before, from the first attempt),
// every rank taken as failed or leaving in any attempt, and the outcome of
// the last.
RecoveryEvent Merge(const std::vector<RecoveryEvent>& decided, RecoveryEvent last) {
  if (decided.size() < 2) return last;
  const RecoveryEvent& first = decided.front();
  RecoveryEvent e = std::move(last);
  std::vector<int> failed = first.failed;
  std::vector<std::string> why = first.failed_why;
  std::vector<int> leaving = first.leaving;
  for (size_t i = 1; i < decided.size(); ++i) {
    for (size_t k = 0; k < decided[i].failed.size(); ++k) {
      if (!Contains(failed, decided[i].failed[k])) {
        failed.push_back(decided[i].failed[k]);
        why.push_back(decided[i].failed_why[k]);
      }
    }
    AddAll(leaving, decided[i].leaving);
  }
  e.failed = std::move(failed);
  e.failed_why = std::move(why);
  e.leaving = std::move(leaving);
  // A spare placed by an attempt whose regroup failed is still new to its
  // position: every placement whose spare is in the final mesh counts.
  std::vector<std::pair<int, int>> replaced;
  const auto end = e.members.begin() + std::min<size_t>(e.members.size(), e.mesh_after.world_size);
  for (const RecoveryEvent& d : decided) {
    for (const auto& pair : d.replaced) {
      if (std::find(e.members.begin(), end, pair.second) == end) continue;
      bool known = false;
      for (const auto& p : replaced) known = known || p.second == pair.second;
      if (!known) replaced.push_back(pair);
    }
  }
  e.replaced = std::move(replaced);
  e.epoch_before = first.epoch_before;
  e.mesh_before = first.mesh_before;
  e.cause = first.cause;
  e.known_by_all_at = first.known_by_all_at;
  e.detect = first.detect;
  e.agree = NonNegative(first.decided_at - first.known_by_all_at);
  // The failed attempts' regroups count as rebuilding.
  e.rebuild = NonNegative(e.rebuilt_at - first.decided_at);
  return e;
}

}  // namespace

absl::StatusOr<ElasticLoop::Recovery> ElasticLoop::Recover() {
  absl::Status last;
  std::vector<RecoveryEvent> decided;
  const bool was_spare = membership_.IsSpare(rank_);
  for (int attempt = 1; attempt <= options_.max_attempts; ++attempt) {
    absl::StatusOr<Recovery> r = RecoverOnce(attempt, decided);
    if (r.ok()) {
      r->event = Merge(decided, std::move(r->event));
      r->event.placed = was_spare && r->outcome == Outcome::kContinue &&
                        membership_.RootRankOf(rank_) >= 0 && !membership_.IsSpare(rank_);
      std::lock_guard<std::mutex> lock(mu_);
      events_.push_back(r->event);
      return r;
    }
    last = r.status();
    // Only a failure of the regroup (a rank lost meanwhile) is retried, as
    // a recovery of the next epoch; RecoverOnce raised its alarm.
    if (last.code() != absl::StatusCode::kUnavailable) return last;
  }
  return strata::internal::Annotate(last,
                                    absl::StrCat("recovery gave up after ", options_.max_attempts,
                                                 " attempts (ElasticOptions::max_attempts)"));
}

absl::StatusOr<ElasticLoop::Recovery> ElasticLoop::RecoverOnce(
    int attempt, std::vector<RecoveryEvent>& decided) {
  // The alarm: raised by whoever found the failure; this rank raises one
  // if it gets here without (a commit aborted by a rank that died before
  // raising it).
  if (!monitor_->alarm().has_value()) {
    Detection d;
    d.source = DetectionSource::kCommit;
    d.reporter = rank_;
    d.detail = "recovery started without an alarm";
    d.found_at = d.failed_at = absl::Now();
    (void)monitor_->Raise(d);
  }
  if (attempt == 1) MeetBeforeJoin();
  hooks_.abort_all();
  if (absl::Status s = monitor_->store_status(); !s.ok()) {
    return StoreLost(rank_, membership_, *store_, s, "its heartbeat");
  }
  std::vector<int> suspects;
  {
    std::lock_guard<std::mutex> lock(mu_);
    suspects = suspects_;
  }
  if (absl::Status s = monitor_->CheckIn(suspects); !s.ok()) {
    if (StoreUnreachable(s)) return StoreLost(rank_, membership_, *store_, s, "checking in");
    return strata::internal::Annotate(
        s, absl::StrCat("rank ", rank_, " checking in for epoch ", membership_.epoch));
  }
  const absl::Time my_known = monitor_->known_at();
  const Membership before = membership_;
  absl::StatusOr<Decision> agreed = agreement_->Agree(before, rank_, suspects);
  if (StoreUnreachable(agreed.status())) {
    return StoreLost(rank_, before, *store_, agreed.status(), "agreeing");
  }
  STRATA_ASSIGN_OR_RETURN(Decision decision, std::move(agreed));
  const absl::Time decided_at = absl::Now();

  RecoveryEvent event;
  event.rank = rank_;
  event.epoch_before = before.epoch;
  decision.Describe(event);
  event.mesh_before = before.mesh;
  event.attempts = attempt;
  event.step = current_step_.load();
  event.known_by_all_at = std::max(decision.known_by_all_at, my_known);
  event.decided_at = decided_at;
  const absl::Time failed_at =
      decision.cause.failed_at != absl::InfinitePast() ? decision.cause.failed_at : my_known;
  event.detect = NonNegative(event.known_by_all_at - failed_at);
  event.agree = NonNegative(decided_at - event.known_by_all_at);

  if (decision.kind == Decision::Kind::kStop) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", rank_, " stops: ", decision.stop_reason));
  }
  const Membership next = decision.Next();
  decided.push_back(event);
  if (Contains(decision.failed, rank_)) {
    const bool evicted =
        decision.cause.source == DetectionSource::kRequest && Contains(decision.cause.evict, rank_);
    if (!evicted) {
      return absl::AbortedError(absl::StrCat(
          "rank ", rank_, " was taken as failed by the agreement of epoch ", before.epoch, " (",
          decision.failed_why[std::find(decision.failed.begin(), decision.failed.end(), rank_) -
                              decision.failed.begin()],
          "); the others went on without it (epoch ", next.epoch, ")"));
    }
  }
  if (!Contains(next.members, rank_)) {
    event.leaves = true;
    std::lock_guard<std::mutex> lock(epoch_mu_);
    membership_ = next;  // no longer a member: the monitor keeps its last epoch
    epoch_.store(next.epoch);
    if (options_.leave == LeavePolicy::kExit) ExitLeavingRank(event);
    return Recovery{Outcome::kLeave, std::move(event)};
  }

  // From here on this rank belongs to the next epoch: a failure during the
  // regroup is that epoch's alarm.
  {
    std::lock_guard<std::mutex> lock(epoch_mu_);
    membership_ = next;
    epoch_.store(next.epoch);
    STRATA_RETURN_IF_ERROR(commit_->Start(next));
  }
  monitor_->Watch(next);
  // `ranks`: the job ranks in the order of the communicator the failed call
  // was made on, to tell the agreement which member the regroup could not
  // connect to (kUnreachablePayload); before the alarm, whose check-in
  // carries it.
  auto regroup_failed = [&](const absl::Status& s, absl::string_view what,
                            const std::vector<int>* ranks = nullptr) {
    auto peer = s.GetPayload(kUnreachablePayload);
    int r = -1;
    if (ranks != nullptr && peer.has_value() && absl::SimpleAtoi(std::string(*peer), &r) &&
        r >= 0 && r < static_cast<int>(ranks->size())) {
      monitor_->ReportUnreachable({(*ranks)[static_cast<size_t>(r)]});
      // The others' connects started with this one and give up about now
      // too, each naming whom it waited for; the alarm would cancel them
      // first (a cancelled connect names nobody), and with only this
      // rank's report the agreement cannot tell which end of it is cut
      // off. A moment's grace lets theirs come too.
      const absl::Time until =
          absl::Now() + std::min(options_.rebuild_timeout / 10, absl::Seconds(2));
      while (absl::Now() < until && !monitor_->alarm().has_value()) {
        absl::SleepFor(absl::Milliseconds(10));
      }
    }
    Detection d;
    d.source = DetectionSource::kBackend;
    d.reporter = rank_;
    d.detail = absl::StrCat(what, ": ", s.message());
    d.found_at = d.failed_at = absl::Now();
    (void)monitor_->Raise(d);
    return absl::UnavailableError(absl::StrCat("rank ", rank_, ": regroup to epoch ", next.epoch,
                                               " failed (", what, "): ", s.message()));
  };
  std::vector<int> excluded;
  for (int r = 0; r < static_cast<int>(root_members_.size()); ++r) {
    if (!Contains(next.members, root_members_[r])) excluded.push_back(r);
  }
  CommOptions root_options;
  root_options.name = "world";
  root_options.timeout = options_.rebuild_timeout;
  // The excluded ranks are dead, fenced or leaving: MPI under ULFM then
  // shrinks with MPIX_Comm_shrink once it sees them gone (its
  // MPI_Comm_create_from_group, the way for excluded ranks that stay alive,
  // was seen to hang in its activation under load).
  root_options.excluded_exit_wait = std::min(options_.rebuild_timeout / 2, absl::Seconds(10));
  // A member lost since the decision (this epoch's alarm) makes this
  // shrink wait for it: a shrink's waits end early only on an abort that
  // comes while it runs, and this one came before (a rank slow to get here,
  // under load, waited out the whole rebuild_timeout). Go on to the next
  // attempt at once; the others' shrinks end with their abort.
  if (monitor_->alarm().has_value()) {
    return regroup_failed(absl::AbortedError("a member was lost before the shrink began"),
                          "shrinking the root communicator");
  }
  // The job communicator: the mesh and the spares (the root without
  // spares). A shrink keeps only ranks it has; with joiners (or a joiner's
  // first regroup failed) the job communicator is made afresh.
  bool fresh = false;
  for (int r : next.members) fresh = fresh || !Contains(root_members_, r);
  absl::StatusOr<std::unique_ptr<Communicator>> root =
      fresh ? hooks_.connect(RendezvousOf(next), next.RootRankOf(rank_),
                             static_cast<int>(next.members.size()))
            : world_->job().Shrink(excluded, root_options);
  if (root.ok() && *root == nullptr) {
    return absl::InternalError(absl::StrCat("rank ", rank_, " was excluded from its own shrink"));
  }
  // Every member says whether its shrink succeeded before anyone rebuilds:
  // a rank whose shrink failed while the others' succeeded would keep the
  // old root while they move to the new one, and the next attempt would
  // shrink different communicators on different ranks. On "no", every
  // member drops its new root and the next attempt shrinks the old one
  // again (with the larger failed set, if any).
  absl::StatusOr<bool> all_shrunk = AllShrunk(next, root.ok());
  if (!all_shrunk.ok() || !*all_shrunk) {
    if (root.ok()) (void)(*root)->Abort();  // dropped: its peers may be gone
    if (!root.ok()) {
      return regroup_failed(root.status(), "shrinking the root communicator",
                            fresh ? &next.members : &root_members_);
    }
    if (!all_shrunk.ok()) return regroup_failed(all_shrunk.status(), "voting on the shrink");
    return regroup_failed(absl::AbortedError("another member's shrink failed, or a member failed"),
                          "shrinking the root communicator");
  }
  absl::StatusOr<Mesh> mesh = Mesh::Create(next.mesh);
  if (!mesh.ok()) return mesh.status();
  std::unique_ptr<Communicator> job = *std::move(root);
  // The shrink keeps the old order; a spare that takes a failed rank's
  // mesh position moves there by one more split.
  std::vector<int> kept;
  for (int r : root_members_) {
    if (Contains(next.members, r)) kept.push_back(r);
  }
  if (!fresh && kept != next.members) {
    absl::StatusOr<std::unique_ptr<Communicator>> placed =
        job->Split(0, next.RootRankOf(rank_), root_options);
    if (!placed.ok()) {
      (void)job->Abort();
      return regroup_failed(placed.status(), "placing the spares in the mesh", &kept);
    }
    job = *std::move(placed);
  }
  absl::Status rebuilt = world_->Rebuild(std::move(job), *mesh);
  root_members_ = next.members;
  if (!rebuilt.ok()) return regroup_failed(rebuilt, "rebuilding the World");
  const absl::Time barrier_start = absl::Now();
  OpOptions barrier_options;
  barrier_options.timeout = options_.rebuild_timeout;
  absl::StatusOr<std::unique_ptr<Work>> barrier = world_->job().Barrier(barrier_options);
  absl::Status met = barrier.ok() ? (*barrier)->Wait() : barrier.status();
  if (!met.ok()) return regroup_failed(met, "the first barrier of the new world");
  {
    // A spare placed (by this attempt or an earlier one of this recovery)
    // does not know the step to redo: the members tell it (the largest
    // step any rank was at; spares were at none). Every rank decides alike
    // whether to (the decisions are the same everywhere).
    // A fresh job communicator may hold joiners, who do the same.
    bool placing = fresh;
    for (const RecoveryEvent& d : decided) {
      placing = placing || !d.replaced.empty() || !d.grown.empty();
    }
    if (placing) {
      int64_t step = current_step_.load();
      absl::StatusOr<std::unique_ptr<Work>> told =
          world_->job().AllReduce(ConstBuffer(&step, 1, DataType::kInt64), Buffer::Of(&step, 1),
                                  ReduceOp::kMax, barrier_options);
      absl::Status got = told.ok() ? (*told)->Wait() : told.status();
      if (!got.ok()) return regroup_failed(got, "telling the placed spares the step");
      current_step_.store(step);
      event.step = step;
    }
  }
  event.rebuilt_at = absl::Now();
  event.first_collective = event.rebuilt_at - barrier_start;
  event.rebuild = NonNegative(event.rebuilt_at - decided_at);
  return Recovery{Outcome::kContinue, std::move(event)};
}

// A leaving rank ends its process at once, without MPI_Finalize (which
// would wait for the ranks that go on, and for the dead): the survivors'
// shrink waits for every excluded rank to be gone (CommOptions::
// excluded_exit_wait), and under ULFM an exited process is a failed one.
void ElasticLoop::ExitLeavingRank(const RecoveryEvent& event) {
  std::fprintf(stderr,
               "strata.elastic: rank %d leaves the job: its data-parallel replica lost rank(s) "
               "[%s] and was dropped (epoch %llu, the others go on as %s); exiting with status 0\n",
               rank_, absl::StrJoin(event.failed, ", ").c_str(),
               static_cast<unsigned long long>(event.epoch_after),
               DescribeMesh(event.mesh_after).c_str());
  std::fflush(nullptr);
  std::_Exit(0);
}

absl::StatusOr<bool> ElasticLoop::AllShrunk(const Membership& next, bool shrunk) {
  const internal::Keys keys(options_.job, next.epoch);
  const absl::Time deadline = absl::Now() + options_.rebuild_timeout;
  const int64_t size = static_cast<int64_t>(next.members.size());
  const std::string where = absl::StrCat("the end of the shrinks of epoch ", next.epoch, " (", size,
                                         " members) on ", store_->Describe());
  if (!shrunk) {
    absl::StatusOr<int64_t> f = store_->Add(keys.RegroupFailed(), 1, deadline);
    if (!f.ok()) return strata::internal::Annotate(f.status(), where);
  }
  absl::StatusOr<int64_t> n = store_->Add(keys.Regrouped(), 1, deadline);
  // Polled (an Add of 0 reads the count) rather than a blocking wait, so
  // that a member lost meanwhile (the epoch's alarm) ends the wait. The
  // pause grows from 1 ms: the others are usually moments behind (a fixed
  // 20 ms pause added 10 ms to every regroup on average).
  const absl::Duration longest = std::min(options_.heartbeat_interval / 4, absl::Milliseconds(20));
  absl::Duration poll = std::min(absl::Milliseconds(1), longest);
  while (n.ok() && *n < size) {
    if (monitor_->alarm().has_value()) return false;
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(where, ": ", *n, " of ", size, " members past their shrink after ",
                       absl::FormatDuration(options_.rebuild_timeout)));
    }
    absl::SleepFor(poll);
    poll = std::min(poll * 2, longest);
    n = store_->Add(keys.Regrouped(), 0, deadline);
  }
  if (!n.ok()) return strata::internal::Annotate(n.status(), where);
  absl::StatusOr<int64_t> failed = store_->Add(keys.RegroupFailed(), 0, deadline);
  if (!failed.ok()) return strata::internal::Annotate(failed.status(), where);
  return *failed == 0;
}

absl::StatusOr<ElasticLoop::Recovery> ElasticLoop::StandBy() {
  Recovery r;
  const internal::Keys keys(options_.job, 0);
  while (membership_.IsSpare(rank_)) {
    // Finished first: once the members are done their heartbeats stop,
    // and this rank's monitor would take that for a failure.
    absl::StatusOr<int64_t> finished =
        store_->Add(keys.Finished(), 0, absl::Now() + options_.decision_timeout);
    if (!finished.ok()) {
      return StoreLost(rank_, membership_, *store_, finished.status(), "standing by");
    }
    if (*finished > 0) {
      r.outcome = Outcome::kFinished;
      return r;
    }
    if (alarmed()) {
      STRATA_ASSIGN_OR_RETURN(r, Recover());
      if (r.outcome != Outcome::kContinue || r.event.placed) return r;
      continue;  // still standing by, in the next epoch
    }
    absl::SleepFor(options_.heartbeat_interval);
  }
  return r;
}

absl::Status ElasticLoop::Finish() {
  const internal::Keys keys(options_.job, 0);
  absl::StatusOr<int64_t> n =
      store_->Add(keys.Finished(), 1, absl::Now() + options_.decision_timeout);
  if (!n.ok()) {
    return strata::internal::Annotate(
        n.status(),
        absl::StrCat("rank ", rank_, " marking the job finished on ", store_->Describe()));
  }
  return absl::OkStatus();
}

absl::StatusOr<LoopResult> ElasticLoop::Run(const LoopCallbacks& callbacks, int64_t first_step,
                                            int64_t end_step) {
  if (!callbacks.step || !callbacks.apply) {
    return absl::InvalidArgumentError("LoopCallbacks: `step` and `apply` must be set");
  }
  LoopResult result;
  int64_t step = first_step;
  std::optional<Recovery> arrived;  // placed in the mesh: its state comes first
  if (membership_.IsSpare(rank_)) {
    STRATA_ASSIGN_OR_RETURN(Recovery r, StandBy());
    if (r.outcome != Outcome::kContinue) {
      result.left = r.outcome == Outcome::kLeave;
      result.stood_by = r.outcome == Outcome::kFinished;
      result.next_step = step;
      result.events = events();
      return result;
    }
    arrived = std::move(r);
  } else if (joined_placed_) {
    joined_placed_ = false;
    arrived = Recovery{Outcome::kContinue, events().back()};
  }
  if (arrived.has_value()) {
    Recovery& r = *arrived;
    step = r.event.step;
    if (callbacks.restore) {
      STRATA_RETURN_IF_ERROR_CTX(callbacks.restore(r.event), "receiving the state of position ",
                                 world_->rank(), " after epoch ", r.event.epoch_after,
                                 "'s regroup");
    }
    RecordRestore(absl::Now(), r.event.restored_from);
    if (callbacks.on_world_changed) callbacks.on_world_changed(events().back());
  }
  while (step < end_step) {
    StepContext ctx;
    ctx.step = step;
    ctx.world = world_;
    ctx.membership = &membership_;
    absl::Status s = BeginStep(step);
    if (s.ok()) s = callbacks.step(ctx);
    if (!s.ok() && !alarmed()) ReportFailure(s);
    STRATA_ASSIGN_OR_RETURN(bool committed, Commit(step, s.ok()));
    if (committed) {
      STRATA_RETURN_IF_ERROR_CTX(callbacks.apply(ctx), "applying step ", step);
      ++step;
      if (!joiners_waiting()) continue;
      STRATA_RETURN_IF_ERROR(Admit(step));  // every member, after the same step
    }
    STRATA_ASSIGN_OR_RETURN(Recovery r, Recover());
    if (r.outcome == Outcome::kLeave) {
      result.left = true;
      result.next_step = step;
      result.events = events();
      return result;
    }
    r.event.step = step;
    if (callbacks.restore) {
      // A member lost while the state moves (a joiner that died while it
      // received) fails the restore: that is the next epoch's failure, and
      // the step (not begun) takes this rank into its recovery.
      if (absl::Status restored = callbacks.restore(r.event); !restored.ok()) {
        if (!alarmed()) ReportFailure(restored);
        continue;
      }
    }
    RecordRestore(absl::Now(), r.event.restored_from);
    if (callbacks.on_world_changed) {
      std::vector<RecoveryEvent> all = events();
      callbacks.on_world_changed(all.back());
    }
  }
  STRATA_RETURN_IF_ERROR(Finish());
  result.next_step = step;
  result.events = events();
  return result;
}

}  // namespace strata::elastic
