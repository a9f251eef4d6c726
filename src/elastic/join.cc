// Growing back (elastic_loop.h): a process joins a running job through the
// store, and the members' fresh job communicator that takes it in.
#include <algorithm>
#include <nlohmann/json.hpp>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "elastic/internal/keys.h"
#include "elastic/internal/process.h"
#include "strata/base/status.h"
#include "strata/comm/backend.h"
#include "strata/elastic/elastic_loop.h"

namespace strata::elastic {

using internal::Keys;

namespace {

// The job's facts a joiner checks before it asks (Keys::Info).
struct JobInfo {
  int size = 0;
  std::string config;
  std::string backend;
  bool joins = false;
  std::string why;  // why not, when !joins
};

absl::StatusOr<JobInfo> DecodeInfo(absl::string_view text) {
  nlohmann::json j = nlohmann::json::parse(text.begin(), text.end(), nullptr, false);
  JobInfo info;
  try {
    info.size = j.at("size").get<int>();
    info.config = j.at("config").get<std::string>();
    info.backend = j.at("backend").get<std::string>();
    info.joins = j.at("joins").get<bool>();
    info.why = j.at("why").get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("bad job record '", text, "': ", e.what()));
  }
  return info;
}

}  // namespace

absl::Status ElasticLoop::WriteJobInfo() {
  const std::string backend(world_->job().backend());
  std::string why;
  if (backend == "mpi") {
    why =
        "it runs on the mpi backend, which cannot add a process to a running job (strata does not "
        "use MPI_Comm_connect or MPI_Comm_spawn); use gloo or nccl";
  } else if (options_.agreement == AgreementKind::kUlfm) {
    why = "it agrees through ULFM (AgreementKind::kUlfm); joining needs the store agreement";
  }
  nlohmann::json j = {{"size", static_cast<int>(membership_.members.size())},
                      {"config", options_.config},
                      {"backend", backend},
                      {"joins", why.empty()},
                      {"why", why}};
  absl::StatusOr<std::string> v = store_->CompareSet(Keys(options_.job, 0).Info(), "", j.dump(),
                                                     absl::Now() + options_.decision_timeout);
  if (!v.ok()) {
    return strata::internal::Annotate(
        v.status(), absl::StrCat("rank ", rank_, " writing job '", options_.job,
                                 "''s facts for joiners on ", store_->Describe()));
  }
  return absl::OkStatus();
}

std::shared_ptr<Store> ElasticLoop::RendezvousOf(const Membership& next) const {
  return MakePrefixStore(store_, Keys(options_.job, next.epoch).Rendezvous());
}

absl::StatusOr<std::unique_ptr<Communicator>> ElasticLoop::ConnectJob(
    std::shared_ptr<Store> rendezvous, int rank, int size) {
  absl::StatusOr<LaunchEnv> detected = LaunchEnv::Detect();
  LaunchEnv env = detected.ok() ? *detected : LaunchEnv{};
  env.rank = rank;
  env.world_size = size;
  RootOptions o;
  o.backend = std::string(world_->job().backend());
  o.store = std::move(rendezvous);
  o.comm.name = "world";
  o.comm.timeout = options_.rebuild_timeout;
  o.comm.sink = world_->job().sink();
  // A rank lost while the others meet (a joiner that died) raises this
  // epoch's alarm: stop waiting for it.
  o.cancelled = [this] { return monitor_->alarm().has_value(); };
  return CreateRootCommunicator(env, o);
}

void ElasticLoop::SetAbortAll(std::function<void()> abort_all) {
  std::lock_guard<std::mutex> lock(epoch_mu_);  // the aborter calls it under this lock
  hooks_.abort_all = std::move(abort_all);
}

void ElasticLoop::MeetBeforeJoin() {
  std::optional<Detection> alarm = monitor_->alarm();
  if (!alarm.has_value() || alarm->source != DetectionSource::kJoin || world_ == nullptr) return;
  // Bounded: a member lost meanwhile fails it, and the recovery goes on
  // (the agreement then finds the failure too).
  OpOptions o;
  o.timeout = options_.heartbeat_timeout;
  absl::StatusOr<std::unique_ptr<Work>> met = world_->job().Barrier(o);
  if (met.ok()) (void)(*met)->Wait();
}

absl::StatusOr<Joined> ElasticLoop::Join(std::shared_ptr<Store> store,
                                         const ElasticOptions& options, JoinOptions join,
                                         ElasticHooks hooks) {
  STRATA_RETURN_IF_ERROR(options.Validate());
  if (store == nullptr) {
    return absl::InvalidArgumentError(
        "ElasticLoop::Join needs the store of the job it joins (its members' elastic store)");
  }
  const Keys job(options.job, 0);
  const absl::Time deadline = absl::Now() + options.join_timeout;
  const std::string where = absl::StrCat("joining job '", options.job, "' on ", store->Describe());
  absl::StatusOr<std::string> info_text = store->Get(job.Info(), deadline);
  if (!info_text.ok()) {
    return strata::internal::Annotate(
        info_text.status(),
        absl::StrCat(where, ": no running job wrote its facts (key ", job.Info(), ") within ",
                     absl::FormatDuration(options.join_timeout),
                     " (ElasticOptions::join_timeout)"));
  }
  if (options.agreement == AgreementKind::kUlfm) {
    return absl::InvalidArgumentError(
        absl::StrCat(where,
                     ": a joiner agrees through the store (ElasticOptions::agreement is "
                     "ulfm)"));
  }
  STRATA_ASSIGN_OR_RETURN(JobInfo info, DecodeInfo(*info_text));
  if (!info.joins) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": the job does not admit joiners: ", info.why));
  }
  if (info.config != options.config) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, ": this process's config '", options.config, "' is not the job's '", info.config,
        "' (ElasticOptions::config; Python: strata.elastic.Options(config=)): a joiner must build "
        "the same model"));
  }
  // A job whose members finished admits nobody: its joiner, started late
  // (a restart that took longer than the rest of the run) or while the
  // members ended, has nothing to join.
  auto finished = [&]() -> absl::StatusOr<bool> {
    absl::StatusOr<int64_t> f = store->Add(job.Finished(), 0, deadline);
    if (!f.ok()) return strata::internal::Annotate(f.status(), where);
    return *f > 0;
  };
  STRATA_ASSIGN_OR_RETURN(bool done, finished());
  if (done) return Joined{};
  // Ask: the request's number makes this process's job rank (the job's
  // ranks first, then joiners in the order they asked).
  absl::StatusOr<int64_t> n = store->Add(job.Joins(), 1, deadline);
  if (!n.ok()) return strata::internal::Annotate(n.status(), where);
  const int rank = info.size + static_cast<int>(*n) - 1;
  nlohmann::json request = {
      {"rank", rank}, {"config", options.config}, {"process", internal::Self().Encode()}};
  STRATA_RETURN_IF_ERROR_CTX(store->Set(job.Join(*n), request.dump(), deadline), where);
  // The answer, looking every second whether the members finished instead
  // (they answer at a step boundary; a request made during their last step
  // is never answered).
  absl::StatusOr<std::string> answer_text;
  while (true) {
    const absl::Time slice = std::min(deadline, absl::Now() + absl::Seconds(1));
    answer_text = store->Get(job.JoinAnswer(*n), slice);
    if (!absl::IsDeadlineExceeded(answer_text.status()) || slice >= deadline) break;
    STRATA_ASSIGN_OR_RETURN(done, finished());
    if (done) return Joined{};
  }
  if (!answer_text.ok()) {
    return strata::internal::Annotate(
        answer_text.status(),
        absl::StrCat(where, ": request ", *n, " (job rank ", rank, ") got no answer within ",
                     absl::FormatDuration(options.join_timeout),
                     ": the members admit joiners at their next step boundary (are they "
                     "training?)"));
  }
  nlohmann::json answer = nlohmann::json::parse(*answer_text, nullptr, false);
  if (!answer.is_object() || (!answer.contains("epoch") && !answer.contains("refused"))) {
    return absl::InternalError(absl::StrCat(where, ": bad answer '", *answer_text, "'"));
  }
  if (answer.contains("refused")) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": request ", *n, " (job rank ", rank,
                     ") was refused: ", answer["refused"].get<std::string>()));
  }
  const uint64_t epoch = answer["epoch"].get<uint64_t>();
  absl::StatusOr<std::string> decision_text =
      store->Get(Keys(options.job, epoch).Decision(), absl::Now() + options.decision_timeout);
  if (!decision_text.ok()) return strata::internal::Annotate(decision_text.status(), where);
  STRATA_ASSIGN_OR_RETURN(Decision decision, Decision::Decode(*decision_text));
  const Membership next = decision.Next();
  const int root = next.RootRankOf(rank);
  if (root < 0) {
    return absl::InternalError(absl::StrCat(where, ": admitted by epoch ", epoch,
                                            "'s decision, which does not name job rank ", rank,
                                            " among its members"));
  }

  // From here on this process is a member of the next epoch: its monitor
  // heartbeats at once (the members watch it), and a failure of the
  // regroup is that epoch's alarm.
  std::unique_ptr<ElasticLoop> loop(
      new ElasticLoop(nullptr, store, options, std::move(hooks), rank, next));
  RecoveryEvent event;
  event.rank = rank;
  event.epoch_before = decision.epoch;
  decision.Describe(event);
  event.known_by_all_at = decision.known_by_all_at;
  event.decided_at = decision.decided_at;
  event.placed = !next.IsSpare(rank);

  auto failed = [&](const absl::Status& s, absl::string_view what) {
    Detection d;
    d.source = DetectionSource::kBackend;
    d.reporter = rank;
    d.detail = absl::StrCat("joiner ", rank, ": ", what, ": ", s.message());
    d.found_at = d.failed_at = absl::Now();
    (void)loop->monitor_->Raise(d);
    return strata::internal::Annotate(
        s, absl::StrCat(where, ": the regroup of epoch ", next.epoch, " that admits it (", what,
                        "); the members go on without it"));
  };
  WorldOptions wo = std::move(join.world);
  wo.root.backend = info.backend;
  wo.root.store = loop->RendezvousOf(next);
  wo.root.comm.name = "world";
  wo.root.comm.timeout = options.rebuild_timeout;
  wo.root.cancelled = [l = loop.get()] { return l->monitor_->alarm().has_value(); };
  wo.spares = next.spares();
  // As the members do between their rendezvous and their rebuild.
  wo.on_root = [l = loop.get(), &next](Communicator&) -> absl::Status {
    STRATA_ASSIGN_OR_RETURN(bool all, l->AllShrunk(next, true));
    if (!all) return absl::AbortedError("a member's rendezvous failed, or a member failed");
    return absl::OkStatus();
  };
  LaunchEnv env = join.env;
  env.rank = root;
  env.world_size = static_cast<int>(next.members.size());
  absl::StatusOr<Mesh> mesh = Mesh::Create(next.mesh);
  if (!mesh.ok()) return mesh.status();
  absl::StatusOr<std::unique_ptr<World>> world = World::Create(env, *mesh, wo);
  if (!world.ok()) return failed(world.status(), "building its World");
  {
    std::lock_guard<std::mutex> lock(loop->epoch_mu_);
    loop->world_ = world->get();
  }
  loop->root_members_ = next.members;
  const absl::Time barrier_start = absl::Now();
  OpOptions o;
  o.timeout = options.rebuild_timeout;
  absl::StatusOr<std::unique_ptr<Work>> barrier = (*world)->job().Barrier(o);
  absl::Status met = barrier.ok() ? (*barrier)->Wait() : barrier.status();
  if (!met.ok()) return failed(met, "the first barrier of the new world");
  // The step to run: the members' (a fresh job communicator always tells).
  int64_t step = 0;
  absl::StatusOr<std::unique_ptr<Work>> told = (*world)->job().AllReduce(
      ConstBuffer(&step, 1, DataType::kInt64), Buffer::Of(&step, 1), ReduceOp::kMax, o);
  absl::Status got = told.ok() ? (*told)->Wait() : told.status();
  if (!got.ok()) return failed(got, "learning the step");
  loop->current_step_.store(step);
  event.step = step;
  event.rebuilt_at = absl::Now();
  event.first_collective = event.rebuilt_at - barrier_start;
  event.rebuild = std::max(absl::ZeroDuration(), event.rebuilt_at - event.decided_at);
  {
    std::lock_guard<std::mutex> lock(loop->mu_);
    loop->events_.push_back(event);
  }
  loop->joined_placed_ = event.placed;
  Joined joined;
  joined.world = *std::move(world);
  joined.loop = std::move(loop);
  joined.event = std::move(event);
  return joined;
}

}  // namespace strata::elastic
