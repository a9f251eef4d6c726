#include "strata/observe/op_record.h"

#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "strata/base/status.h"

namespace strata::observe {

const char* OpKindName(OpKind kind) {
  switch (kind) {
    case OpKind::kAllReduce:
      return "all_reduce";
    case OpKind::kBroadcast:
      return "broadcast";
    case OpKind::kReduce:
      return "reduce";
    case OpKind::kAllGather:
      return "all_gather";
    case OpKind::kReduceScatter:
      return "reduce_scatter";
    case OpKind::kAllToAll:
    case OpKind::kAllToAllV:
      return "all_to_all";
    case OpKind::kBarrier:
      return "barrier";
    case OpKind::kSend:
      return "send";
    case OpKind::kRecv:
      return "recv";
    case OpKind::kSplit:
      return "split";
    case OpKind::kShrink:
      return "shrink";
  }
  return "unknown";
}

bool IsPointToPoint(OpKind kind) { return kind == OpKind::kSend || kind == OpKind::kRecv; }

const char* OpStateName(OpState state) {
  switch (state) {
    case OpState::kScheduled:
      return "scheduled";
    case OpState::kStarted:
      return "started";
    case OpState::kCompleted:
      return "completed";
  }
  return "unknown";
}

const char* TorchScalarTypeName(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
      return "Float";
    case DataType::kFloat64:
      return "Double";
    case DataType::kFloat16:
      return "Half";
    case DataType::kBFloat16:
      return "BFloat16";
    case DataType::kInt8:
      return "Char";
    case DataType::kUInt8:
      return "Byte";
    case DataType::kInt32:
      return "Int";
    case DataType::kInt64:
      return "Long";
    case DataType::kInt16:
      return "Short";
    case DataType::kBool:
      return "Bool";
  }
  return "Undefined";
}

std::string ProfilingName(const OpRecord& record) {
  const std::string backend = record.comm != nullptr ? record.comm->backend : "strata";
  const int rank = record.comm != nullptr ? record.comm->rank : 0;
  switch (record.kind) {
    case OpKind::kSend:
      return absl::StrCat(backend, ":send ", rank, "->", record.peer);
    case OpKind::kRecv:
      return absl::StrCat(backend, ":recv ", rank, "<-", record.peer);
    default:
      return absl::StrCat(backend, ":", OpKindName(record.kind));
  }
}

namespace {

class FanOutSink final : public OpSink {
 public:
  explicit FanOutSink(std::vector<std::shared_ptr<OpSink>> sinks) : sinks_(std::move(sinks)) {}
  void OnScheduled(const OpRecord& r) override {
    for (const auto& s : sinks_) s->OnScheduled(r);
  }
  void OnStarted(const OpRecord& r) override {
    for (const auto& s : sinks_) s->OnStarted(r);
  }
  void OnCompleted(const OpRecord& r) override {
    for (const auto& s : sinks_) s->OnCompleted(r);
  }
  void OnWaited(const CommRecord& comm, OpKind kind, int64_t waited_ns) override {
    for (const auto& s : sinks_) s->OnWaited(comm, kind, waited_ns);
  }

 private:
  const std::vector<std::shared_ptr<OpSink>> sinks_;
};

}  // namespace

std::shared_ptr<OpSink> MakeFanOutSink(std::vector<std::shared_ptr<OpSink>> sinks) {
  std::vector<std::shared_ptr<OpSink>> kept;
  for (auto& s : sinks) {
    if (s != nullptr) kept.push_back(std::move(s));
  }
  return std::make_shared<FanOutSink>(std::move(kept));
}

bool SinkSlots::Attach(const void* owner, void* value) const {
  for (int i = 0; i < kSlots; ++i) {
    const void* expected = nullptr;
    if (owners_[i].compare_exchange_strong(expected, owner, std::memory_order_acq_rel)) {
      values_[i].store(value, std::memory_order_release);
      return true;
    }
    if (expected == owner) return true;
  }
  return false;
}

OpTrace::OpTrace(std::shared_ptr<OpSink> sink, OpRecord record)
    : sink_(std::move(sink)), record_(std::move(record)) {
  STRATA_CHECK(sink_ != nullptr, "an OpTrace needs a sink");
  // Nobody else has the trace yet.
  sink_->OnScheduled(record_);
}

OpTrace::~OpTrace() {
  // Nobody reported the end: say so rather than leave the operation
  // scheduled for ever in the sink's view. (The last owner: no other
  // thread reports any more.)
  if ((flags_.load(std::memory_order_acquire) & kCompleteClaimed) != 0) return;
  Completed(absl::CancelledError(
      absl::StrCat(OpKindName(record_.kind), " was dropped before it completed")));
}

void OpTrace::Started() {
  uint8_t f = flags_.load(std::memory_order_acquire);
  do {
    if ((f & (kStartClaimed | kCompleteClaimed)) != 0) return;
  } while (!flags_.compare_exchange_weak(f, f | kStartClaimed, std::memory_order_acq_rel,
                                         std::memory_order_acquire));
  record_.state = OpState::kStarted;
  record_.time_started_ns = absl::GetCurrentTimeNanos();
  sink_->OnStarted(record_);
  flags_.fetch_or(kStartDone, std::memory_order_release);
}

void OpTrace::Completed(const absl::Status& status) {
  uint8_t f = flags_.load(std::memory_order_acquire);
  for (;;) {
    if ((f & kCompleteClaimed) != 0) return;
    if ((f & (kStartClaimed | kStartDone)) == kStartClaimed) {
      // Another thread is telling the sink of the start (a few hundred
      // nanoseconds): the completion comes after it.
      std::this_thread::yield();
      f = flags_.load(std::memory_order_acquire);
      continue;
    }
    if (flags_.compare_exchange_weak(f, f | kCompleteClaimed, std::memory_order_acq_rel,
                                     std::memory_order_acquire)) {
      break;
    }
  }
  record_.state = OpState::kCompleted;
  record_.time_completed_ns = absl::GetCurrentTimeNanos();
  record_.status = status;
  sink_->OnCompleted(record_);
  flags_.fetch_or(kCompleteDone, std::memory_order_release);
}

void OpTrace::Waited(int64_t waited_ns) {
  // record_.comm and record_.kind never change after construction: no
  // claim, so a wait never queues behind the backend's Started/Completed.
  if (record_.comm != nullptr) sink_->OnWaited(*record_.comm, record_.kind, waited_ns);
}

bool OpTrace::completed() const {
  return (flags_.load(std::memory_order_acquire) & kCompleteDone) != 0;
}

OpRecord OpTrace::record() const {
  const uint8_t f = flags_.load(std::memory_order_acquire);
  // The fields set at issue never change; those of a state are read only
  // once that state is done (written before, never after).
  OpRecord r;
  r.comm = record_.comm;
  r.kind = record_.kind;
  r.op_id = record_.op_id;
  r.collective_seq_id = record_.collective_seq_id;
  r.p2p_seq_id = record_.p2p_seq_id;
  r.input_count = record_.input_count;
  r.output_count = record_.output_count;
  r.dtype = record_.dtype;
  r.reduce_op = record_.reduce_op;
  r.root = record_.root;
  r.peer = record_.peer;
  r.timeout_ms = record_.timeout_ms;
  r.time_created_ns = record_.time_created_ns;
  r.state = OpState::kScheduled;
  if ((f & kStartDone) != 0) {
    r.state = OpState::kStarted;
    r.time_started_ns = record_.time_started_ns;
  }
  if ((f & kCompleteDone) != 0) {
    r.state = OpState::kCompleted;
    r.time_completed_ns = record_.time_completed_ns;
    r.status = record_.status;
  }
  return r;
}

}  // namespace strata::observe
