// An in-process Communicator for tests of the commit protocol: N endpoints,
// one per "rank", each used by its own thread. Only what the checkpoint
// agreement needs is implemented (AllReduce of int32/int64/uint8
// min/max/sum, Broadcast of the same dtypes); the rest returns
// Unimplemented. A collective completes when every rank
// has issued its n-th collective; Wait() honours its deadline.
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
           std::string what)
      : hub_(std::move(hub)),
        seq_(seq),
        op_(op),
        root_(root),
        recv_(recv),
        what_(std::move(what)) {}
  absl::Status Wait(absl::Time deadline) override {
    if (done_) return absl::OkStatus();
    absl::StatusOr<std::vector<int64_t>> v = hub_->Collect(seq_, op_, root_, deadline, what_);
    if (!v.ok()) return v.status();
    if (v->size() != recv_.count) {
      return absl::InvalidArgumentError(absl::StrCat(what_, ": ranks passed different counts"));
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
    done_ = true;
    return absl::OkStatus();
  }
  absl::StatusOr<bool> Test() override { return done_; }
  std::string Describe() const override { return what_; }

 private:
  std::shared_ptr<FakeHub> hub_;
  int64_t seq_;
  ReduceOp op_;
  int root_;
  Buffer recv_;
  std::string what_;
  bool done_ = false;
};

class FakeComm : public Communicator {
 public:
  FakeComm(std::shared_ptr<FakeHub> hub, int rank) : hub_(std::move(hub)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return hub_->size(); }
  const std::string& name() const override { return hub_->name(); }
  int world_rank() const override { return hub_->world_rank(rank_); }
  absl::string_view backend() const override { return "fake"; }
  MemoryKind memory() const override { return MemoryKind::kHost; }

  absl::StatusOr<std::unique_ptr<Work>> AllReduce(ConstBuffer send, Buffer recv, ReduceOp op,
                                                  const OpOptions&) override {
    if (send.count != recv.count || send.dtype != recv.dtype || !Supported(send.dtype)) {
      return absl::InvalidArgumentError("fake allreduce: int32/int64/uint8 of equal counts only");
    }
    const int64_t seq = seq_++;
    hub_->Contribute(seq, rank_, Values(send));
    return std::unique_ptr<Work>(
        new FakeWork(hub_, seq, op, -1, recv,
                     absl::StrCat("allreduce(", ReduceOpName(op), ") #", seq,
                                  " on fake group (rank ", rank_, ")")));
  }
  absl::StatusOr<std::unique_ptr<Work>> Broadcast(Buffer buffer, int root,
                                                  const OpOptions&) override {
    if (!Supported(buffer.dtype) || root < 0 || root >= size()) {
      return absl::InvalidArgumentError("fake broadcast: int32/int64/uint8 from a rank only");
    }
    const int64_t seq = seq_++;
    hub_->Contribute(seq, rank_, Values(buffer));
    return std::unique_ptr<Work>(new FakeWork(
        hub_, seq, ReduceOp::kSum, root, buffer,
        absl::StrCat("broadcast(root ", root, ") #", seq, " on fake group (rank ", rank_, ")")));
  }
#define STRATA_FAKE_UNIMPLEMENTED(sig) \
  sig override { return absl::UnimplementedError("fake communicator"); }
  STRATA_FAKE_UNIMPLEMENTED(absl::StatusOr<std::unique_ptr<Work>> Reduce(ConstBuffer, Buffer,
                                                                         ReduceOp, int,
                                                                         const OpOptions&))
  STRATA_FAKE_UNIMPLEMENTED(absl::StatusOr<std::unique_ptr<Work>> AllGather(ConstBuffer, Buffer,
                                                                            const OpOptions&))
  STRATA_FAKE_UNIMPLEMENTED(absl::StatusOr<std::unique_ptr<Work>> ReduceScatter(ConstBuffer, Buffer,
                                                                                ReduceOp,
                                                                                const OpOptions&))
  STRATA_FAKE_UNIMPLEMENTED(absl::StatusOr<std::unique_ptr<Work>> AllToAll(ConstBuffer, Buffer,
                                                                           const OpOptions&))
  STRATA_FAKE_UNIMPLEMENTED(absl::StatusOr<std::unique_ptr<Work>> AllToAllV(ConstBuffer, Buffer,
                                                                            const AllToAllCounts&,
                                                                            const OpOptions&))
  STRATA_FAKE_UNIMPLEMENTED(absl::StatusOr<std::unique_ptr<Work>> Barrier(const OpOptions&))
  STRATA_FAKE_UNIMPLEMENTED(absl::StatusOr<std::unique_ptr<Work>> Send(ConstBuffer, int,
                                                                       const OpOptions&))
  STRATA_FAKE_UNIMPLEMENTED(absl::StatusOr<std::unique_ptr<Work>> Recv(Buffer, int,
                                                                       const OpOptions&))
  STRATA_FAKE_UNIMPLEMENTED(absl::StatusOr<std::unique_ptr<Communicator>> Split(int, int,
                                                                                const CommOptions&))
  STRATA_FAKE_UNIMPLEMENTED(absl::StatusOr<std::unique_ptr<Communicator>> Shrink(
      absl::Span<const int>, const CommOptions&))
#undef STRATA_FAKE_UNIMPLEMENTED
  absl::Status Abort() override { return absl::OkStatus(); }
  absl::Status Revoke() override { return absl::UnimplementedError("fake communicator"); }
  absl::Status AsyncError() override { return absl::OkStatus(); }

 private:
  static bool Supported(DataType t) {
    return t == DataType::kInt32 || t == DataType::kInt64 || t == DataType::kUInt8;
  }
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
  int rank_;
  int64_t seq_ = 0;  // used by the rank's one checkpoint writer thread
};

inline std::unique_ptr<Communicator> FakeHub::Endpoint(int rank) {
  return std::make_unique<FakeComm>(shared_from_this(), rank);
}

}  // namespace strata::testing_util
