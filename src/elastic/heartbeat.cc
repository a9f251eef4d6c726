// The heartbeat monitor (heartbeat.h).
#include "strata/elastic/heartbeat.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "elastic/internal/keys.h"
#include "elastic/internal/process.h"
#include "strata/base/status.h"

namespace strata::elastic {

using internal::Keys;
using internal::ProbeResult;
using internal::ProcessId;

namespace {

double Unix(absl::Time t) {
  return t == absl::InfinitePast() ? 0.0 : absl::ToDoubleSeconds(t - absl::UnixEpoch());
}
absl::Time FromUnix(double s) {
  return s == 0.0 ? absl::InfinitePast() : absl::UnixEpoch() + absl::Seconds(s);
}

// The ring successor of `rank` among `members` (-1 when alone or absent).
int Successor(const std::vector<int>& members, int rank) {
  auto it = std::find(members.begin(), members.end(), rank);
  if (it == members.end() || members.size() < 2) return -1;
  ++it;
  return it == members.end() ? members.front() : *it;
}

}  // namespace

std::string EncodeDetection(const Detection& d) {
  nlohmann::json j = {{"source", static_cast<int>(d.source)},
                      {"reporter", d.reporter},
                      {"suspect", d.suspect},
                      {"evict", d.evict},
                      {"detail", d.detail},
                      {"abort", d.abort},
                      {"found_at", Unix(d.found_at)},
                      {"failed_at", Unix(d.failed_at)}};
  return j.dump();
}

absl::StatusOr<Detection> DecodeDetection(absl::string_view text) {
  nlohmann::json j = nlohmann::json::parse(text.begin(), text.end(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat("bad alarm record '", text, "'"));
  }
  Detection d;
  try {
    const int source = j.at("source").get<int>();
    if (source < 0 || source > static_cast<int>(DetectionSource::kJoin)) {
      return absl::InvalidArgumentError(absl::StrCat("bad alarm source ", source));
    }
    d.source = static_cast<DetectionSource>(source);
    d.reporter = j.at("reporter").get<int>();
    d.suspect = j.at("suspect").get<int>();
    d.evict = j.at("evict").get<std::vector<int>>();
    d.detail = j.at("detail").get<std::string>();
    d.abort = j.value("abort", true);
    d.found_at = FromUnix(j.at("found_at").get<double>());
    d.failed_at = FromUnix(j.at("failed_at").get<double>());
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("bad alarm record '", text, "': ", e.what()));
  }
  return d;
}

absl::StatusOr<std::string> ProbeHeartbeatProcess(absl::string_view process) {
  STRATA_ASSIGN_OR_RETURN(ProcessId id, ProcessId::Decode(process));
  return std::string(internal::ProbeResultName(internal::Probe(id)));
}

struct HeartbeatMonitor::Epoch {
  Membership membership;
  Keys keys;
  std::optional<Keys> previous;  // the epoch before, while the successor switches
  int successor = -1;
  absl::Time watch_start;
  // The successor's heartbeat as last seen, and when it last changed.
  std::string last_value;
  absl::Time last_change;
  std::optional<ProcessId> successor_process;
  bool suspected = false;
  uint64_t seq = 0;
  // Guarded by the monitor's mu_.
  std::optional<Detection> alarm;
  absl::Time known_at = absl::InfinitePast();
  bool reacted = false;
  bool checked_in = false;

  Epoch(const Membership& m, const std::string& job, int rank)
      : membership(m), keys(job, m.epoch), successor(Successor(m.members, rank)) {
    if (m.epoch > 1) previous.emplace(job, m.epoch - 1);
    watch_start = absl::Now();
    last_change = watch_start;
  }
};

HeartbeatMonitor::HeartbeatMonitor(Config config) : config_(std::move(config)) {
  thread_ = std::thread([this] { Run(); });
  if (config_.store->waits_without_polling()) {
    alarm_thread_ = std::thread([this] { WaitForAlarms(); });
  }
}

HeartbeatMonitor::~HeartbeatMonitor() { Stop(); }

void HeartbeatMonitor::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  wake_.Cancel();
  if (thread_.joinable()) thread_.join();
  if (alarm_thread_.joinable()) alarm_thread_.join();
}

void HeartbeatMonitor::Watch(const Membership& membership) {
  auto epoch = std::make_shared<Epoch>(membership, config_.options.job, config_.rank);
  {
    std::lock_guard<std::mutex> lock(mu_);
    epoch_ = std::move(epoch);
  }
  cv_.notify_all();
  wake_.Cancel();
}

void HeartbeatMonitor::WaitForAlarms() {
  std::shared_ptr<Epoch> epoch;
  while (true) {
    wake_.Reset();
    {
      std::unique_lock<std::mutex> lock(mu_);
      // An epoch whose alarm this rank knows (from a Raise, the poll, or
      // the store's loss) has nothing more to wait for.
      cv_.wait(lock, [&] {
        return stop_ || (epoch_ != nullptr && (epoch_ != epoch || !epoch_->reacted)) ||
               !store_status_.ok();
      });
      if (stop_ || !store_status_.ok()) break;
      epoch = epoch_;
    }
    // Bounded, so that a lost connection is found by the wait itself too.
    alarm_waited_.store(true);
    absl::Status s = config_.store->CancellableWait({epoch->keys.Alarm()},
                                                    absl::Now() + absl::Minutes(5), wake_);
    if (s.ok()) {
      absl::StatusOr<std::string> alarm =
          config_.store->Get(epoch->keys.Alarm(), absl::Now() + config_.options.heartbeat_timeout);
      absl::StatusOr<Detection> d =
          alarm.ok() ? DecodeDetection(*alarm) : absl::StatusOr<Detection>(alarm.status());
      if (d.ok()) {
        OnAlarm(*epoch, *d);
        continue;
      }
      s = d.status();
    }
    if (absl::IsCancelled(s) || absl::IsDeadlineExceeded(s)) continue;
    // Until a wait works again, the monitor's own thread looks at the
    // alarm every interval (and its beats find a store that is gone).
    alarm_waited_.store(false);
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, absl::ToChronoNanoseconds(config_.options.heartbeat_interval),
                 [&] { return stop_; });
  }
  alarm_waited_.store(false);
}

std::optional<Detection> HeartbeatMonitor::alarm() const {
  std::lock_guard<std::mutex> lock(mu_);
  return epoch_ == nullptr ? std::nullopt : epoch_->alarm;
}

absl::Time HeartbeatMonitor::known_at() const {
  std::lock_guard<std::mutex> lock(mu_);
  return epoch_ == nullptr ? absl::InfinitePast() : epoch_->known_at;
}

absl::Status HeartbeatMonitor::store_status() const {
  std::lock_guard<std::mutex> lock(mu_);
  return store_status_;
}

void HeartbeatMonitor::OnAlarm(Epoch& epoch, const Detection& alarm) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (epoch.reacted) return;
    epoch.reacted = true;
    epoch.alarm = alarm;
    epoch.known_at = absl::Now();
  }
  if (config_.on_alarm) config_.on_alarm(alarm, epoch.membership.epoch);
  (void)CheckInOn(epoch, {});
}

absl::StatusOr<Detection> HeartbeatMonitor::Raise(const Detection& cause) {
  std::shared_ptr<Epoch> epoch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    epoch = epoch_;
  }
  if (epoch == nullptr) return absl::FailedPreconditionError("the monitor watches no epoch yet");
  return RaiseIn(*epoch, cause);
}

absl::StatusOr<Detection> HeartbeatMonitor::RaiseIn(Epoch& e, const Detection& cause) {
  Epoch* epoch = &e;
  if (absl::Status lost = store_status(); !lost.ok()) {
    // The store is gone: nothing to write (each write would wait for it);
    // this rank stops on the alarm.
    OnAlarm(*epoch, cause);
    return lost;
  }
  const absl::Time deadline = absl::Now() + config_.options.heartbeat_timeout;
  absl::StatusOr<std::string> won =
      config_.store->CompareSet(epoch->keys.Alarm(), "", EncodeDetection(cause), deadline);
  Detection winner = cause;
  if (won.ok()) {
    absl::StatusOr<Detection> d = DecodeDetection(*won);
    if (d.ok()) winner = *d;
  }
  if (cause.suspect >= 0 &&
      (cause.source == DetectionSource::kHeartbeat || cause.source == DetectionSource::kProbe)) {
    (void)config_.store->Set(epoch->keys.Suspect(cause.suspect), cause.detail, deadline);
  }
  OnAlarm(*epoch, winner);
  if (!won.ok()) {
    return strata::internal::Annotate(
        won.status(), absl::StrCat("raising the alarm of epoch ", epoch->membership.epoch, " on ",
                                   config_.store->Describe()));
  }
  return winner;
}

absl::Status HeartbeatMonitor::CheckIn(const std::vector<int>& suspects) {
  std::shared_ptr<Epoch> epoch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    epoch = epoch_;
  }
  if (epoch == nullptr) return absl::FailedPreconditionError("the monitor watches no epoch yet");
  return CheckInOn(*epoch, suspects);
}

void HeartbeatMonitor::ReportUnreachable(const std::vector<int>& ranks) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int r : ranks) {
    if (r != config_.rank &&
        std::find(unreachable_.begin(), unreachable_.end(), r) == unreachable_.end()) {
      unreachable_.push_back(r);
    }
  }
}

absl::Status HeartbeatMonitor::CheckInOn(Epoch& epoch, const std::vector<int>& suspects) {
  std::lock_guard<std::mutex> io(checkin_mu_);
  absl::Time known;
  std::vector<int> unreachable;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (epoch.checked_in) return absl::OkStatus();
    if (!store_status_.ok()) return store_status_;
    known = epoch.known_at == absl::InfinitePast() ? absl::Now() : epoch.known_at;
    unreachable = unreachable_;
  }
  const absl::Time deadline = absl::Now() + config_.options.heartbeat_timeout;
  nlohmann::json j = {{"known_at", Unix(known)},
                      {"suspects", suspects},
                      {"unreachable", unreachable},
                      {"process", internal::Self().Encode()}};
  // Evidence from a backend (MPI names failed ranks) is recorded for the
  // leader like a monitor's.
  for (int s : suspects) {
    if (s != config_.rank) {
      (void)config_.store->Set(
          epoch.keys.Suspect(s),
          absl::StrCat("reported failed by the backend to rank ", config_.rank), deadline);
    }
  }
  STRATA_RETURN_IF_ERROR(config_.store->Set(epoch.keys.Alive(config_.rank), j.dump(), deadline));
  {
    std::lock_guard<std::mutex> lock(mu_);
    epoch.checked_in = true;
    // Reported once: a later regroup reports what it finds itself.
    for (int r : unreachable)
      unreachable_.erase(std::find(unreachable_.begin(), unreachable_.end(), r));
  }
  return config_.store->Add(epoch.keys.CheckIns(), 1, deadline).status();
}

void HeartbeatMonitor::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  absl::Time store_failing_since = absl::InfinitePast();
  // The beat and the read of the successor's need only resolve
  // heartbeat_timeout: ten a timeout (the alarm is looked at every
  // interval; the successor's process is probed every interval).
  const absl::Duration beat_every =
      std::max(config_.options.heartbeat_interval, config_.options.heartbeat_timeout / 10);
  absl::Time next_beat = absl::InfinitePast();
  // While the alarm thread waits for the alarm, this thread looks at it
  // only once a timeout, in case that wait was lost without an error.
  absl::Time next_look = absl::InfinitePast();
  while (!stop_) {
    std::shared_ptr<Epoch> epoch = epoch_;
    if (epoch == nullptr) {
      cv_.wait(lock, [&] { return stop_ || epoch_ != nullptr; });
      continue;
    }
    lock.unlock();
    const absl::Time start = absl::Now();
    absl::Status store_error;
    {
      // One pass; a store error ends it early.
      const absl::Time deadline = start + config_.options.heartbeat_timeout;
      Store& store = *config_.store;
      const Keys& keys = epoch->keys;
      // A new epoch beats at once (its keys are new).
      const bool beat = start >= next_beat || epoch->seq == 0;
      if (beat) {
        next_beat = start + beat_every;
        ++epoch->seq;
        store_error = store.Set(keys.Heartbeat(config_.rank),
                                absl::StrCat(epoch->seq, " ", internal::Self().Encode()), deadline);
      }
      if (store_error.ok() && epoch->successor >= 0) {
        Tick(*epoch, beat);
      }
      if (store_error.ok()) {
        bool seen;
        {
          std::lock_guard<std::mutex> l(mu_);
          seen = epoch->reacted;
        }
        if (!seen && (start >= next_look || !alarm_waited_.load())) {
          next_look = start + config_.options.heartbeat_timeout;
          absl::StatusOr<std::string> alarm = store.Get(keys.Alarm(), absl::InfinitePast());
          if (alarm.ok()) {
            absl::StatusOr<Detection> d = DecodeDetection(*alarm);
            if (d.ok()) OnAlarm(*epoch, *d);
          } else if (alarm.status().code() != absl::StatusCode::kDeadlineExceeded &&
                     alarm.status().code() != absl::StatusCode::kNotFound) {
            store_error = alarm.status();
          }
        }
      }
    }
    if (!store_error.ok()) {
      if (store_failing_since == absl::InfinitePast()) store_failing_since = start;
      if (absl::Now() - store_failing_since > config_.options.heartbeat_timeout) {
        Detection d;
        d.source = DetectionSource::kBackend;
        d.reporter = config_.rank;
        d.detail = absl::StrCat(
            "this rank cannot reach the elastic store ", config_.store->Describe(), " for ",
            absl::FormatDuration(absl::Now() - store_failing_since), ": ", store_error.message());
        d.found_at = d.failed_at = absl::Now();
        {
          std::lock_guard<std::mutex> l(mu_);
          store_status_ = absl::UnavailableError(d.detail);
        }
        OnAlarm(*epoch, d);
      }
    } else {
      store_failing_since = absl::InfinitePast();
    }
    lock.lock();
    cv_.wait_until(lock, absl::ToChronoTime(start + config_.options.heartbeat_interval),
                   [&] { return stop_ || epoch_ != epoch; });
  }
}

void HeartbeatMonitor::Tick(Epoch& epoch, bool read) {
  Store& store = *config_.store;
  const absl::Time now = absl::Now();
  const int succ = epoch.successor;
  absl::StatusOr<std::string> value = absl::NotFoundError("not read in this pass");
  if (read) {
    value = store.Get(epoch.keys.Heartbeat(succ), absl::InfinitePast());
    if (!value.ok() && epoch.previous.has_value()) {
      value = store.Get(epoch.previous->Heartbeat(succ), absl::InfinitePast());
    }
  }
  if (value.ok() && *value != epoch.last_value) {
    epoch.last_value = *value;
    epoch.last_change = now;
    const size_t space = value->find(' ');
    if (space != std::string::npos) {
      absl::StatusOr<ProcessId> p = ProcessId::Decode(absl::string_view(*value).substr(space + 1));
      if (p.ok()) epoch.successor_process = *p;
    }
  }
  if (epoch.suspected) return;
  Detection d;
  d.reporter = config_.rank;
  d.suspect = succ;
  d.found_at = now;
  if (config_.options.probe_processes && epoch.successor_process.has_value() &&
      internal::Probe(*epoch.successor_process) == ProbeResult::kGone) {
    d.source = DetectionSource::kProbe;
    d.detail = absl::StrCat("the process of rank ", succ, " (pid ", epoch.successor_process->pid,
                            " on ", epoch.successor_process->host, ") is gone");
    d.failed_at = now;
  } else if (now - epoch.last_change >
             (epoch.last_value.empty()
                  // Not started yet: ranks reach their loop's creation at
                  // different times (by seconds when they outnumber the
                  // cores); a rank that never starts fails its collectives.
                  ? std::max(config_.options.heartbeat_timeout, config_.options.rebuild_timeout)
                  : config_.options.heartbeat_timeout)) {
    d.source = DetectionSource::kHeartbeat;
    d.detail = epoch.last_value.empty()
                   ? absl::StrCat("rank ", succ, " published no heartbeat in ",
                                  absl::FormatDuration(now - epoch.watch_start))
                   : absl::StrCat("the heartbeat of rank ", succ, " has not changed for ",
                                  absl::FormatDuration(
                                      absl::Trunc(now - epoch.last_change, absl::Milliseconds(1))));
    d.failed_at = epoch.last_change;
  } else {
    return;
  }
  epoch.suspected = true;
  (void)RaiseIn(epoch, d);
}

}  // namespace strata::elastic
