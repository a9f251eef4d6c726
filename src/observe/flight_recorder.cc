#include "strata/observe/flight_recorder.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"
#include "strata/base/status.h"

namespace strata::observe {
namespace {

// The flight-recorder format version this dump follows (PyTorch 2.10's
// FlightRecorder writes "2.10"; fr_trace accepts any "<major>.<minor>").
constexpr const char* kTorchFormatVersion = "2.10";

// Nanoseconds, or null while not seen (PyTorch writes None).
nlohmann::json TimeOrNull(int64_t ns) {
  return ns == 0 ? nlohmann::json(nullptr) : nlohmann::json(ns);
}

std::string HostName() {
  char name[256] = {0};
  if (gethostname(name, sizeof(name) - 1) != 0) return "unknown";
  return name;
}

}  // namespace

FlightRecorder::FlightRecorder(const FlightRecorderOptions& options)
    : on_error_(options.on_error), slots_(options.capacity) {
  STRATA_CHECK(options.version == FlightRecorderOptions::kVersion, "FlightRecorderOptions version ",
               options.version);
  STRATA_CHECK(options.capacity >= 1, "a flight recorder keeps at least one operation");
}

absl::StatusOr<std::shared_ptr<FlightRecorder>> FlightRecorder::Create(
    const FlightRecorderOptions& options) {
  if (options.version != FlightRecorderOptions::kVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("FlightRecorderOptions version ", options.version,
                     " is not supported (this build: ", FlightRecorderOptions::kVersion, ")"));
  }
  if (options.capacity < 1) {
    return absl::InvalidArgumentError(
        "FlightRecorderOptions::capacity is 0; the ring keeps at least one operation");
  }
  return std::make_shared<FlightRecorder>(options);
}

void FlightRecorder::OnScheduled(const OpRecord& record) {
  std::lock_guard<std::mutex> lock(mu_);
  RecordedOp& slot = slots_[next_ % slots_.size()];
  slot.record_id = next_++;
  slot.record = record;
}

RecordedOp* FlightRecorder::Find(const OpRecord& record) {
  // An operation completes soon after it is issued, so the search rarely
  // goes past the few operations issued since.
  const size_t n = static_cast<size_t>(std::min<uint64_t>(next_, slots_.size()));
  for (size_t back = 1; back <= n; ++back) {
    RecordedOp& slot = slots_[(next_ - back) % slots_.size()];
    if (slot.record.op_id == record.op_id && slot.record.comm == record.comm) return &slot;
  }
  return nullptr;
}

void FlightRecorder::OnStarted(const OpRecord& record) {
  std::lock_guard<std::mutex> lock(mu_);
  RecordedOp* slot = Find(record);
  if (slot == nullptr) return;
  slot->record.state = record.state;
  slot->record.time_started_ns = record.time_started_ns;
}

void FlightRecorder::OnCompleted(const OpRecord& record) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    RecordedOp* slot = Find(record);
    if (slot != nullptr) {
      slot->record.state = record.state;
      slot->record.time_started_ns = record.time_started_ns;
      slot->record.time_completed_ns = record.time_completed_ns;
      slot->record.status = record.status;
    }
  }
  if (on_error_ && !record.status.ok() && !absl::IsCancelled(record.status)) on_error_(record);
}

uint64_t FlightRecorder::recorded() const {
  std::lock_guard<std::mutex> lock(mu_);
  return next_;
}

std::vector<RecordedOp> FlightRecorder::Snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t n = static_cast<size_t>(std::min<uint64_t>(next_, slots_.size()));
  std::vector<RecordedOp> out;
  out.reserve(n);
  for (uint64_t id = next_ - n; id < next_; ++id) out.push_back(slots_[id % slots_.size()]);
  return out;
}

std::string FlightRecorder::DumpFileName(int world_rank) {
  return absl::StrCat("strata_trace_rank_", world_rank, ".json");
}

std::string FlightRecorder::DumpJson(const DumpOptions& options) const {
  const std::vector<RecordedOp> ops = Snapshot();
  const uint64_t total = recorded();

  // One process group per communicator, named after it in the order this
  // rank first recorded an operation on it.
  struct Group {
    std::string uid;
    int index = 0;
    const CommRecord* comm = nullptr;
    uint64_t enqueued = 0, started = 0, completed = 0;
  };
  std::map<const CommRecord*, Group> groups;
  std::map<std::string, int> instances;
  std::vector<const CommRecord*> order;
  for (const RecordedOp& op : ops) {
    const CommRecord* comm = op.record.comm.get();
    if (groups.count(comm) != 0) continue;
    const std::string name = comm != nullptr ? comm->name : "unknown";
    const int instance = ++instances[name];
    Group g;
    g.uid = instance == 1 ? name : absl::StrCat(name, "#", instance);
    g.index = static_cast<int>(order.size());
    g.comm = comm;
    groups[comm] = g;
    order.push_back(comm);
  }

  nlohmann::json entries = nlohmann::json::array();
  for (const RecordedOp& op : ops) {
    const OpRecord& r = op.record;
    Group& g = groups[r.comm.get()];
    const bool p2p = IsPointToPoint(r.kind);
    if (!p2p) {
      g.enqueued = std::max(g.enqueued, r.collective_seq_id);
      if (r.state != OpState::kScheduled) g.started = std::max(g.started, r.collective_seq_id);
      if (r.state == OpState::kCompleted) {
        g.completed = std::max(g.completed, r.collective_seq_id);
      }
    }
    const char* dtype = TorchScalarTypeName(r.dtype);
    // A receive has no input of its own: PyTorch records the one tensor as
    // both, so that a send's input matches a receive's output and the sizes
    // of both sides compare.
    const size_t input = r.kind == OpKind::kRecv ? r.output_count : r.input_count;
    const size_t output = r.kind == OpKind::kSend ? r.input_count : r.output_count;
    nlohmann::json strata = {
        {"peer", r.peer},
        {"root", r.root},
        {"reduce_op", r.reduce_op != nullptr ? nlohmann::json(r.reduce_op) : nullptr},
        {"group_rank", r.comm != nullptr ? r.comm->rank : 0},
        {"group_size", r.comm != nullptr ? r.comm->size : 1},
        {"error", r.state == OpState::kCompleted && !r.status.ok()
                      ? nlohmann::json(r.status.ToString())
                      : nlohmann::json(nullptr)},
    };
    entries.push_back({
        {"record_id", op.record_id},
        {"pg_id", g.index},
        {"process_group", {g.uid, g.comm != nullptr ? g.comm->name : "unknown"}},
        {"collective_seq_id", r.collective_seq_id},
        {"p2p_seq_id", r.p2p_seq_id},
        {"op_id", r.op_id},
        {"profiling_name", ProfilingName(r)},
        {"time_created_ns", r.time_created_ns},
        {"duration_ms", r.state == OpState::kCompleted && r.time_started_ns != 0
                            ? nlohmann::json((r.time_completed_ns - r.time_started_ns) / 1e6)
                            : nlohmann::json(nullptr)},
        {"timeout_ms", r.timeout_ms},
        {"is_p2p", p2p},
        {"input_sizes", {{input}}},
        {"input_dtypes", {dtype}},
        {"output_sizes", {{output}}},
        {"output_dtypes", {dtype}},
        {"state", OpStateName(r.state)},
        {"time_discovered_started_ns", TimeOrNull(r.time_started_ns)},
        {"time_discovered_completed_ns", TimeOrNull(r.time_completed_ns)},
        {"retired", r.state == OpState::kCompleted},
        {"frames", nlohmann::json::array()},
        {"strata", std::move(strata)},
    });
  }

  nlohmann::json pg_config = nlohmann::json::object();
  nlohmann::json pg_status = nlohmann::json::object();
  for (const CommRecord* comm : order) {
    const Group& g = groups[comm];
    std::optional<std::vector<int>> ranks;
    if (comm != nullptr && options.group_ranks) ranks = options.group_ranks(*comm);
    pg_config[g.uid] = {
        {"name", g.uid},
        {"desc", comm != nullptr ? comm->name : "unknown"},
        {"ranks", absl::StrCat("[", ranks ? absl::StrJoin(*ranks, ", ") : "", "]")},
        {"backend", comm != nullptr ? comm->backend : "unknown"},
        {"group_rank", comm != nullptr ? comm->rank : 0},
        {"group_size", comm != nullptr ? comm->size : 1},
    };
    pg_status[g.uid] = {
        {"last_enqueued_collective", g.enqueued},
        {"last_started_collective", g.started},
        {"last_completed_collective", g.completed},
    };
  }

  nlohmann::json dump = {
      {"version", kTorchFormatVersion},
      {"pg_config", std::move(pg_config)},
      {"pg_status", std::move(pg_status)},
      {"entries", std::move(entries)},
      {"strata",
       {
           {"format", 1},
           {"rank", options.world_rank},
           {"world_size", options.world_size},
           {"host", HostName()},
           {"pid", static_cast<int64_t>(getpid())},
           {"reason", options.reason},
           {"capacity", slots_.size()},
           {"recorded", total},
           {"dump_time_ns", absl::GetCurrentTimeNanos()},
       }},
  };
  return dump.dump(1);
}

absl::StatusOr<std::string> FlightRecorder::Dump(const std::string& dir,
                                                 const DumpOptions& options) const {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("cannot create the trace directory ", dir, ": ", ec.message()));
  }
  const std::string text = DumpJson(options);
  const std::string path = (std::filesystem::path(dir) / DumpFileName(options.world_rank)).string();
  const std::string temp = absl::StrCat(path, ".tmp.", getpid());
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(temp.c_str(), "w"), &std::fclose);
  if (f == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot write the flight-recorder dump ", temp, ": ", std::strerror(errno)));
  }
  const bool written = std::fwrite(text.data(), 1, text.size(), f.get()) == text.size();
  const int closed = std::fclose(f.release());
  if (!written || closed != 0) {
    const std::string why = std::strerror(errno);
    std::remove(temp.c_str());
    return absl::UnavailableError(
        absl::StrCat("cannot write the flight-recorder dump ", temp, ": ", why));
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(temp.c_str());
    return absl::UnavailableError(absl::StrCat("cannot rename ", temp, " to ", path, ": ", why));
  }
  return path;
}

}  // namespace strata::observe
