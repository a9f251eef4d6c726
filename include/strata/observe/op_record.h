// Records of communication operations, and the sink that receives them.
//
// Every operation a strata::Communicator issues (a collective, a send or a
// receive, a split, a shrink) is described by an OpRecord: the communicator
// it ran on, what it was, its sequence numbers, when it was issued, when it
// was seen to start and when it was seen to complete, and how it ended. A
// communicator whose CommOptions name an OpSink hands the record of each
// operation to it as the operation goes through its states:
//
//   scheduled  issued by the caller, before the backend starts it
//   started    the backend has started it (host backends; NCCL cannot tell
//              without timing events, so its records go from scheduled to
//              completed, as PyTorch's do without TORCH_NCCL_ENABLE_TIMING)
//   completed  done, successfully or not: seen by Work::Wait / Work::Test or
//              by the backend's own progress (MPI's engine thread, Gloo's
//              completer, NCCL's watchdog), whichever sees it first
//
// The fields are those of PyTorch's flight recorder (c10d FlightRecorder
// entries, read by `torch.distributed.flight_recorder`'s fr_trace), so that
// a ring of records dumps in its format one to one: collective_seq_id and
// p2p_seq_id number the collectives and the point-to-point operations of
// one communicator separately, from 1, and each record carries both counters
// (a send carries the collective number reached so far); ProfilingName()
// gives "nccl:all_reduce" or "mpi:send 0->1"; the state names and the
// nanosecond times map to `state`, `time_created_ns`,
// `time_discovered_started_ns` and `time_discovered_completed_ns`.
//
// This area sits below comm (DESIGN.md): comm depends on it, never the
// reverse, so records name reduce ops by string and carry no comm types.
//
//   class CountingSink : public strata::observe::OpSink {
//    public:
//     void OnScheduled(const OpRecord& r) override { ++issued_; }
//     void OnCompleted(const OpRecord& r) override { if (!r.status.ok()) ++failed_; }
//     std::atomic<int> issued_{0}, failed_{0};
//   };
//   strata::CommOptions options;
//   options.sink = std::make_shared<CountingSink>();   // children inherit it
//
// Thread-safety: OpRecord is a value. An OpSink is called from any thread
// (the issuing thread, a waiting thread, a backend's progress thread), for
// different operations at once; it must be thread-safe, must not block, and
// must not call back into the communicator. The calls for one operation
// come one at a time and in state order. OpTrace is thread-safe, and takes
// no lock and allocates nothing between issue and release of a successful
// operation (docs/observability.md, "What it costs").
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "strata/base/dtype.h"
#include "strata/base/export.h"

namespace strata::observe {

// What an operation is. Names (OpKindName) are PyTorch's flight-recorder
// names, so that its analyser matches collectives across ranks.
enum class OpKind : uint8_t {
  kAllReduce,
  kBroadcast,
  kReduce,
  kAllGather,
  kReduceScatter,
  kAllToAll,
  kAllToAllV,
  kBarrier,
  kSend,
  kRecv,
  kSplit,
  kShrink,
};

// "all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter",
// "all_to_all" (equal and variable splits alike, as PyTorch names them),
// "barrier", "send", "recv", "split", "shrink".
STRATA_EXPORT const char* OpKindName(OpKind kind);
// True for send and recv (numbered by p2p_seq_id).
STRATA_EXPORT bool IsPointToPoint(OpKind kind);

enum class OpState : uint8_t { kScheduled, kStarted, kCompleted };
// "scheduled", "started", "completed".
STRATA_EXPORT const char* OpStateName(OpState state);

// The dtype as PyTorch's flight recorder writes it (c10::ScalarType names):
// "Float", "Double", "Half", "BFloat16", "Char", "Byte", "Int", "Long",
// "Short", "Bool".
STRATA_EXPORT const char* TorchScalarTypeName(DataType dtype);

// Where sinks keep what they resolved once for a communicator (the metric
// cells of its group, say), so that each operation finds it with a few
// atomic loads instead of a lookup by name under a lock. A sink attaches
// one pointer under a key of its own (its address); kSlots sinks at most
// per communicator, a sink that finds no free slot looks up as before. The
// sink owns what the pointer points to and must keep it alive for as long
// as the communicator may call it (a communicator keeps its sink alive).
class STRATA_EXPORT SinkSlots {
 public:
  static constexpr int kSlots = 4;
  SinkSlots() = default;
  SinkSlots(const SinkSlots&) = delete;
  SinkSlots& operator=(const SinkSlots&) = delete;

  // What `owner` attached; null when nothing (yet).
  void* Find(const void* owner) const {
    for (int i = 0; i < kSlots; ++i) {
      const void* o = owners_[i].load(std::memory_order_acquire);
      if (o == owner) return values_[i].load(std::memory_order_acquire);
      if (o == nullptr) return nullptr;  // slots fill in order
    }
    return nullptr;
  }
  // Attaches `value` (not null) for `owner`; false when every slot is
  // taken by other owners. Attaching again for the same owner keeps the
  // first value (a racing attach resolves the same object: either wins).
  bool Attach(const void* owner, void* value) const;

 private:
  mutable std::atomic<const void*> owners_[kSlots] = {};
  mutable std::atomic<void*> values_[kSlots] = {};
};

// The communicator an operation was issued on. One per communicator, shared
// by the records of its operations: its address identifies the
// communicator for as long as a record refers to it.
struct STRATA_EXPORT CommRecord {
  std::string backend;  // "mpi", "gloo", "nccl", ...
  std::string name;     // CommOptions::name: "world", "tp", ...
  int rank = 0;         // this process's rank in the group
  int size = 1;         // the group's size
  int world_rank = 0;   // this process's rank in the job
  // The sinks' per-communicator state (see SinkSlots).
  SinkSlots sink_slots;
};

struct STRATA_EXPORT OpRecord {
  std::shared_ptr<const CommRecord> comm;
  OpKind kind = OpKind::kBarrier;
  // Every operation of the communicator, from 1.
  uint64_t op_id = 0;
  // The communicator's collectives so far, this one included when it is
  // one (split counts as a collective of the parent; a shrink, which only
  // the survivors call, does not advance it).
  uint64_t collective_seq_id = 0;
  // The communicator's sends and receives so far, this one included when
  // it is one.
  uint64_t p2p_seq_id = 0;
  // Elements of this rank's input and output buffers (all-to-all-v: the
  // totals); the flight recorder's input_sizes / output_sizes are [[count]].
  size_t input_count = 0;
  size_t output_count = 0;
  DataType dtype = DataType::kFloat32;
  // "sum", "prod", "min", "max", "avg"; null when the operation does not
  // reduce.
  const char* reduce_op = nullptr;
  // Group ranks; -1 when the operation has none.
  int root = -1;  // broadcast, reduce
  int peer = -1;  // send: the destination; recv: the source
  // The operation's own time limit (OpOptions::timeout, or the
  // communicator's default).
  int64_t timeout_ms = 0;
  OpState state = OpState::kScheduled;
  // Nanoseconds since the Unix epoch; 0 while not seen.
  int64_t time_created_ns = 0;
  int64_t time_started_ns = 0;
  int64_t time_completed_ns = 0;
  // Once completed: OK, or the error the operation ended with.
  absl::Status status;
};

// "<backend>:<op>", with the group ranks of a point-to-point operation as
// PyTorch writes them: "mpi:all_reduce", "nccl:send 0->1", "gloo:recv 1<-0".
STRATA_EXPORT std::string ProfilingName(const OpRecord& record);

// Receives records (see the overview for when, from which threads, and
// what it must not do).
class STRATA_EXPORT OpSink {
 public:
  virtual ~OpSink() = default;
  // Once per operation, on the issuing thread, before the backend starts
  // it. Operations the call rejects (misuse: InvalidArgument) are not
  // operations and are not recorded.
  virtual void OnScheduled(const OpRecord& record) = 0;
  // At most once, when the backend starts the operation.
  virtual void OnStarted(const OpRecord& record) {}
  // Exactly once per OnScheduled: record.state is kCompleted,
  // record.status says how it ended (an operation that failed to start, or
  // was dropped unfinished, ends with that error).
  virtual void OnCompleted(const OpRecord& record) = 0;
  // Each time a caller returns from Work::Wait on the operation, on that
  // thread: how long it was blocked there (a synchronous operation: all of
  // it; one overlapped with compute: only what the overlap did not hide).
  virtual void OnWaited(const CommRecord& comm, OpKind kind, int64_t waited_ns) {}
};

// A sink that hands every call to each of `sinks` in turn (a flight
// recorder and metrics, say). Null entries are skipped.
STRATA_EXPORT std::shared_ptr<OpSink> MakeFanOutSink(std::vector<std::shared_ptr<OpSink>> sinks);

// One recorded operation from issue to completion. The communicator makes
// one per operation when a sink is set and hands it to the backend, which
// reports the start and the completion through it from whatever thread
// sees them; the first report of each wins and later ones are ignored. The
// sink is kept alive until the operation completes. If the last owner lets
// go of a trace that never completed, the operation is reported completed
// with Cancelled ("dropped before it completed"). No lock: the first report
// of each state claims it with one atomic operation; a completion that
// comes while another thread is still telling the sink of the start waits
// for that call to return (its calls come in order).
class STRATA_EXPORT OpTrace {
 public:
  // Calls sink->OnScheduled(record) (record.state must be kScheduled).
  OpTrace(std::shared_ptr<OpSink> sink, OpRecord record);
  ~OpTrace();
  OpTrace(const OpTrace&) = delete;
  OpTrace& operator=(const OpTrace&) = delete;

  // The backend has started the operation (ignored once completed).
  void Started();
  // The operation is done with `status`.
  void Completed(const absl::Status& status);
  // A caller was blocked in Work::Wait for `waited_ns` (OpSink::OnWaited).
  void Waited(int64_t waited_ns);
  // True once the sink has been told of the completion.
  bool completed() const;
  // A copy of the record as the sink has been told it so far.
  OpRecord record() const;

 private:
  // flags_: each state claimed (by the thread that reports it) and done
  // (the sink has been told). A state's fields of record_ are written only
  // by the thread that claimed it, and read by others only once done.
  static constexpr uint8_t kStartClaimed = 1, kStartDone = 2, kCompleteClaimed = 4,
                           kCompleteDone = 8;

  const std::shared_ptr<OpSink> sink_;
  std::atomic<uint8_t> flags_{0};
  OpRecord record_;
};

}  // namespace strata::observe
