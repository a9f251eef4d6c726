// FlightRecorder: the last K communication operations of this rank, in a
// ring, dumped as PyTorch's flight-recorder JSON when something goes wrong.
//
// A FlightRecorder is an OpSink (op_record.h): name it in CommOptions::sink
// (the World does so by default, see strata/parallel/world.h) and every
// collective and point-to-point operation of that communicator and of the
// communicators split from it lands in the ring with its state (scheduled,
// started, completed), its times and, once completed, its status. When the
// ring is full the oldest entry is overwritten.
//
// Dump() writes the ring in the format of PyTorch's flight recorder
// (c10d's FlightRecorder::dump_json, version "2.10"):
//
//   {"version": "2.10",
//    "pg_config": {"tp": {"name": "tp", "desc": "tp", "ranks": "[0, 1]"}, ...},
//    "pg_status": {"tp": {"last_enqueued_collective": 7,
//                         "last_started_collective": 7,
//                         "last_completed_collective": 6}, ...},
//    "entries": [{"record_id": 0, "pg_id": 1, "process_group": ["tp", "tp"],
//                 "collective_seq_id": 1, "p2p_seq_id": 0, "op_id": 1,
//                 "profiling_name": "mpi:all_reduce", "time_created_ns": ...,
//                 "input_sizes": [[1024]], "input_dtypes": ["Float"],
//                 "output_sizes": [[1024]], "output_dtypes": ["Float"],
//                 "state": "completed", "time_discovered_started_ns": ...,
//                 "time_discovered_completed_ns": ..., "timeout_ms": 600000,
//                 "is_p2p": false, "retired": true, "frames": [],
//                 "strata": {"peer": -1, "root": -1, "reduce_op": "sum",
//                            "group_rank": 0, "group_size": 2, "error": null}}, ...],
//    "strata": {"rank": 3, "world_size": 4, "host": "...", "pid": 123,
//               "reason": "...", "capacity": 2000, "recorded": 5123,
//               "dump_time_ns": ...}}
//
// A process group is named by its communicator's name ("world", "tp",
// "dp-cp"); a second communicator of the same name on this rank (a World
// rebuilt after a failure) is "tp#2", and so on, in the order this rank
// first recorded an operation on each. The group's members ("ranks", job
// ranks) come from DumpOptions::group_ranks; "[]" when it does not know
// them. `strata-trace` (python -m strata.trace) merges the dumps of all
// ranks; PyTorch's fr_trace reads them once converted to its pickle form
// (`strata-trace DIR --torch-pickle OUT`); see docs/observability.md.
//
//   auto recorder = std::make_shared<strata::observe::FlightRecorder>(
//       strata::observe::FlightRecorderOptions{});
//   strata::CommOptions options;
//   options.sink = recorder;                      // children inherit it
//   ... operations ...
//   strata::observe::DumpOptions dump;
//   dump.world_rank = 3; dump.reason = "asked";
//   absl::StatusOr<std::string> path = recorder->Dump("/tmp/trace", dump);
//
// Thread-safety: thread-safe. The ring is preallocated; an OpSink call
// claims its entry's number with one atomic increment (issued) or finds the
// entry among the newest (started, completed: by op_id and communicator,
// read without a lock), then holds that entry's own flag while it copies
// the few changed fields: no mutex, no allocation, no I/O, and threads
// recording different operations never wait for each other (only a dump
// reading that very entry, or an operation still in flight after the ring
// has gone round onto its entry, can make a call wait a copy's time). Dump
// and Snapshot may run at any time from any thread.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "strata/base/export.h"
#include "strata/observe/op_record.h"

namespace strata::observe {

struct STRATA_EXPORT FlightRecorderOptions {
  static constexpr int kVersion = 1;
  int version = kVersion;
  // How many operations the ring keeps (PyTorch's default,
  // TORCH_NCCL_TRACE_BUFFER_SIZE, is 2000). At least 1.
  size_t capacity = 2000;
  // Called (on the thread that saw it) when an operation completes with an
  // error other than Cancelled: a deadline, a backend error, an abort. It
  // must not block (the World's dumper only wakes its thread). Null: none.
  std::function<void(const OpRecord&)> on_error;
};

// One entry of the ring.
struct STRATA_EXPORT RecordedOp {
  // This recorder's count of operations before this one (from 0).
  uint64_t record_id = 0;
  OpRecord record;
};

struct STRATA_EXPORT DumpOptions {
  // This process's rank in the job and the job's size.
  int world_rank = 0;
  int world_size = 1;
  // Why the dump was taken: "deadline: allreduce(...) on group tp ...",
  // "SIGUSR1", "asked by rank 0", "called".
  std::string reason;
  // The job ranks of a communicator's group, in group-rank order; nullopt
  // when unknown. Null: unknown for all.
  std::function<std::optional<std::vector<int>>(const CommRecord&)> group_ranks;
};

class STRATA_EXPORT FlightRecorder final : public OpSink {
 public:
  // CHECK-fails on a capacity of 0 or an unknown version; use Create for
  // options from users.
  explicit FlightRecorder(const FlightRecorderOptions& options);
  // InvalidArgument naming the bad option.
  static absl::StatusOr<std::shared_ptr<FlightRecorder>> Create(
      const FlightRecorderOptions& options);

  void OnScheduled(const OpRecord& record) override;
  void OnStarted(const OpRecord& record) override;
  void OnCompleted(const OpRecord& record) override;

  size_t capacity() const { return capacity_; }
  // Operations recorded so far (including those overwritten).
  uint64_t recorded() const;
  // The ring's entries, oldest first.
  std::vector<RecordedOp> Snapshot() const;

  // The dump as JSON text (see the overview).
  std::string DumpJson(const DumpOptions& options) const;
  // Writes DumpJson into `dir` (created when missing) as
  // strata_trace_rank_<world_rank>.json, atomically (a temporary file
  // renamed over it); returns the file's path. Unavailable names the path
  // and the system's error.
  absl::StatusOr<std::string> Dump(const std::string& dir, const DumpOptions& options) const;

  // The file name Dump writes for `world_rank`.
  static std::string DumpFileName(int world_rank);

 private:
  // One entry of the ring. `busy` guards `op` (held for a copy); the keys
  // (the record_id + 1 the entry holds, 0 while empty, and its operation's
  // op_id and communicator) are also kept in atomics, so that a search
  // reads them without taking the flag.
  struct Slot {
    std::atomic<bool> busy{false};
    std::atomic<uint64_t> id_plus_one{0};
    std::atomic<uint64_t> op_id{0};
    std::atomic<const CommRecord*> comm{nullptr};
    RecordedOp op;
  };
  // Holds a slot's flag for its scope.
  class SlotLock;

  // The slot holding the operation (comm, op_id), searched from the newest,
  // with its flag held (the caller releases it); null when it was
  // overwritten.
  Slot* FindLocked(const OpRecord& record);

  const std::function<void(const OpRecord&)> on_error_;
  const size_t capacity_;
  const std::unique_ptr<Slot[]> slots_;
  std::atomic<uint64_t> next_{0};  // record_id of the next operation
};

}  // namespace strata::observe
