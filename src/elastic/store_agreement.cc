// The store path of the agreement (agreement.h) and the Decision's codec.
#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "elastic/internal/keys.h"
#include "elastic/internal/process.h"
#include "strata/base/status.h"
#include "strata/elastic/agreement.h"
#include "strata/elastic/heartbeat.h"

namespace strata::elastic {

using internal::Keys;

namespace {

double Unix(absl::Time t) {
  return t == absl::InfinitePast() ? 0.0 : absl::ToDoubleSeconds(t - absl::UnixEpoch());
}
absl::Time FromUnix(double s) {
  return s == 0.0 ? absl::InfinitePast() : absl::UnixEpoch() + absl::Seconds(s);
}

bool IsTimeout(const absl::Status& s) {
  return s.code() == absl::StatusCode::kDeadlineExceeded || s.code() == absl::StatusCode::kNotFound;
}

std::string Ranks(const std::vector<int>& r) {
  return absl::StrCat("[", absl::StrJoin(r, ", "), "]");
}

// The members of `live` to take as failed for the reports of members that
// could not reach each other (`reports`: reporter -> the ranks it could not
// connect to), each with why (agreement.h).
std::map<int, std::string> CutOff(const std::map<int, std::vector<int>>& reports,
                                  const std::set<int>& live) {
  std::map<int, std::set<int>> edges;  // symmetric, between live members
  for (const auto& [from, tos] : reports) {
    if (live.count(from) == 0) continue;
    for (int to : tos) {
      if (to == from || live.count(to) == 0) continue;
      edges[from].insert(to);
      edges[to].insert(from);
    }
  }
  std::map<int, std::string> out;
  while (true) {
    int worst = -1;
    size_t most = 0;
    for (const auto& [m, peers] : edges) {
      if (peers.size() > most || (peers.size() == most && most > 0 && m > worst)) {
        worst = m;
        most = peers.size();
      }
    }
    if (most == 0) return out;
    const std::set<int> peers = std::move(edges[worst]);
    edges.erase(worst);
    for (int p : peers) edges[p].erase(worst);
    out[worst] = absl::StrCat(
        "checked in, but rank(s) [", absl::StrJoin(peers, ", "),
        "] and it could not connect to each other when regrouping (the network between the "
        "ranks is cut where the store's is not)");
  }
}

class StoreAgreement final : public Agreement {
 public:
  StoreAgreement(std::shared_ptr<Store> store, ElasticOptions options)
      : store_(std::move(store)), options_(std::move(options)) {}

  const char* name() const override { return "store"; }

  absl::StatusOr<Decision> Agree(const Membership& current, int rank,
                                 const std::vector<int>& suspects) override {
    const Keys keys(options_.job, current.epoch);
    const std::string me = absl::StrCat(rank);
    const std::string where =
        absl::StrCat("the agreement of epoch ", current.epoch, " on ", store_->Describe());
    absl::StatusOr<std::string> leader =
        store_->CompareSet(keys.Leader(), "", me, absl::Now() + options_.decision_timeout);
    if (!leader.ok()) return strata::internal::Annotate(leader.status(), where);
    if (*leader == me) STRATA_RETURN_IF_ERROR(Lead(current, rank, keys));
    for (int takeovers = 0;; ++takeovers) {
      absl::StatusOr<std::string> text =
          store_->Get(keys.Decision(), absl::Now() + options_.decision_timeout);
      if (text.ok()) return Decision::Decode(*text);
      if (!IsTimeout(text.status())) return strata::internal::Annotate(text.status(), where);
      // The leader did not deliver: take over (one rank wins the CompareSet).
      absl::StatusOr<std::string> old =
          store_->Get(keys.Leader(), absl::Now() + options_.decision_timeout);
      if (!old.ok()) return strata::internal::Annotate(old.status(), where);
      if (takeovers >= options_.max_leader_takeovers) {
        return absl::DeadlineExceededError(absl::StrCat(
            where, ": rank ", rank, " waited for the decision (key ", keys.Decision(), ") ",
            takeovers + 1, " times ", absl::FormatDuration(options_.decision_timeout),
            "; the last leader, rank ", *old, ", never wrote it"));
      }
      absl::StatusOr<std::string> now =
          store_->CompareSet(keys.Leader(), *old, me, absl::Now() + options_.decision_timeout);
      if (!now.ok()) return strata::internal::Annotate(now.status(), where);
      if (*now == me) STRATA_RETURN_IF_ERROR(Lead(current, rank, keys));
    }
  }

 private:
  struct Seen {
    absl::Time known_at = absl::InfinitePast();
    std::vector<int> unreachable;  // the ranks its last regroup could not connect to
  };

  // One look at `key`: its value, nullopt when absent, or the store's error.
  absl::StatusOr<std::optional<std::string>> Peek(const std::string& key) {
    absl::StatusOr<std::string> v = store_->Get(key, absl::InfinitePast());
    if (v.ok()) return std::optional<std::string>(*std::move(v));
    if (IsTimeout(v.status())) return std::optional<std::string>();
    return v.status();
  }

  // The latest heartbeat of member `m` (of this epoch, else of the one
  // before), or "" when it has none.
  absl::StatusOr<std::string> HeartbeatOf(const Membership& current, const Keys& keys, int m) {
    STRATA_ASSIGN_OR_RETURN(std::optional<std::string> hb, Peek(keys.Heartbeat(m)));
    if (!hb.has_value() && current.epoch > 1) {
      STRATA_ASSIGN_OR_RETURN(hb, Peek(Keys(options_.job, current.epoch - 1).Heartbeat(m)));
    }
    return hb.value_or("");
  }

  absl::Status Lead(const Membership& current, int rank, const Keys& keys) {
    const absl::Time start = absl::Now();
    const absl::Time settle = start + options_.settle_timeout;
    const std::string where = absl::StrCat("leading the agreement of epoch ", current.epoch,
                                           " (rank ", rank, ") on ", store_->Describe());
    Decision d;
    d.epoch = current.epoch;
    d.next_epoch = current.epoch + 1;
    d.leader = rank;
    absl::StatusOr<std::string> alarm = store_->Get(keys.Alarm(), settle);
    if (alarm.ok()) {
      absl::StatusOr<Detection> cause = DecodeDetection(*alarm);
      if (cause.ok()) d.cause = *cause;
    } else if (!IsTimeout(alarm.status())) {
      return strata::internal::Annotate(alarm.status(), where);
    }
    std::map<int, Seen> seen;
    std::map<int, std::string> failed;
    std::set<int> missing(current.members.begin(), current.members.end());
    if (d.cause.source == DetectionSource::kRequest) {
      // A planned change: the ranks it evicts leave whether they check in
      // or not (they do; they are alive).
      for (int m : d.cause.evict) {
        if (missing.erase(m) == 1) {
          failed[m] = absl::StrCat("evicted by rank ", d.cause.reporter, ": ", d.cause.detail);
        }
      }
    }
    std::map<int, internal::ProcessId> processes;
    // A silent member's heartbeat when first found silent: one whose
    // heartbeat still changes at `settle` is alive but slow (a loaded
    // host) and gets until `patience`, within the time the others wait for
    // the decision before they take over.
    std::map<int, std::string> beat;
    const absl::Time patience = std::max(settle, start + options_.decision_timeout / 2);
    absl::Duration pause = absl::Milliseconds(1);
    // Until the check-ins stop coming, count them (one read) rather than
    // look at every member: the sweep below then reads each member's
    // check-in once and polls only the silent ones.
    for (int64_t last = -1;;) {
      absl::StatusOr<int64_t> count = store_->Add(keys.CheckIns(), 0, settle);
      if (!count.ok()) return strata::internal::Annotate(count.status(), where);
      if (*count >= static_cast<int64_t>(current.members.size()) || *count == last ||
          absl::Now() >= settle) {
        break;
      }
      last = *count;
      absl::SleepFor(std::min(pause, settle - absl::Now()));
      pause = std::min(pause * 2, absl::Milliseconds(20));
    }
    pause = absl::Milliseconds(1);
    while (!missing.empty()) {
      for (auto it = missing.begin(); it != missing.end();) {
        const int m = *it;
        STRATA_ASSIGN_OR_RETURN(std::optional<std::string> alive, Peek(keys.Alive(m)));
        if (alive.has_value()) {
          nlohmann::json j = nlohmann::json::parse(*alive, nullptr, false);
          Seen s;
          if (j.is_object() && j.contains("known_at"))
            s.known_at = FromUnix(j["known_at"].get<double>());
          if (j.is_object() && j.contains("unreachable") && j["unreachable"].is_array()) {
            for (const nlohmann::json& r : j["unreachable"]) {
              if (r.is_number_integer()) s.unreachable.push_back(r.get<int>());
            }
          }
          seen[m] = s;
          it = missing.erase(it);
          continue;
        }
        STRATA_ASSIGN_OR_RETURN(std::optional<std::string> why, Peek(keys.Suspect(m)));
        if (!why.has_value() && options_.probe_processes) {
          // The leader's own look at members of its host.
          if (processes.find(m) == processes.end()) {
            STRATA_ASSIGN_OR_RETURN(std::optional<std::string> hb, Peek(keys.Heartbeat(m)));
            if (!hb.has_value() && current.epoch > 1) {
              STRATA_ASSIGN_OR_RETURN(hb, Peek(Keys(options_.job, current.epoch - 1).Heartbeat(m)));
            }
            if (hb.has_value()) {
              const size_t space = hb->find(' ');
              absl::StatusOr<internal::ProcessId> p = internal::ProcessId::Decode(
                  space == std::string::npos ? "" : absl::string_view(*hb).substr(space + 1));
              if (p.ok()) processes[m] = *p;
            }
          }
          auto p = processes.find(m);
          if (p != processes.end() && internal::Probe(p->second) == internal::ProbeResult::kGone) {
            why = absl::StrCat("its process (pid ", p->second.pid, " on ", p->second.host,
                               ") is gone");
          }
        }
        if (why.has_value()) {
          failed[m] = *why;
          it = missing.erase(it);
          continue;
        }
        if (beat.find(m) == beat.end()) {
          STRATA_ASSIGN_OR_RETURN(beat[m], HeartbeatOf(current, keys, m));
        }
        ++it;
      }
      if (missing.empty()) break;
      const absl::Time now = absl::Now();
      if (now >= settle) {
        for (auto it = missing.begin(); it != missing.end();) {
          const int m = *it;
          if (now < patience) {
            STRATA_ASSIGN_OR_RETURN(std::string hb, HeartbeatOf(current, keys, m));
            if (!hb.empty() && hb != beat[m]) {
              ++it;
              continue;
            }
          }
          failed[m] =
              now < patience
                  ? absl::StrCat("no check-in within ",
                                 absl::FormatDuration(options_.settle_timeout), " of the alarm")
                  : absl::StrCat(
                        "no check-in within ",
                        absl::FormatDuration(absl::Trunc(now - start, absl::Milliseconds(1))),
                        " of the alarm (its heartbeat went on: alive, but too slow)");
          it = missing.erase(it);
        }
        if (missing.empty()) break;
      }
      absl::SleepFor(std::min(
          pause, std::max(absl::Milliseconds(1), (now < settle ? settle : patience) - now)));
      pause = std::min(pause * 2, absl::Milliseconds(20));
    }
    {
      std::map<int, std::vector<int>> reports;
      std::set<int> live;
      for (const auto& [m, s] : seen) {
        live.insert(m);
        if (!s.unreachable.empty()) reports[m] = s.unreachable;
      }
      for (auto& [m, why] : CutOff(reports, live)) {
        failed[m] = std::move(why);
        seen.erase(m);
      }
    }
    for (const auto& [m, s] : seen) d.known_by_all_at = std::max(d.known_by_all_at, s.known_at);
    for (const auto& [m, why] : failed) {
      d.failed.push_back(m);
      d.failed_why.push_back(why);
    }
    // The majority is of the members not evicted by a planned change: those
    // are alive and leave by a decision every rank took, not lost.
    size_t n = current.members.size();
    if (d.cause.source == DetectionSource::kRequest) {
      for (int m : d.cause.evict) {
        if (std::find(current.members.begin(), current.members.end(), m) != current.members.end()) {
          --n;
        }
      }
    }
    STRATA_RETURN_IF_ERROR(TakeJoins(current, keys, d));
    if (seen.size() * 2 <= n) {
      d.kind = Decision::Kind::kStop;
      d.stop_reason =
          absl::StrCat("only ", seen.size(), " of the ", n, " members of epoch ", current.epoch,
                       " checked in (", Ranks(current.members), " less failed ", Ranks(d.failed),
                       "), not a majority: this partition stops rather than train on "
                       "beside another");
    } else {
      d.Plan(current, options_.grow);
    }
    d.decided_at = absl::Now();
    const std::string encoded = d.Encode();
    absl::StatusOr<std::string> written =
        store_->CompareSet(keys.Decision(), "", encoded, absl::Now() + options_.decision_timeout);
    if (!written.ok()) return strata::internal::Annotate(written.status(), where);
    // The joiners learn their answer from the leader whose decision stands.
    if (*written == encoded) STRATA_RETURN_IF_ERROR(AnswerJoins(current, keys, d));
    // Fence: a member taken as failed whose process still exists on this
    // host (stopped, hung) is killed, so that it cannot resume on a stale
    // state and its launcher can finish. Not a rank a planned change
    // evicts: it is alive and leaves by itself, saying why.
    if (options_.fence_unresponsive && d.kind == Decision::Kind::kContinue) {
      for (int m : d.failed) {
        if (d.cause.source == DetectionSource::kRequest &&
            std::find(d.cause.evict.begin(), d.cause.evict.end(), m) != d.cause.evict.end()) {
          continue;
        }
        auto p = processes.find(m);
        if (p == processes.end()) {
          absl::StatusOr<std::optional<std::string>> hb = Peek(keys.Heartbeat(m));
          if (hb.ok() && hb->has_value()) {
            const size_t space = (*hb)->find(' ');
            absl::StatusOr<internal::ProcessId> id = internal::ProcessId::Decode(
                space == std::string::npos ? "" : absl::string_view(**hb).substr(space + 1));
            if (id.ok()) p = processes.emplace(m, *id).first;
          }
        }
        if (p != processes.end()) internal::Fence(p->second);
      }
    }
    return absl::OkStatus();
  }

  // The join requests not answered yet (numbers after current.joins_seen):
  // each is admitted (d.joined) or refused (d.refused, with why).
  absl::Status TakeJoins(const Membership& current, const Keys& keys, Decision& d) {
    const absl::Time deadline = absl::Now() + options_.decision_timeout;
    d.joins_seen = current.joins_seen;
    absl::StatusOr<int64_t> count = store_->Add(keys.Joins(), 0, deadline);
    if (!count.ok()) return count.status();
    for (int64_t n = current.joins_seen + 1; n <= *count; ++n) {
      // A joiner writes its request right after counting it.
      absl::StatusOr<std::string> text =
          store_->Get(keys.Join(n), absl::Now() + options_.settle_timeout);
      nlohmann::json j =
          text.ok() ? nlohmann::json::parse(*text, nullptr, false) : nlohmann::json(nullptr);
      if (!j.is_object() || !j.contains("rank") || !j.contains("config")) {
        d.refused.emplace_back(n, text.ok() ? absl::StrCat("a bad request '", *text, "'")
                                            : "its request was never written (the joiner died "
                                              "while asking?)");
        continue;
      }
      const std::string config = j["config"].get<std::string>();
      if (config != options_.config) {
        d.refused.emplace_back(
            n, absl::StrCat("its config '", config, "' is not the job's '", options_.config, "'"));
        continue;
      }
      if (j.contains("process")) {
        absl::StatusOr<internal::ProcessId> p =
            internal::ProcessId::Decode(j["process"].get<std::string>());
        if (p.ok() && internal::Probe(*p) == internal::ProbeResult::kGone) {
          d.refused.emplace_back(
              n, absl::StrCat("its process (pid ", p->pid, " on ", p->host, ") is gone"));
          continue;
        }
      }
      d.joined.push_back(j["rank"].get<int>());
    }
    d.joins_seen = std::max(d.joins_seen, *count);
    return absl::OkStatus();
  }

  absl::Status AnswerJoins(const Membership& current, const Keys& keys, const Decision& d) {
    const absl::Time deadline = absl::Now() + options_.decision_timeout;
    std::vector<std::pair<int64_t, std::string>> answers;
    for (const auto& [n, why] : d.refused) {
      answers.emplace_back(n, nlohmann::json({{"refused", why}}).dump());
    }
    for (int64_t n = current.joins_seen + 1; n <= d.joins_seen; ++n) {
      bool refused = false;
      for (const auto& r : d.refused) refused = refused || r.first == n;
      if (refused) continue;
      answers.emplace_back(
          n,
          d.kind == Decision::Kind::kStop
              ? nlohmann::json({{"refused", absl::StrCat("the job stops: ", d.stop_reason)}}).dump()
              : nlohmann::json({{"epoch", current.epoch}}).dump());
    }
    for (const auto& [n, answer] : answers) {
      STRATA_RETURN_IF_ERROR(store_->Set(keys.JoinAnswer(n), answer, deadline));
    }
    return absl::OkStatus();
  }

  const std::shared_ptr<Store> store_;
  const ElasticOptions options_;
};

}  // namespace

Membership Decision::Next() const {
  Membership next;
  next.epoch = next_epoch;
  next.mesh = mesh;
  next.members = members;
  next.full_dp = full_dp;
  next.joins_seen = joins_seen;
  return next;
}

void Decision::Plan(const Membership& current, bool grow) {
  full_dp = current.full_dp;
  joins_seen = std::max(joins_seen, current.joins_seen);
  absl::StatusOr<ChangePlan> plan = PlanChange(current, failed);
  if (!plan.ok()) {
    kind = Kind::kStop;
    stop_reason = std::string(plan.status().message());
    return;
  }
  leaving = std::move(plan->leaving);
  replaced = std::move(plan->replaced);
  plan->next.members.insert(plan->next.members.end(), joined.begin(), joined.end());
  plan->next.full_dp = full_dp;
  if (grow) {
    absl::StatusOr<std::vector<int>> placed = PlanGrow(plan->next);
    if (!placed.ok()) {
      kind = Kind::kStop;
      stop_reason = std::string(placed.status().message());
      return;
    }
    grown = *std::move(placed);
  }
  members = std::move(plan->next.members);
  mesh = plan->next.mesh;
}

void Decision::Describe(RecoveryEvent& event) const {
  event.epoch_after = next_epoch;
  event.cause = cause;
  event.failed = failed;
  event.failed_why = failed_why;
  event.leaving = leaving;
  event.members = members;
  event.replaced = replaced;
  event.joined = joined;
  event.grown = grown;
  event.spares.assign(members.begin() + std::min<size_t>(members.size(), mesh.world_size),
                      members.end());
  event.mesh_after = mesh;
}

std::string Decision::Encode() const {
  nlohmann::json j;
  j["kind"] = kind == Kind::kContinue ? "continue" : "stop";
  j["epoch"] = epoch;
  j["next_epoch"] = next_epoch;
  j["failed"] = failed;
  j["failed_why"] = failed_why;
  j["leaving"] = leaving;
  j["replaced"] = replaced;
  j["joined"] = joined;
  j["grown"] = grown;
  j["refused"] = refused;
  j["full_dp"] = full_dp;
  j["joins_seen"] = joins_seen;
  j["members"] = members;
  j["mesh"] = {{"world_size", mesh.world_size},
               {"tp", mesh.tp},
               {"pp", mesh.pp},
               {"cp", mesh.cp},
               {"ep", mesh.ep},
               {"etp", mesh.etp},
               {"dp", mesh.dp},
               {"order", mesh.order},
               {"ranks_per_node", mesh.ranks_per_node}};
  j["stop_reason"] = stop_reason;
  j["cause"] = EncodeDetection(cause);
  j["leader"] = leader;
  j["known_by_all_at"] = Unix(known_by_all_at);
  j["decided_at"] = Unix(decided_at);
  return j.dump();
}

absl::StatusOr<Decision> Decision::Decode(absl::string_view text) {
  nlohmann::json j = nlohmann::json::parse(text.begin(), text.end(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat("bad decision record '", text, "'"));
  }
  Decision d;
  try {
    d.kind = j.at("kind").get<std::string>() == "continue" ? Kind::kContinue : Kind::kStop;
    d.epoch = j.at("epoch").get<uint64_t>();
    d.next_epoch = j.at("next_epoch").get<uint64_t>();
    d.failed = j.at("failed").get<std::vector<int>>();
    d.failed_why = j.at("failed_why").get<std::vector<std::string>>();
    d.leaving = j.at("leaving").get<std::vector<int>>();
    d.replaced = j.at("replaced").get<std::vector<std::pair<int, int>>>();
    d.joined = j.at("joined").get<std::vector<int>>();
    d.grown = j.at("grown").get<std::vector<int>>();
    d.refused = j.at("refused").get<std::vector<std::pair<int64_t, std::string>>>();
    d.full_dp = j.at("full_dp").get<int>();
    d.joins_seen = j.at("joins_seen").get<int64_t>();
    d.members = j.at("members").get<std::vector<int>>();
    const nlohmann::json& m = j.at("mesh");
    d.mesh.world_size = m.at("world_size").get<int>();
    d.mesh.tp = m.at("tp").get<int>();
    d.mesh.pp = m.at("pp").get<int>();
    d.mesh.cp = m.at("cp").get<int>();
    d.mesh.ep = m.at("ep").get<int>();
    d.mesh.etp = m.at("etp").get<int>();
    d.mesh.dp = m.at("dp").get<int>();
    d.mesh.order = m.at("order").get<std::string>();
    d.mesh.ranks_per_node = m.at("ranks_per_node").get<int>();
    d.stop_reason = j.at("stop_reason").get<std::string>();
    absl::StatusOr<Detection> cause = DecodeDetection(j.at("cause").get<std::string>());
    if (!cause.ok()) return cause.status();
    d.cause = *cause;
    d.leader = j.at("leader").get<int>();
    d.known_by_all_at = FromUnix(j.at("known_by_all_at").get<double>());
    d.decided_at = FromUnix(j.at("decided_at").get<double>());
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("bad decision record: ", e.what()));
  }
  return d;
}

std::unique_ptr<Agreement> MakeStoreAgreement(std::shared_ptr<Store> store,
                                              const ElasticOptions& options) {
  return std::make_unique<StoreAgreement>(std::move(store), options);
}

absl::Status CheckInForTest(Store& store, const ElasticOptions& options, uint64_t epoch, int rank,
                            const std::vector<int>& unreachable) {
  nlohmann::json j = {{"known_at", Unix(absl::Now())},
                      {"suspects", std::vector<int>{}},
                      {"unreachable", unreachable},
                      {"process", internal::Self().Encode()}};
  const Keys keys(options.job, epoch);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  STRATA_RETURN_IF_ERROR(store.Set(keys.Alive(rank), j.dump(), deadline));
  return store.Add(keys.CheckIns(), 1, deadline).status();
}

}  // namespace strata::elastic
