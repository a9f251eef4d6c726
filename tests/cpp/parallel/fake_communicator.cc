#include "fake_communicator.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace strata::testing {

namespace {

struct Op {
  int rank = 0;
  int peer = 0;
  bool send = false;
  const void* src = nullptr;
  void* dst = nullptr;
  size_t count = 0;
  DataType dtype = DataType::kFloat32;
  bool done = false;
  absl::Status status;

  std::string Describe(const std::string& group) const {
    return absl::StrCat(send ? "send(" : "recv(", count, " x ", DataTypeName(dtype),
                        send ? ") to rank " : ") from rank ", peer, " on fake group ", group,
                        " (rank ", rank, ")");
  }
};

}  // namespace

struct FakeGroup::State {
  State(int n, FakeOrdering o, std::string g, MemoryKind m)
      : size(n), ordering(o), name(std::move(g)), memory(m), issued(n), aborted(n, false) {}

  const int size;
  const FakeOrdering ordering;
  const std::string name;
  const MemoryKind memory;
  // std::mutex rather than absl::Mutex: the system abseil is not built for
  // ThreadSanitizer, which then cannot see its locking.
  mutable std::mutex mu;
  std::condition_variable changed;
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<Op>>> sends;
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<Op>>> recvs;
  std::vector<std::deque<std::shared_ptr<Op>>> issued;
  bool revoked = false;
  int revoked_by = -1;
  std::vector<bool> aborted;
  int64_t matched = 0;

  void Finish(const std::shared_ptr<Op>& op, absl::Status status) {
    op->done = true;
    op->status = std::move(status);
    changed.notify_all();
    auto& q = issued[op->rank];
    q.erase(std::find(q.begin(), q.end(), op));
  }

  // Completes every pair that can complete.
  void Progress() {
    for (bool changed = true; changed;) {
      changed = false;
      for (auto& [channel, out] : sends) {
        auto& in = recvs[channel];
        while (!out.empty() && !in.empty()) {
          std::shared_ptr<Op> s = out.front(), r = in.front();
          if (ordering == FakeOrdering::kInOrder &&
              (issued[s->rank].front() != s || issued[r->rank].front() != r)) {
            break;
          }
          out.pop_front();
          in.pop_front();
          absl::Status st;
          if (s->count != r->count || s->dtype != r->dtype) {
            st = absl::InvalidArgumentError(absl::StrCat("mismatched transfer: ", s->Describe(name),
                                                         " met ", r->Describe(name)));
          } else if (s->count > 0) {
            std::memcpy(r->dst, s->src, s->count * DataTypeSize(s->dtype));
          }
          Finish(s, st);
          Finish(r, st);
          ++matched;
          changed = true;
        }
      }
    }
  }

  void FailPending(int only_rank, const absl::Status& status) {
    for (auto* table : {&sends, &recvs}) {
      for (auto& [channel, q] : *table) {
        for (auto it = q.begin(); it != q.end();) {
          if (only_rank >= 0 && (*it)->rank != only_rank) {
            ++it;
            continue;
          }
          Finish(*it, status);
          it = q.erase(it);
        }
      }
    }
    Progress();
  }
};

namespace {

class FakeWork : public Work {
 public:
  FakeWork(std::shared_ptr<FakeGroup::State> state, std::shared_ptr<Op> op)
      : state_(std::move(state)), op_(std::move(op)) {}

  absl::Status Wait(absl::Time deadline) override {
    std::unique_lock<std::mutex> lock(state_->mu);
    Op* op = op_.get();
    auto done = [op] { return op->done; };
    if (deadline == absl::InfiniteFuture()) {
      state_->changed.wait(lock, done);
    } else if (!state_->changed.wait_until(lock, absl::ToChronoTime(deadline), done)) {
      return absl::DeadlineExceededError(
          absl::StrCat(op->Describe(state_->name), ": deadline passed"));
    }
    return op->status;
  }

  absl::StatusOr<bool> Test() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (!op_->done) return false;
    if (!op_->status.ok()) return op_->status;
    return true;
  }

  std::string Describe() const override { return op_->Describe(state_->name); }

 private:
  std::shared_ptr<FakeGroup::State> state_;
  std::shared_ptr<Op> op_;
};

class FakeComm : public Communicator {
 public:
  FakeComm(std::shared_ptr<FakeGroup::State> state, int rank)
      : state_(std::move(state)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return state_->size; }
  const std::string& name() const override { return state_->name; }
  int world_rank() const override { return rank_; }
  absl::string_view backend() const override { return "fake"; }
  MemoryKind memory() const override { return state_->memory; }

  absl::StatusOr<std::unique_ptr<Work>> AllReduce(ConstBuffer, Buffer, ReduceOp,
                                                  const OpOptions&) override {
    return Unsupported("AllReduce");
  }
  absl::StatusOr<std::unique_ptr<Work>> Broadcast(Buffer, int, const OpOptions&) override {
    return Unsupported("Broadcast");
  }
  absl::StatusOr<std::unique_ptr<Work>> Reduce(ConstBuffer, Buffer, ReduceOp, int,
                                               const OpOptions&) override {
    return Unsupported("Reduce");
  }
  absl::StatusOr<std::unique_ptr<Work>> AllGather(ConstBuffer, Buffer, const OpOptions&) override {
    return Unsupported("AllGather");
  }
  absl::StatusOr<std::unique_ptr<Work>> ReduceScatter(ConstBuffer, Buffer, ReduceOp,
                                                      const OpOptions&) override {
    return Unsupported("ReduceScatter");
  }
  absl::StatusOr<std::unique_ptr<Work>> AllToAll(ConstBuffer, Buffer, const OpOptions&) override {
    return Unsupported("AllToAll");
  }
  absl::StatusOr<std::unique_ptr<Work>> AllToAllV(ConstBuffer, Buffer, const AllToAllCounts&,
                                                  const OpOptions&) override {
    return Unsupported("AllToAllV");
  }
  absl::StatusOr<std::unique_ptr<Work>> Barrier(const OpOptions&) override {
    return Unsupported("Barrier");
  }

  absl::StatusOr<std::unique_ptr<Work>> Send(ConstBuffer buffer, int peer,
                                             const OpOptions&) override {
    return Post(/*send=*/true, buffer.data, nullptr, buffer.count, buffer.dtype, peer);
  }
  absl::StatusOr<std::unique_ptr<Work>> Recv(Buffer buffer, int peer, const OpOptions&) override {
    return Post(/*send=*/false, nullptr, buffer.data, buffer.count, buffer.dtype, peer);
  }

  absl::StatusOr<std::unique_ptr<Communicator>> Split(int, int, const CommOptions&) override {
    return absl::UnimplementedError("FakeGroup has no Split");
  }
  absl::Status Abort() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->aborted[rank_] = true;
    state_->FailPending(rank_, absl::AbortedError(absl::StrCat(
                                   "rank ", rank_, " aborted fake group ", state_->name)));
    return absl::OkStatus();
  }
  absl::Status Revoke() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (!state_->revoked) state_->revoked_by = rank_;
    state_->revoked = true;
    state_->FailPending(
        -1, absl::AbortedError(absl::StrCat("fake group ", state_->name, " was revoked by rank ",
                                            state_->revoked_by)));
    return absl::OkStatus();
  }
  absl::StatusOr<std::unique_ptr<Communicator>> Shrink(absl::Span<const int>,
                                                       const CommOptions&) override {
    return absl::UnimplementedError("FakeGroup has no Shrink");
  }
  absl::Status AsyncError() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->revoked) return absl::AbortedError("fake group revoked");
    if (state_->aborted[rank_]) return absl::AbortedError("fake group aborted on this rank");
    return absl::OkStatus();
  }

 private:
  absl::Status Unsupported(const char* op) const {
    return absl::UnimplementedError(absl::StrCat("FakeGroup does not implement ", op));
  }

  absl::StatusOr<std::unique_ptr<Work>> Post(bool send, const void* src, void* dst, size_t count,
                                             DataType dtype, int peer) {
    if (peer < 0 || peer >= state_->size || peer == rank_) {
      return absl::InvalidArgumentError(
          absl::StrCat("peer ", peer, " is not another rank of fake group ", state_->name));
    }
    if (count > 0 && (send ? src == nullptr : dst == nullptr)) {
      return absl::InvalidArgumentError("null buffer with a nonzero count");
    }
    auto op = std::make_shared<Op>();
    op->rank = rank_;
    op->peer = peer;
    op->send = send;
    op->src = src;
    op->dst = dst;
    op->count = count;
    op->dtype = dtype;
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->aborted[rank_]) {
      return absl::FailedPreconditionError("fake group was aborted on this rank");
    }
    if (state_->revoked) {
      op->done = true;
      op->status = absl::AbortedError(
          absl::StrCat("fake group ", state_->name, " was revoked by rank ", state_->revoked_by));
    } else {
      state_->issued[rank_].push_back(op);
      (send ? state_->sends
            : state_->recvs)[send ? std::make_pair(rank_, peer) : std::make_pair(peer, rank_)]
          .push_back(op);
      state_->Progress();
    }
    return std::unique_ptr<Work>(new FakeWork(state_, op));
  }

  std::shared_ptr<FakeGroup::State> state_;
  const int rank_;
};

}  // namespace

FakeGroup::FakeGroup(int size, FakeOrdering ordering, std::string name, MemoryKind memory)
    : state_(std::make_shared<State>(size, ordering, std::move(name), memory)) {}

FakeGroup::~FakeGroup() = default;

std::unique_ptr<Communicator> FakeGroup::Comm(int rank) {
  return std::make_unique<FakeComm>(state_, rank);
}

int64_t FakeGroup::matched() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->matched;
}

}  // namespace strata::testing
