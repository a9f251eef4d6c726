// An in-process Communicator for tests of the commit protocol: N endpoints,
// one per "rank", each used by its own thread. Only what the checkpoint
// agreement needs is implemented (AllReduce of int32/int64/uint8
// min/max/sum, Broadcast of the same dtypes); the rest returns
// Unimplemented. It implements Communicator's hooks, so misuse is rejected
// by Communicator's own checks, with the real backends' messages, and it
// declares the three dtypes as all it can move and reduce. A collective
// completes when every rank has issued its n-th collective; Wait() honours
// its deadline and the operation's timeout.
//
// (tests/cpp/parallel/fake_communicator.h is the complete fake; this one is
// header-only so that the LibTorch adapter's tests, which link the shared
// library, can use it without more sources.)
//
// Thread-safety: endpoints of one hub may be used from different threads.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "strata/comm/communicator.h"

namespace strata::testing_util {

class FakeHub : public std::enable_shared_from_this<FakeHub> {
 public:
  explicit FakeHub(int size) : size_(size) {}
  // A group named `name` whose rank r is world rank world_ranks[r].
  FakeHub(std::string name, std::vector<int> world_ranks)
      : size_(static_cast<int>(world_ranks.size())),
        name_(std::move(name)),
        world_ranks_(std::move(world_ranks)) {}
  int size() const { return size_; }
  const std::string& name() const { return name_; }
  int world_rank(int rank) const {
    return world_ranks_.empty() ? rank : world_ranks_[static_cast<size_t>(rank)];
  }
  std::unique_ptr<Communicator> Endpoint(int rank);

  struct Round {
    std::vector<std::vector<int64_t>> values;  // per rank, empty until contributed
    int contributed = 0;
    int consumed = 0;
  };

  void Contribute(int64_t seq, int rank, std::vector<int64_t> v) {
    std::lock_guard<std::mutex> l(mu_);
    Round& r = rounds_[seq];
    if (r.values.empty()) r.values.resize(static_cast<size_t>(size_));
    r.values[static_cast<size_t>(rank)] = std::move(v);
    ++r.contributed;
    cv_.notify_all();
  }

  // Waits for round `seq` to be complete and reduces it.
  // With root >= 0 it is a broadcast: the result is root's values.
  absl::StatusOr<std::vector<int64_t>> Collect(int64_t seq, ReduceOp op, int root,
                                               absl::Time deadline, const std::string& what) {
    std::unique_lock<std::mutex> l(mu_);
    auto complete = [this, seq] { return rounds_[seq].contributed == size_; };
    const absl::Duration left =
        std::clamp(deadline - absl::Now(), absl::ZeroDuration(), absl::Hours(24));
    if (!cv_.wait_for(l, absl::ToChronoNanoseconds(left), complete)) {
      return absl::DeadlineExceededError(absl::StrCat(
          what, ": deadline passed with ", rounds_[seq].contributed, " of ", size_, " ranks"));
    }
    Round& r = rounds_[seq];
    std::vector<int64_t> out = r.values[root >= 0 ? static_cast<size_t>(root) : 0];
    for (int i = 1; i < size_ && root < 0; ++i) {
      for (size_t k = 0; k < out.size(); ++k) {
        const int64_t v = r.values[static_cast<size_t>(i)][k];
        switch (op) {
          case ReduceOp::kMin:
            out[k] = std::min(out[k], v);
            break;
          case ReduceOp::kMax:
            out[k] = std::max(out[k], v);
            break;
          default:
            out[k] += v;
        }
      }
    }
    if (++r.consumed == size_) rounds_.erase(seq);
    return out;
  }

 private:
  const int size_;
  const std::string name_ = "fake";
  const std::vector<int> world_ranks_;  // empty: the group is the world
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<int64_t, Round> rounds_;  // guarded by mu_
};

class FakeWork : public Work {
 public:
  FakeWork(std::shared_ptr<FakeHub> hub, int64_t seq, ReduceOp op, int root, Buffer recv,
           std::string what, absl::Time op_deadline, std::shared_ptr<observe::OpTrace> trace)
      : hub_(std::move(hub)),
        seq_(seq),
        op_(op),
        root_(root),
        recv_(recv),
        what_(std::move(what)),
        op_deadline_(op_deadline),
        trace_(std::move(trace)) {}
  absl::Status DoWait(absl::Time deadline) override {
    if (done_) return status_;
    const bool op_limit = op_deadline_ < deadline;
    absl::StatusOr<std::vector<int64_t>> v =
        hub_->Collect(seq_, op_, root_, op_limit ? op_deadline_ : deadline, what_);
    if (!v.ok()) {
      // The wait's own deadline leaves the operation in flight; its timeout ends it.
      if (op_limit) Complete(v.status());
      return v.status();
    }
    if (v->size() != recv_.count) {
      Complete(absl::InvalidArgumentError(absl::StrCat(what_, ": ranks passed different counts")));
      return status_;
    }
    for (size_t i = 0; i < recv_.count; ++i) {
      if (recv_.dtype == DataType::kInt32) {
        static_cast<int32_t*>(recv_.data)[i] = static_cast<int32_t>((*v)[i]);
      } else if (recv_.dtype == DataType::kUInt8) {
        static_cast<uint8_t*>(recv_.data)[i] = static_cast<uint8_t>((*v)[i]);
      } else {
        static_cast<int64_t*>(recv_.data)[i] = (*v)[i];
      }
    }
    Complete(absl::OkStatus());
    return status_;
  }
  absl::StatusOr<bool> Test() override {
    if (!done_) return false;
    if (!status_.ok()) return status_;
    return true;
  }
  std::string Describe() const override { return what_; }

 private:
  void Complete(absl::Status status) {
    done_ = true;
    status_ = std::move(status);
    if (trace_ != nullptr) trace_->Completed(status_);
  }

  std::shared_ptr<FakeHub> hub_;
  int64_t seq_;
  ReduceOp op_;
  int root_;
  Buffer recv_;
  std::string what_;
  absl::Time op_deadline_;
  std::shared_ptr<observe::OpTrace> trace_;
  bool done_ = false;
  absl::Status status_;
};

class FakeComm : public Communicator {
 public:
  FakeComm(std::shared_ptr<FakeHub> hub, int rank)
      : Communicator(Options(hub->name()), Membership{rank, hub->size(), hub->world_rank(rank)},
                     Capabilities()),
        hub_(std::move(hub)) {}
  absl::string_view backend() const override { return "fake"; }
  MemoryKind memory() const override { return MemoryKind::kHost; }

 protected:
  absl::StatusOr<std::unique_ptr<Work>> DoAllReduce(ConstBuffer send, Buffer recv, ReduceOp op,
                                                    const ResolvedOptions& options) override {
    const int64_t seq = seq_++;
    hub_->Contribute(seq, rank(), Values(send));
    return std::unique_ptr<Work>(new FakeWork(hub_, seq, op, -1, recv, options.description,
                                              options.deadline, options.trace));
  }
  absl::StatusOr<std::unique_ptr<Work>> DoBroadcast(Buffer buffer, int root,
                                                    const ResolvedOptions& options) override {
    const int64_t seq = seq_++;
    hub_->Contribute(seq, rank(), Values(buffer));
    return std::unique_ptr<Work>(new FakeWork(hub_, seq, ReduceOp::kSum, root, buffer,
                                              options.description, options.deadline,
                                              options.trace));
  }
#define STRATA_FAKE_UNIMPLEMENTED(sig) \
  sig override { return absl::UnimplementedError("fake communicator"); }
  STRATA_FAKE_UNIMPLEMENTED(absl::StatusOr<std::unique_ptr<Work>> DoReduce(ConstBuffer, Buffer,
                                                                           ReduceOp, int,
                                                                           const ResolvedOptions&))
  STRATA_FAKE_UNIMPLEMENTED(absl::StatusOr<std::unique_ptr<Work>> DoAllGather(
      ConstBuffer, Buffer, const ResolvedOptions&))
  STRATA_FAKE_UNIMPLEMENTED(absl::StatusOr<std::unique_ptr<Work>> DoReduceScatter(
      ConstBuffer, Buffer, ReduceOp, const ResolvedOptions&))
  STRATA_FAKE_UNIMPLEMENTED(
      absl::StatusOr<std::unique_ptr<Work>> DoAllToAll(ConstBuffer, Buffer, const ResolvedOptions&))
  STRATA_FAKE_UNIMPLEMENTED(absl::StatusOr<std::unique_ptr<Work>> DoAllToAllV(
      ConstBuffer, Buffer, const AllToAllCounts&, const ResolvedOptions&))
  STRATA_FAKE_UNIMPLEMENTED(absl::StatusOr<std::unique_ptr<Work>> DoBarrier(const ResolvedOptions&))
  STRATA_FAKE_UNIMPLEMENTED(absl::StatusOr<std::unique_ptr<Work>> DoSend(ConstBuffer, int,
                                                                         const ResolvedOptions&))
  STRATA_FAKE_UNIMPLEMENTED(absl::StatusOr<std::unique_ptr<Work>> DoRecv(Buffer, int,
                                                                         const ResolvedOptions&))
  STRATA_FAKE_UNIMPLEMENTED(absl::StatusOr<std::unique_ptr<Communicator>> DoSplit(
      int, int, const CommOptions&, const ResolvedOptions&))
  STRATA_FAKE_UNIMPLEMENTED(absl::StatusOr<std::unique_ptr<Communicator>> DoShrink(
      const ShrinkPlan&, const CommOptions&, const ResolvedOptions&))
#undef STRATA_FAKE_UNIMPLEMENTED
  absl::Status DoAbort() override { return absl::OkStatus(); }
  absl::Status DoRevoke() override { return absl::UnimplementedError("fake communicator"); }
  absl::Status DoAsyncError() override { return absl::OkStatus(); }

 private:
  static CommOptions Options(const std::string& name) {
    CommOptions options;
    options.name = name;
    return options;
  }
  static bool Supported(DataType t) {
    return t == DataType::kInt32 || t == DataType::kInt64 || t == DataType::kUInt8;
  }
  static CommCapabilities Capabilities() { return CommCapabilities{&Supported, &Supported}; }
  static std::vector<int64_t> Values(ConstBuffer b) {
    std::vector<int64_t> v(b.count);
    for (size_t i = 0; i < b.count; ++i) {
      if (b.dtype == DataType::kInt32) {
        v[i] = static_cast<const int32_t*>(b.data)[i];
      } else if (b.dtype == DataType::kUInt8) {
        v[i] = static_cast<const uint8_t*>(b.data)[i];
      } else {
        v[i] = static_cast<const int64_t*>(b.data)[i];
      }
    }
    return v;
  }

  std::shared_ptr<FakeHub> hub_;
  int64_t seq_ = 0;  // used by the rank's one checkpoint writer thread
};

inline std::unique_ptr<Communicator> FakeHub::Endpoint(int rank) {
  return std::make_unique<FakeComm>(shared_from_this(), rank);
}

}  // namespace strata::testing_util
