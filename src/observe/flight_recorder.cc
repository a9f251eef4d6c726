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
#include <thread>
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
    : on_error_(options.on_error),
      capacity_(options.capacity),
      slots_(std::make_unique<Slot[]>(options.capacity)) {
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

namespace {

// A slot's flag is held for a copy of one entry: spin a little, then let
// the holder run.
template <typename SlotT>
void LockSlot(SlotT& slot) {
  while (slot.busy.exchange(true, std::memory_order_acquire)) {
    for (int i = 0; slot.busy.load(std::memory_order_relaxed); ++i) {
      if (i >= 64) std::this_thread::yield();
    }
  }
}

template <typename SlotT>
void UnlockSlot(SlotT& slot) {
  slot.busy.store(false, std::memory_order_release);
}

}  // namespace

class FlightRecorder::SlotLock {
 public:
  explicit SlotLock(Slot& slot) : slot_(slot) { LockSlot(slot_); }
  ~SlotLock() { UnlockSlot(slot_); }
  SlotLock(const SlotLock&) = delete;
  SlotLock& operator=(const SlotLock&) = delete;

 private:
  Slot& slot_;
};

void FlightRecorder::OnScheduled(const OpRecord& record) {
  const uint64_t id = next_.fetch_add(1, std::memory_order_relaxed);
  Slot& slot = slots_[id % capacity_];
  SlotLock lock(slot);
  // An operation issued later on another thread may have taken the entry
  // first (the ring went round while this one was between its number and
  // here): the newer one stays.
  if (slot.id_plus_one.load(std::memory_order_relaxed) > id) return;
  slot.op.record_id = id;
  slot.op.record = record;
  slot.op_id.store(record.op_id, std::memory_order_relaxed);
  slot.comm.store(record.comm.get(), std::memory_order_relaxed);
  slot.id_plus_one.store(id + 1, std::memory_order_release);
}

FlightRecorder::Slot* FlightRecorder::FindLocked(const OpRecord& record) {
  // An operation completes soon after it is issued, so the search rarely
  // goes past the few operations issued since.
  const uint64_t next = next_.load(std::memory_order_acquire);
  const uint64_t n = std::min<uint64_t>(next, capacity_);
  for (uint64_t back = 1; back <= n; ++back) {
    Slot& slot = slots_[(next - back) % capacity_];
    if (slot.op_id.load(std::memory_order_relaxed) != record.op_id ||
        slot.comm.load(std::memory_order_relaxed) != record.comm.get()) {
      continue;
    }
    LockSlot(slot);
    // Still this operation's (not overwritten since the keys were read)?
    if (slot.id_plus_one.load(std::memory_order_relaxed) != 0 &&
        slot.op.record.op_id == record.op_id && slot.op.record.comm == record.comm) {
      return &slot;
    }
    UnlockSlot(slot);
  }
  return nullptr;
}

void FlightRecorder::OnStarted(const OpRecord& record) {
  Slot* slot = FindLocked(record);
  if (slot == nullptr) return;
  slot->op.record.state = record.state;
  slot->op.record.time_started_ns = record.time_started_ns;
  UnlockSlot(*slot);
}

void FlightRecorder::OnCompleted(const OpRecord& record) {
  if (Slot* slot = FindLocked(record); slot != nullptr) {
    slot->op.record.state = record.state;
    slot->op.record.time_started_ns = record.time_started_ns;
    slot->op.record.time_completed_ns = record.time_completed_ns;
    slot->op.record.status = record.status;
    UnlockSlot(*slot);
  }
  if (on_error_ && !record.status.ok() && !absl::IsCancelled(record.status)) on_error_(record);
}

uint64_t FlightRecorder::recorded() const { return next_.load(std::memory_order_acquire); }

std::vector<RecordedOp> FlightRecorder::Snapshot() const {
  const uint64_t next = next_.load(std::memory_order_acquire);
  const uint64_t n = std::min<uint64_t>(next, capacity_);
  std::vector<RecordedOp> out;
  out.reserve(static_cast<size_t>(n));
  for (uint64_t id = next - n; id < next; ++id) {
    Slot& slot = slots_[id % capacity_];
    SlotLock lock(slot);
    // Skipped: an entry whose operation has its number but is not written
    // yet, or one already overwritten by an operation issued since.
    if (slot.id_plus_one.load(std::memory_order_relaxed) != id + 1) continue;
    out.push_back(slot.op);
  }
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
           {"capacity", capacity_},
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
