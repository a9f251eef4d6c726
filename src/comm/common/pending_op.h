// The completion side of one started operation, for backends whose
// operations are completed by a thread of their own (Gloo's worker, NCCL's
// watchdog): a description for messages, a deadline, and a status set once.
//
//   auto op = std::make_shared<PendingOp>("allreduce(...) on group tp (...)", deadline);
//   ... worker: op->Complete(status);
//   ... caller: STRATA_RETURN_IF_ERROR(op->Wait(absl::Now() + absl::Seconds(5)));
//
// Thread-safety: thread-safe; Complete may race with Wait and Test.
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "strata/comm/communicator.h"
#include "strata/observe/op_record.h"

namespace strata::comm_internal {

class PendingOp {
 public:
  // `deadline`: when the operation's own timeout passes (the backend fails
  // it then). `trace` (optional): the operation's record, told when it
  // starts and completes.
  PendingOp(std::string description, absl::Time deadline,
            std::shared_ptr<observe::OpTrace> trace = nullptr)
      : description_(std::move(description)), deadline_(deadline), trace_(std::move(trace)) {}

  const std::string& description() const { return description_; }
  absl::Time deadline() const { return deadline_; }

  // The backend has started the operation (for its record).
  void Started() {
    if (trace_ != nullptr) trace_->Started();
  }
  // Marks the operation done with `status`; the first call wins. Returns
  // whether this call completed it.
  bool Complete(const absl::Status& status);
  bool done() const;
  // See Work::Wait and Work::Test.
  absl::Status Wait(absl::Time deadline);
  absl::StatusOr<bool> Test();

 private:
  const std::string description_;
  const absl::Time deadline_;
  const std::shared_ptr<observe::OpTrace> trace_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  absl::Status status_;
};

// A Work over a PendingOp. `poke`, when set, runs before each short slice
// of waiting and in Test, for a backend that learns of completion only when
// asked (NCCL: a CUDA event query).
class PendingWork final : public Work {
 public:
  explicit PendingWork(std::shared_ptr<PendingOp> op, std::function<void()> poke = nullptr)
      : op_(std::move(op)), poke_(std::move(poke)) {}
  absl::Status DoWait(absl::Time deadline) override;
  absl::StatusOr<bool> Test() override;
  std::string Describe() const override { return op_->description(); }

 private:
  std::shared_ptr<PendingOp> op_;
  std::function<void()> poke_;
};

}  // namespace strata::comm_internal
