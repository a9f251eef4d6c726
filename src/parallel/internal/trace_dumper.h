// TraceDumper: the World's side of the flight recorder: a thread that
// writes this rank's dump when an operation fails, when SIGUSR1 arrives, or
// when another rank asks every rank to (through a file store in the trace
// directory), and the requests themselves.
//
// Triggers reach the thread through a pipe: the recorder's error callback
// and the SIGUSR1 handler only write one byte to it (async-signal-safe, no
// lock), so neither blocks the thread that saw the failure. SIGUSR1 is
// process-wide: the first TraceDumper of the process that finds it at its
// default disposition installs the handler, and puts the old disposition
// back when it is destroyed; others (a second World, a user's own handler)
// leave it alone.
//
// Thread-safety: thread-safe. The destructor joins the thread.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "strata/comm/store.h"
#include "strata/observe/flight_recorder.h"

namespace strata::internal {

struct TraceDumperOptions {
  std::string dir;
  int world_rank = 0;
  int world_size = 1;
  absl::Duration request_poll = absl::Seconds(1);
  std::function<std::optional<std::vector<int>>(const observe::CommRecord&)> group_ranks;
};

class TraceDumper {
 public:
  // What the recorder's error callback (FlightRecorderOptions::on_error)
  // calls: notes the first failure and wakes the dumper attached to it, if
  // any yet. Thread-safe; never blocks on a dump.
  class ErrorHook {
   public:
    void Fire(const observe::OpRecord& record);

   private:
    friend class TraceDumper;
    std::atomic<int> fd{-1};  // the dumper's pipe; -1 while none
    std::mutex mu;
    std::string first_error;
  };

  // Opens the request store in options.dir and starts the thread that
  // dumps `recorder` on requests, on SIGUSR1 and, when `hook` is the one
  // the recorder's on_error fires (null: none), on failures.
  static absl::StatusOr<std::unique_ptr<TraceDumper>> Start(
      std::shared_ptr<observe::FlightRecorder> recorder, std::shared_ptr<ErrorHook> hook,
      TraceDumperOptions options);
  ~TraceDumper();

  const std::shared_ptr<observe::FlightRecorder>& recorder() const { return recorder_; }
  const std::string& dir() const { return options_.dir; }

  absl::StatusOr<std::string> DumpNow(absl::string_view reason);
  absl::StatusOr<std::string> RequestAll(absl::string_view reason);

  // The default dump directory for this process's job.
  static std::string DefaultDir();

 private:
  explicit TraceDumper(TraceDumperOptions options);
  absl::Status Open();
  // The store of requests in the trace directory, opened (and, with
  // `create`, made) on first use; null while it does not exist.
  absl::StatusOr<std::shared_ptr<Store>> RequestStore(bool create);
  void Run();
  // Handles what woke the thread (or the poll's timeout).
  void Handle(char why);

  TraceDumperOptions options_;
  std::shared_ptr<observe::FlightRecorder> recorder_;
  std::mutex store_mu_;
  std::shared_ptr<Store> store_;  // store_mu_
  // Shared with the recorder's error callback, which may outlive this.
  std::shared_ptr<ErrorHook> hook_;
  int write_fd_ = -1;
  int read_fd_ = -1;
  bool owns_signal_ = false;
  std::thread thread_;
  std::mutex dump_mu_;  // one dump at a time; guards seen_
  int64_t seen_ = 0;    // requests handled (the store's counter)
};

}  // namespace strata::internal
